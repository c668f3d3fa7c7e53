"""Resident units gathered once per host, into shared memory, instead of once per rank.

When every rank of a shard group runs on one host (CPU ranks), a resident unit's gathered
parameters are the same bytes on every rank. :func:`share_resident_units` keeps them in one
shared-memory file per shard group, mapped by each rank, and makes each rank's local shard a view
of its own rows there. A host then holds the model once (each rank's proportional share is its
shard, as with plain sharding) while no forward gathers anything: the speed of
``set_resident_units(model, -1)`` at the memory of no residency.

How, in FSDP2's terms: FSDP2 copies a unit's all-gather result out into one persistent tensor
per parameter (``FSDPParam.all_gather_outputs``, padded to ``world x shard``), of which the
unsharded parameter is a view, and allocates those tensors only when they are empty. Each is
pre-set here to a slice of the shared file (``torch.frombuffer`` over one ``mmap``: a storage of
exactly the slice's size, so FSDP's "allocate if the size differs" leaves it alone) before the
unit's one all-gather, so the copy-out writes into shared memory: every rank writes the same
bytes once, at startup. The rank's padded shard is a contiguous run of its parameter's padded
whole (rows ``rank x chunk`` on), so the shard becomes a view of it and its private copy is freed.

Shared storage cannot be freed by FSDP (its reshard resizes storages to 0): before a shared unit
may reshard, :meth:`SharedWeights.release` gives every parameter private memory again.
:func:`shard_engine.overlap.set_resident_units` calls it whenever residency changes.

Collective over the default group, like the all-gathers it replaces. The file lives in a
directory of its own under /dev/shm (:mod:`shard_engine.shm`: mode 0700, created exclusively, its
space reserved up front) and is unlinked as soon as every rank has mapped it: the pages live
while a rank maps them, and no crash, SIGKILL included, can leave them behind.

Other FSDP paths that reshard (``state_dict``, ``FSDPModule.reshard``) cannot free shared storage
either: call :meth:`SharedWeights.release` (``shared_weights_of(model).release()``) before them.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from shard_engine.shm import TENSOR_ALIGN_BYTES, disown, map_shared, open_shared_directory, own
from shard_engine.torch_private import (
    bind_gathered,
    bind_shard,
    compute_device,
    finish_lazy_init,
    fsdp_params,
    gathered_dtype,
    gathered_output,
    is_row_sharded,
    local_shard,
    padded_shard,
    param_group,
    shard_process_group,
    shard_rank,
    shard_world_size,
)
from shard_engine.units import fsdp_units

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "weights"
"""The shared file's name in its directory."""


class SharedWeights:
    """One shard group's shared copy of its resident units, as one rank maps it."""

    def __init__(self, directory: str, path: str, size: int, units: list, sharers: int):
        self.directory, self.path, self.size, self.sharers = directory, path, size, sharers
        self._units = units  # the shared units (they reshard on release)
        self._entries: list = []  # (fsdp_param, offset, numel, dtype, shard_is_view), as they are shared
        self._map = map_shared(path, size)
        own(directory)
        atexit.register(self._remove_files)

    @property
    def nbytes(self) -> int:
        """Bytes of the shared file (every rank of the group maps the same pages)."""
        return self.size

    @property
    def shard_view_bytes(self) -> int:
        """Bytes of this rank's local shards that are views of the shared file, not private memory."""
        return sum(local_shard(p).numel() * local_shard(p).element_size()
                   for p, *_, is_view in self._entries if is_view)  # without FSDP's padding, as shards count

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel == 0:  # frombuffer refuses an empty slice
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset)

    def release(self) -> None:
        """Reshard the shared units with private shards again (same values), then unmap and remove
        the file. Collective-free; gathering them again is the caller's (``set_resident_units``)."""
        for fsdp_param, _, _, _, is_view in self._entries:
            if is_view:
                bind_shard(fsdp_param, padded_shard(fsdp_param).clone())
        reshard_privately(self._units, [entry[:4] for entry in self._entries])
        self._entries, self._units = [], []
        self._map = None  # unmapped once the last view is gone
        self._remove_files()

    def _remove_files(self) -> None:
        disown(self.directory)
        atexit.unregister(self._remove_files)


