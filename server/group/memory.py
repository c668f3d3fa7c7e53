"""A rank's memory: what it is for, what the process holds, and giving freed memory back.

Accounted per rank: ``shards`` (this rank's parameter shards, replicated parameters and
buffers), ``resident`` (gathered parameters kept by ``--resident-units``), ``gather_ring`` (the
shared-memory all-gather ring, and this rank's share of it: every rank of the host maps it),
``kv_pool`` (the paged KV cache, allocated whole at startup) and ``runtime`` (everything else in
the proportional set size: the interpreter, libraries, the process group, activations).

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from torch import nn


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 1 << 30


ONEDNN_PRIMITIVE_CACHE = "32"


def tune_allocator() -> bool:
    """Keep freed memory for reuse between steps and bound oneDNN's primitive cache (see the
    module); before any tensor work. The allocator part is glibc only, else a no-op."""
    import os

    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE)
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """``malloc_trim(0)``: hand the allocator's free pages back to the system (glibc only)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


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
                 shared_weights: int = 0, shared_weights_sharers: int = 1):
        # shards: private shard bytes; resident: private gathered copies; shared_weights: the
        # host's one copy of the resident units (shards that are views of it are counted there)
        self.fixed = {"shards": shards, "resident": resident, "kv_pool": kv_pool, "shared_weights": shared_weights,
                      "shared_weights_share": shared_weights // max(1, shared_weights_sharers)}
        self.ring, self.ring_sharers = ring, max(1, ring_sharers)  # the ring grows at the first forwards

    def snapshot(self) -> dict[str, int]:
        ring = self.ring.nbytes if self.ring is not None else 0
        parts = {**self.fixed, "gather_ring": ring, "gather_ring_share": ring // self.ring_sharers}
        now = process_memory()
        accounted = (parts["shards"] + parts["resident"] + parts["shared_weights_share"] + parts["gather_ring_share"]
                     + parts["kv_pool"])
        return {**parts, **now, "runtime": max(0, now["pss"] - accounted)}

