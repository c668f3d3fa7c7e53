"""A rank's memory: what it is for, what the process holds, and giving freed memory back.

Accounted per rank: ``shards`` (this rank's parameter shards, replicated parameters and
buffers), ``resident`` (gathered parameters kept by ``--resident-units``), ``gather_ring`` (the
shared-memory all-gather ring, and this rank's share of it: every rank of the host maps it),
``kv_pool`` (the paged KV cache, allocated whole at startup) and ``runtime`` (everything else in
the proportional set size: the interpreter, libraries, the process group, activations).

glibc keeps freed memory in its heaps, and loading frees a lot (read buffers of every size): a
rank held a whole model more than its shard after load until that memory went back. After the
load, after the KV pool is allocated, and whenever a rank goes idle after work (at most every 10
s), :func:`release_freed_memory` calls ``malloc_trim(0)``, which returns the free pages inside
the heap to the system too (glibc >= 2.8), not only the heap's top. That is chosen over a fixed
``M_MMAP_THRESHOLD``, which would give memory back as well but turns every activation tensor of
a step into an ``mmap``/``munmap`` pair with fresh page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch
from torch import nn


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


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

    def __init__(self, *, shards: int, resident: int, kv_pool: int, ring=None, ring_sharers: int = 1):
        self.fixed = {"shards": shards, "resident": resident, "kv_pool": kv_pool}
        self.ring, self.ring_sharers = ring, max(1, ring_sharers)  # the ring grows at the first forwards

    def snapshot(self) -> dict[str, int]:
        ring = self.ring.nbytes if self.ring is not None else 0
        parts = {**self.fixed, "gather_ring": ring, "gather_ring_share": ring // self.ring_sharers}
        now = process_memory()
        accounted = parts["shards"] + parts["resident"] + parts["gather_ring_share"] + parts["kv_pool"]
        return {**parts, **now, "runtime": max(0, now["pss"] - accounted)}


def device_memory(device: torch.device) -> dict[str, int]:
    """On a GPU: what torch has allocated and reserved there."""
    if device.type != "cuda":
        return {}
    return {"cuda_allocated": torch.cuda.memory_allocated(device), "cuda_reserved": torch.cuda.memory_reserved(device)}