def share_resident_units(model: nn.Module, count: int, *, run_id: str | None = None) -> SharedWeights | None:
    """Gather the first ``count`` units in forward order (-1: all) into one shared file per shard
    group and keep them gathered; returns the mapping, or None, having changed nothing, where
    the group's ranks cannot share memory (not on CPU, several hosts, /dev/shm too small).

    The units must be sharded (not resident) when this is called. Collective over the default
    group: every rank calls it in the same place.
    """
    units = fsdp_units(model)
    count = len(units) if count < 0 else min(count, len(units))
    chosen = [u for u in units[:count] if param_group(u) is not None]
    groups = {id(g): g for g in map(shard_process_group, chosen)}
    param = next(model.parameters(), None)
    reason = None
    if not chosen:
        reason = "no unit to share"
    elif len(groups) != 1:
        reason = "the model has no single FSDP shard group"
    elif param is None or param.device.type != "cpu" or any(compute_device(u).type != "cpu" for u in chosen):
        reason = "the units do not compute on the CPU"  # GPUs, and FSDP's CPU offload onto them
    layout, size = [], 0
    for unit in chosen:
        entries, size = param_major_layout(unit, size)
        layout += entries
    group = next(iter(groups.values())) if len(groups) == 1 else None
    # reserved now: a full /dev/shm is ENOSPC here (and the fallback), not SIGBUS in the middle of
    # the gather (several shard groups of one host check at once)
    directory = open_shared_directory(group, "w", size, reason=reason, run_id=run_id,
                                      fallback="no shared copy of the resident units",
                                      files=((WEIGHTS_FILE, max(size, 1)),))
    if directory is None:
        return None

    ranks = dist.get_process_group_ranks(group)
    path = os.path.join(directory, WEIGHTS_FILE)
    shared = SharedWeights(directory, path, max(size, 1), chosen, sharers=len(ranks))
    for fsdp_param, offset, numel, dtype in layout:
        bind_gathered(fsdp_param, shared.tensor(offset, numel, dtype))  # FSDP2 copies the unit out into it
    for unit in chosen:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units[:count]:  # gather now, in the same order on every rank
        unit.unshard()
    dist.barrier()  # every rank's copy-out is done (and every rank has mapped the file)
    if dist.get_rank() == ranks[0]:
        # Unlinked now: the pages live as long as a rank maps them, and no crash can leak them.
        shared._remove_files()
    dist.barrier()  # on return, on every rank, the name is gone
    for fsdp_param, offset, numel, dtype in layout:
        shard = padded_shard(fsdp_param)
        # a view only where this rank's padded shard is a contiguous run of the whole: Shard(0)
        is_view = shard.dtype == dtype and is_row_sharded(fsdp_param) and shard.numel() > 0
        if is_view:
            whole = gathered_output(fsdp_param)
            bind_shard(fsdp_param, whole.narrow(0, shard_rank(fsdp_param) * shard.numel(), shard.numel()))
        shared._entries.append((fsdp_param, offset, numel, dtype, is_view))
    return shared


def param_major_layout(unit, offset: int = 0) -> tuple[list, int]:
    """Where ``unit``'s parameters go, gathered whole (padded as FSDP2 gathers them), one after
    another from byte ``offset``: ``[(fsdp_param, offset, numel, dtype)]`` and the offset after
    the last. The layout of the shared copy here and of the unit ring's slots
    (:mod:`shard_engine.shm_all_gather`)."""
    finish_lazy_init(unit)  # dtypes (mixed precision) are settled here
    world = shard_world_size(unit)
    entries = []
    for fsdp_param in fsdp_params(unit):
        dtype = gathered_dtype(fsdp_param)
        numel = padded_shard(fsdp_param).numel() * world
        entries.append((fsdp_param, offset, numel, dtype))
        offset += -(-numel * dtype.itemsize // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES
    return entries, offset


def reshard_privately(units: list, layout: list) -> None:
    """Give each parameter of ``layout`` (:func:`param_major_layout`'s entries) a private gathered
    output again and reshard ``units``: FSDP's reshard frees that output (resizes it to nothing),
    which it cannot do to shared storage; the next gather allocates it again."""
    for fsdp_param, _, numel, dtype in layout:
        bind_gathered(fsdp_param, torch.empty(numel, dtype=dtype))  # never written
    for unit in units:
        unit.set_reshard_after_forward(True, recurse=False)
        unit.reshard()
