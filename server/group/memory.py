"""A rank's memory: what it is for, what the process holds, and giving freed memory back.

Accounted per rank: ``shards`` (this rank's parameter shards, replicated parameters and
buffers), ``resident`` (gathered parameters kept by ``--resident-units``), ``gather_ring`` (the
shared-memory all-gather ring, and this rank's share of it: every rank of the host maps it),
``kv_pool`` (the paged KV cache, allocated whole at startup), ``state_pool`` (a stateful model's
per-sequence states, server.engine.state: a slot for each sequence the rank runs at most, allocated
whole at startup out of the KV budget) and ``runtime`` (everything else in the proportional set
size: the interpreter, libraries, the process group, activations).

The allocator (glibc), set by :func:`tune_allocator` when a rank starts, and why:

* Freed memory is kept for reuse while the rank works: ``M_MMAP_THRESHOLD`` at its maximum (32
  MiB) and a high ``M_TRIM_THRESHOLD``. FSDP2 frees every unit's gathered parameters after its
  forward and allocates them again at the next step; with glibc's defaults a buffer of that size
  is a fresh ``mmap`` each time, whose pages the kernel faults in and zeroes again: measured on
  the 80M bench Llama (float32, 16 sequences per rank), a step through shared memory took 0.19 s
  with the defaults and 0.12 s with memory kept (``python -m benchmarks.step``).
* oneDNN (bf16 matmuls on CPU) caches a compiled primitive per shape it sees, 1024 by default,
  and a serving rank sees many shapes (the tokens of a step vary): on the 80M bench Llama in
  bf16 a rank's heap grew by 200 MB under load with the default and by 106 MB with 16 kept
  (same throughput). :func:`tune_allocator` sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` to 32 unless
  the environment sets it.
* Kept memory goes back when it is no longer worth keeping: loading frees a whole model's worth
  of read buffers (a rank held a model more than its shard after load, with glibc's defaults).
  After the load, after the KV pool is allocated, and whenever a rank goes idle after work (at
  most every 10 s), :func:`release_freed_memory` calls ``malloc_trim(0)``, which returns the free
  pages inside the heap to the system too (glibc >= 2.8), not only the heap's top.
* One arena per rank (``M_ARENA_MAX`` 1, unless ``MALLOC_ARENA_MAX`` is set): glibc gives each
  thread that allocates its own arena, and a thread arena's top is never given back, neither by
  ``malloc_trim`` (it trims the main arena's top only) nor on free with the trim threshold
  above. Rank 0 works on threads (HTTP, the step drivers, tokenizing, grammars): measured on the
  80M bench Llama after a 150 s soak (``python -m benchmarks.soak``), its PSS stayed 190 MB above
  idle, the growth in four thread arenas of 35-47 MB each, against 26 MB with one arena (and
  tracemalloc found 1.8 MB of Python objects left); after the 20-minute soak +30 MB against +84
  MB. The threads then share one lock: the serving benchmark's throughput was unchanged; whether
  it adds to the soak's TTFT tail (p99 ratio 3.14 against 2.69, one run each) is not settled
  (RESULTS.md, session 10).
* Rank 0's HTTP side allocates without the engine working: a request refused before it reaches
  the engine (a prompt of 60k words tokenized, then 400) leaves its tokenizer buffers in the
  allocator of the thread that tokenized it, and its connection's buffers in reference cycles
  until the collector's next full pass. Measured on the 80M bench Llama: 400 such requests left
  rank 0 247 MB larger, a trim gave 170 MB back. :class:`QuietReclaimer` (a thread of rank 0)
  collects the cycles and trims whenever the group has had no work for a few seconds and the
  process has grown since it last did (at most every 10 s: a full collection holds the GIL for
  milliseconds to tens of them, never while a request runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import threading
from collections.abc import Callable

from torch import nn

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 1 << 30


ONEDNN_PRIMITIVE_CACHE = "32"


def tune_allocator() -> bool:
    """Keep freed memory for reuse between steps, one arena for every thread, and bound oneDNN's
    primitive cache (see the module); before any tensor work and before the rank starts threads.
    The allocator part is glibc only, else a no-op."""
    import os

    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE)
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    arenas = "MALLOC_ARENA_MAX" in os.environ or libc.mallopt(_M_ARENA_MAX, 1)  # the environment may say
    return bool(arenas and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
                and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """``malloc_trim(0)``: hand the allocator's free pages back to the system (glibc only)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


