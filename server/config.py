"""The server's configuration, and the command line that maps onto it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from server.launch import DEVICE_TYPES, LOG_LEVELS, int_or_keyword, parse_nproc_per_node

DTYPES = ("auto", "float32", "bfloat16", "float16")
ALL_GATHERS = ("auto", "shm", "group")
MIN_STEP_TIMEOUT_S = 2.0


@dataclass(kw_only=True)
class ServeConfig:
    model: str | None = None
    """Checkpoint directory; None serves the embedded demo checkpoint (random weights)."""

    nproc_per_node: int | None = None
    """Ranks started on this node; None (``auto``): one per visible GPU on cuda, 2 on cpu.
    Ignored under torchrun, which decides."""

    replicate_size: int = 1
    shard_size: int = -1
    device: str | None = None
    """cpu or cuda; None picks cuda when available."""

    dtype: str = "auto"
    """Weights' dtype: auto keeps the checkpoint's."""

    read_mode: str = "sliced"
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str | None = None

    max_concurrent_requests: int = 128
    """Sequences decoding at once over the whole group; more wait in the queue."""

    max_queued_requests: int = 256
    """Requests waiting for admission beyond the running ones; more get 429."""

    max_input_tokens: int | None = None
    """Longest prompt; default max_total_tokens - 1."""

    max_total_tokens: int | None = None
    """Prompt plus new tokens; default the model's maximum positions (at most 4096)."""

    collective_timeout_s: float = 600.0
    """Bound on any single collective (a forward's all-gathers, a control step)."""

    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before they are cut short."""

    step_timeout_s: float = 300.0
    """A step (one forward on every rank) longer than this dumps stacks and stops the group."""

    api_key: str | None = None
    """Require ``Authorization: Bearer <key>`` on every endpoint but the probes and /metrics."""

    max_body_bytes: int = 1024 * 1024
    """Largest request body accepted; larger ones get 413."""

    prefetch_depth: int = 2
    """Units whose all-gathers each unit's forward starts ahead (overlap with compute); 0: none."""

    all_gather: str = "auto"
    """How units gather their parameters: shm (shared memory, CPU ranks of one host), group
    (the process group's all-gather: gloo or NCCL), or auto (shm where it works, unless every
    unit is resident)."""

    resident_units: int = 0
    """Units, in forward order, that keep their gathered parameters after the first gather
    (memory for speed); -1: all of them."""

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.device is not None and self.device not in DEVICE_TYPES:
            raise ValueError(f"--device must be one of {DEVICE_TYPES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("max_concurrent_requests", "max_input_tokens", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.step_timeout_s < MIN_STEP_TIMEOUT_S:
            # ranks other than 0 wait for the next plan under the watch, up to rank 0's idle wait (1 s)
            raise ValueError(f"--step-timeout must be >= {MIN_STEP_TIMEOUT_S:g} s, got {self.step_timeout_s:g}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.all_gather not in ALL_GATHERS:
            raise ValueError(f"--all-gather must be one of {ALL_GATHERS}, got {self.all_gather!r}")
        if self.prefetch_depth < 0:
            raise ValueError(f"--prefetch-depth must be >= 0, got {self.prefetch_depth}")
        if self.resident_units < -1:
            raise ValueError(f"--resident-units must be >= 0 or 'all', got {self.resident_units}")
        if self.collective_timeout_s <= 0:
            raise ValueError("--collective-timeout must be positive")

    @property
    def torch_dtype(self):
        import torch

        return None if self.dtype == "auto" else getattr(torch, self.dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hsdp-serve",
        description="Serve a Hugging Face causal LM sharded over a group of ranks with FSDP2 (HSDP).",
    )
    p.add_argument("--model", help="checkpoint directory (default: the embedded random-weight demo)")
    p.add_argument("--nproc-per-node", type=parse_nproc_per_node, default=None, metavar="N|auto",
                   help="ranks on this node (default auto: one per visible GPU on cuda, 2 on cpu)")
    p.add_argument("--replicate-size", type=int, default=1)
    p.add_argument("--shard-size", type=int, default=-1, help="-1: world size // replicate size")
    p.add_argument("--device", choices=DEVICE_TYPES, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--read-mode", choices=("sliced", "full"), default="sliced")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", choices=LOG_LEVELS)
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-queued-requests", type=int, default=256)
    p.add_argument("--max-input-tokens", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=float, default=600.0)
    p.add_argument("--step-timeout", dest="step_timeout_s", type=float, default=300.0)
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=30.0)
    p.add_argument("--api-key", default=os.environ.get("HSDP_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' (default: $HSDP_API_KEY; none: no check)")
    p.add_argument("--max-body-bytes", type=int, default=1024 * 1024)
    p.add_argument("--prefetch-depth", type=int, default=2, metavar="N",
                   help="all-gathers each unit starts ahead, overlapping compute (default 2; 0: none)")
    p.add_argument("--all-gather", choices=ALL_GATHERS, default="auto",
                   help="shm: through shared memory (CPU ranks of one host); group: the process group's "
                        "(gloo, NCCL); auto (default): shm where every rank maps the same /dev/shm")
    p.add_argument("--resident-units", type=int_or_keyword("all", -1, 0), default=0, metavar="K|all",
                   help="units (in forward order) that keep their gathered parameters: speed for memory "
                        "(default 0)")
    return p


def parse_serve_config(argv: list[str] | None = None) -> ServeConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ServeConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
