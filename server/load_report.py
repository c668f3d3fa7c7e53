"""``hsdp-load``: load a checkpoint into an HSDP group, generate once, print one JSON report.

    hsdp-load --nproc-per-node 2                     # the default model on 2 local ranks
    hsdp-load --model DIR --replicate-size 2 --dtype bfloat16
    torchrun --nproc-per-node 4 -m server.load_report --model DIR   # one torchrun per node

Every rank streams its shards of the checkpoint in, then all ranks run one greedy ``generate``
of the same prompt together; rank 0 prints the report (stdout holds nothing else). Any rank's
failure ends the group with a non-zero exit and one ``hsdp-load: error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loaders import READ_MODES, load_hsdp_model
from server.config import DEVICE_TYPES, DTYPES, ServeConfig, add_options
from server.group.launch import GroupError, launch_group
from server.group.logs import configure_logging
from server.group.process_group import init_rank, is_under_torchrun, resolve_device_type, resolve_nproc_per_node, \
    resolve_world_size
from shard_engine import HSDPInferenceConfig, wire

PROG = "hsdp-load"
DEFAULT_PROMPT = "Once upon a time"


@dataclass(kw_only=True)
class LoadReportConfig:
    """What every rank of an ``hsdp-load`` run does; the same object is sent to every rank."""

    model_dir: str | None = None
    """A local Hugging Face checkpoint directory (safetensors, config.json, tokenizer);
    None until :func:`main` resolves ``--model`` there, before any rank starts."""

    hsdp: HSDPInferenceConfig
    """The replicate x shard mesh and FSDP2 policies."""

    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per local rank)."""

    dtype: str = "auto"
    """Dtype the model is loaded in; ``auto`` keeps the checkpoint's."""

    read_mode: str = "sliced"
    """``sliced`` reads only this rank's rows of each sharded tensor; ``full`` reads whole tensors."""

    prompt: str = DEFAULT_PROMPT
    """The text every rank generates from."""

    max_new_tokens: int = 16
    """Tokens generated, exactly: generation never stops early, see :func:`generate_greedy`."""

    timeout_s: float = 1800.0
    """Longest any collective may wait, loading included (the slowest rank's read)."""

    def __post_init__(self) -> None:
        if self.device not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {DEVICE_TYPES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, got {self.read_mode!r}")
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")


@torch.no_grad()
def generate_greedy(loaded, prompt: str, max_new_tokens: int, device: torch.device) -> dict | None:
    """Greedy-generate ``max_new_tokens`` tokens from ``prompt``; None without a tokenizer.

    Every rank must run the same number of forwards, FSDP's all-gathers being collectives:
    the input is the same everywhere and ``min_new_tokens`` keeps EOS from ending one rank early.
    Every rank reads the same checkpoint, so every rank has a tokenizer or none does.
    """
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        return None
    input_ids_BT = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    output_ids_BT = loaded.model.generate(
        input_ids_BT,
        attention_mask=torch.ones_like(input_ids_BT),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
    )
    seconds = time.perf_counter() - start
    new_ids = output_ids_BT[0, input_ids_BT.shape[1]:].tolist()
    return {
        "prompt": prompt,
        "prompt_tokens": input_ids_BT.shape[1],
        "new_tokens": len(new_ids),
        "token_ids": new_ids,
        "text": tokenizer.decode(new_ids, skip_special_tokens=True),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(len(new_ids) / seconds, 2) if seconds > 0 else None,
    }


def run_load_report(config: LoadReportConfig) -> dict | None:
    """One rank's work: join the group, load, generate; rank 0 returns the report, others None."""
    assert config.model_dir is not None, "main resolves the checkpoint before launching"
    device = init_rank(config.device, config.timeout_s)
    loaded = load_hsdp_model(
        config.model_dir,
        config.hsdp,
        device=device,
        dtype=config.dtype,  # auto: the checkpoint's, float32 where the CPU has no native bf16/fp16
        read_mode=config.read_mode,
    )
    generation = generate_greedy(loaded, config.prompt, config.max_new_tokens, device)
    rank_stats = {"rank": dist.get_rank(), "host": socket.gethostname(), "device": str(device)}
    rank_stats.update(loaded.stats.as_dict())
    rank_stats["phase_seconds"] = {k: round(v, 3) for k, v in rank_stats["phase_seconds"].items()}
    # An all-gather over the default group (plain data, no pickle); every rank reaches it after the same generate.
    gathered = wire.all_gather(rank_stats)
    if dist.get_rank() != 0:
        return None
    return build_report(config, loaded, gathered, generation)


def build_report(config: LoadReportConfig, loaded, rank_stats: list[dict], generation: dict | None) -> dict:
    mesh = loaded.context.mesh
    param_dtype = next(loaded.model.parameters()).dtype
    return {
        "model_dir": config.model_dir,
        "model_type": getattr(loaded.config, "model_type", None),
        "world_size": dist.get_world_size(),
        "mesh_shape": {axis: mesh[axis].size() for axis in mesh.mesh_dim_names},
        "device_type": config.device,
        "dtype": str(param_dtype).removeprefix("torch."),
        "read_mode": config.read_mode,
        "load_seconds": round(max(r["phase_seconds"]["total"] for r in rank_stats), 3),
        "ranks": rank_stats,
        "generation": generation,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # the options it shares with hsdp-serve, declared once (server.config)
    add_options(parser, ("model", "nproc_per_node", "replicate_size", "shard_size", "device", "dtype", "read_mode",
                         "log_level"))
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N")
    parser.add_argument(
        "--timeout-s", type=float, default=1800.0, metavar="S", help="process-group timeout (default 1800)"
    )
    return parser


def build_config(args: argparse.Namespace) -> tuple[LoadReportConfig, int]:
    """Map the flags onto a config and the ranks per node; ValueError names the flag at fault."""
    device = resolve_device_type(args.device)
    nproc_per_node = resolve_nproc_per_node(args.nproc_per_node, device)
    world_size = resolve_world_size(nproc_per_node)
    local_world_size = nproc_per_node if not is_under_torchrun() else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # the mesh as hsdp-serve resolves the same flags (replicate auto: one replica per node under torchrun)
    hsdp = ServeConfig(replicate_size=args.replicate_size, shard_size=args.shard_size).mesh_config(
        world_size, local_world_size)
    try:
        hsdp.resolve_mesh_shape(world_size)
    except ValueError as e:
        raise ValueError(f"--replicate-size/--shard-size do not fit {world_size} rank(s): {e}") from None
    config = LoadReportConfig(
        model_dir=None,
        hsdp=hsdp,
        device=device,
        dtype=args.dtype,
        read_mode=args.read_mode,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        timeout_s=args.timeout_s,
    )
    return config, nproc_per_node


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config, nproc_per_node = build_config(args)
    except ValueError as e:
        # Not parser.error: a screen of usage would bury the one line that matters.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from loaders.sources import resolve_model_on_node

    try:
        # Here, before any rank starts (one process per node fetches), so ranks never race.
        config.model_dir = resolve_model_on_node(args.model).path
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        report = launch_group(
            run_load_report, (config,), nproc_per_node=nproc_per_node, log_level=args.log_level
        )
    except GroupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    if report is not None:
        print(json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