class QuietReclaimer:
    """A daemon thread: every ``every_s``, if ``quiet()`` (no request running or waiting) and this
    process's anonymous memory has grown by ``grow_bytes`` since the last pass, ``gc.collect()``
    then :func:`release_freed_memory` (see the module). :meth:`pass_now` runs one pass at once."""

    def __init__(self, quiet: Callable[[], bool], *, every_s: float = 10.0, grow_bytes: int = 32 << 20):
        self.quiet, self.every_s, self.grow_bytes = quiet, every_s, grow_bytes
        self.passes = 0
        self._after = process_memory()["anon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hsdp-reclaim", daemon=True)

    def start(self) -> QuietReclaimer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def pass_now(self) -> int:
        """Collect and trim; the bytes the process's anonymous memory shrank by."""
        before = process_memory()["anon"]
        collected = gc.collect()
        release_freed_memory()
        self._after = process_memory()["anon"]
        self.passes += 1
        logger.info("quiet: collected %d objects, anonymous memory %.0f -> %.0f MB", collected, before / 1e6,
                    self._after / 1e6)
        return before - self._after

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.quiet() and process_memory()["anon"] - self._after > self.grow_bytes:
                self.pass_now()


def process_memory() -> dict[str, int]:
    """This process's resident (rss), proportional (pss, shared pages split among their users) and
    anonymous memory, in bytes (Linux; zeros elsewhere)."""
    out = {"rss": 0, "pss": 0, "anon": 0}
    keys = {"Rss:": "rss", "Pss:": "pss", "Anonymous:": "anon"}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in keys:
                    out[keys[parts[0]]] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def tensor_bytes(model: nn.Module) -> int:
    """What this rank holds of the model's parameters and buffers (sharded ones: its shard)."""
    from shard_engine import local_parameter_bytes

    return local_parameter_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())


class MemoryReport:
    """One rank's accounting; the fixed parts are measured once, the process's figures each time."""

    def __init__(self, *, shards: int, resident: int, kv_pool: int, ring=None, ring_sharers: int = 1,
                 shared_weights: int = 0, shared_weights_sharers: int = 1, states=None, device=None):
        # shards: private shard bytes; resident: private gathered copies; shared_weights: the
        # host's one copy of the resident units (shards that are views of it are counted there)
        self.fixed = {"shards": shards, "resident": resident, "kv_pool": kv_pool, "shared_weights": shared_weights,
                      "shared_weights_share": shared_weights // max(1, shared_weights_sharers)}
        self.ring, self.ring_sharers = ring, max(1, ring_sharers)  # the ring grows at the first forwards
        self.states = states  # a stateful model's server.engine.state.StatePool (allocated whole at startup)
        # a GPU rank's parts are device memory: none of them is in the process's host figures (runtime is
        # all of its PSS), and the device's own allocated bytes are reported beside them
        self.device = device if device is not None and device.type != "cpu" else None

    def snapshot(self) -> dict[str, int]:
        ring = self.ring.nbytes if self.ring is not None else 0
        parts = {**self.fixed, "gather_ring": ring, "gather_ring_share": ring // self.ring_sharers,
                 "state_pool": self.states.nbytes if self.states is not None else 0}
        now = process_memory()
        if self.device is not None:
            import torch

            device = {"device_allocated": torch.cuda.memory_allocated(self.device),
                      "device_reserved": torch.cuda.memory_reserved(self.device)} if self.device.type == "cuda" else {}
            return {**parts, **now, **device, "runtime": now["pss"]}
        accounted = (parts["shards"] + parts["resident"] + parts["shared_weights_share"] + parts["gather_ring_share"]
                     + parts["kv_pool"] + parts["state_pool"])
        return {**parts, **now, "runtime": max(0, now["pss"] - accounted)}

