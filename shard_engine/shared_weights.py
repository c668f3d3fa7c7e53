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
directory of its own under /dev/shm (mode 0700, created exclusively, its space reserved up front)
and is unlinked as soon as every rank has mapped it: the pages live while a rank maps them, and
no crash, SIGKILL included, can leave them behind.

Other FSDP paths that reshard (``state_dict``, ``FSDPModule.reshard``) cannot free shared storage
either: call :meth:`SharedWeights.release` (``shared_weights_of(model).release()``) before them.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os

import torch
import torch.distributed as dist
from torch import nn

from shard_engine import wire
from shard_engine.overlap import fsdp_units, unit_param_group
from shard_engine.shm_all_gather import disown, own

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"
_ALIGN = 64


class SharedWeights:
    """One shard group's shared copy of its resident units, as one rank maps it."""

    def __init__(self, directory: str, path: str, size: int, units: list, sharers: int):
        self.directory, self.path, self.size, self.sharers = directory, path, size, sharers
        self._units = units  # the shared units (they reshard on release)
        self._entries: list = []  # (fsdp_param, offset, numel, dtype, shard_is_view), as they are shared
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        own(directory)
        atexit.register(self._remove_files)

    @property
    def nbytes(self) -> int:
        """Bytes of the shared file (every rank of the group maps the same pages)."""
        return self.size

    @property
    def shard_view_bytes(self) -> int:
        """Bytes of this rank's local shards that are views of the shared file, not private memory."""
        return sum(p.sharded_param._local_tensor.numel() * p.sharded_param._local_tensor.element_size()
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
                _bind_shard(fsdp_param, fsdp_param._sharded_param_data.clone())
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
    from shard_engine.shm_all_gather import _probe, agree_on_shared_memory, job_token

    units = fsdp_units(model)
    count = len(units) if count < 0 else min(count, len(units))
    chosen = [u for u in units[:count] if unit_param_group(u) is not None]
    groups = {id(g.mesh_info.shard_process_group): g for g in map(unit_param_group, chosen)}
    param = next(model.parameters(), None)
    reason = None
    if not chosen:
        reason = "no unit to share"
    elif len(groups) != 1:
        reason = "the model has no single FSDP shard group"
    elif param is None or param.device.type != "cpu" or any(g.device.type != "cpu" for g in groups.values()):
        reason = "the units do not compute on the CPU"  # GPUs, and FSDP's CPU offload onto them
    layout, size = [], 0
    for unit in chosen:
        entries, size = param_major_layout(unit, size)
        layout += entries
    token = wire.broadcast(job_token(run_id), src=0)  # one name for the whole run
    directory = path = None
    if reason is None:
        group = next(iter(groups.values())).mesh_info.shard_process_group
        ranks = dist.get_process_group_ranks(group)
        directory = os.path.join(SHM_ROOT, f"hsdp-{token}-w{ranks[0]}")
        path = os.path.join(directory, "weights")
        reason = _probe(directory, group, ranks, size)
        if reason is None and dist.get_rank() == ranks[0]:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    # reserved now: a full /dev/shm is ENOSPC here (and the fallback), not SIGBUS
                    # in the middle of the gather (several shard groups of one host check at once)
                    os.posix_fallocate(fd, 0, max(size, 1))
                finally:
                    os.close(fd)
            except OSError as e:
                reason = f"cannot create {path}: {e}"
        verdict = wire.broadcast(reason, src=ranks[0], group=group)
        reason = reason or verdict  # a rank that cannot see the group's file keeps its own reason
    if not agree_on_shared_memory(reason, directory, "no shared copy of the resident units"):
        return None

    shared = SharedWeights(directory, path, max(size, 1), chosen, sharers=len(ranks))
    for fsdp_param, offset, numel, dtype in layout:
        whole = shared.tensor(offset, numel, dtype)
        fsdp_param.all_gather_outputs = [whole]  # FSDP2 copies the gathered unit out into it
        if hasattr(fsdp_param, "_unsharded_param"):  # gathered before: its view is of the old tensor
            _bind_unsharded(fsdp_param, whole)
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
        whole = fsdp_param.all_gather_outputs[0]
        shard = fsdp_param._sharded_param_data
        # a view only where this rank's padded shard is a contiguous run of the whole: Shard(0)
        is_view = shard.dtype == dtype and fsdp_param.fsdp_placement.dim == 0 and shard.numel() > 0
        if is_view:
            rank = fsdp_param.mesh_info.shard_mesh_rank
            _bind_shard(fsdp_param, whole.narrow(0, rank * shard.numel(), shard.numel()))
        shared._entries.append((fsdp_param, offset, numel, dtype, is_view))
    return shared


def param_major_layout(unit, offset: int = 0) -> tuple[list, int]:
    """Where ``unit``'s parameters go, gathered whole (padded as FSDP2 gathers them), one after
    another from byte ``offset``: ``[(fsdp_param, offset, numel, dtype)]`` and the offset after
    the last. The layout of the shared copy here and of the unit ring's slots
    (:mod:`shard_engine.shm_all_gather`)."""
    group = unit_param_group(unit)
    group.lazy_init()  # dtypes (mixed precision) are settled here
    world = group.mesh_info.shard_mesh_size
    entries = []
    for fsdp_param in group.fsdp_params:
        dtype = fsdp_param.param_dtype or fsdp_param.orig_dtype
        numel = fsdp_param._sharded_param_data.numel() * world
        entries.append((fsdp_param, offset, numel, dtype))
        offset += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
    return entries, offset


def reshard_privately(units: list, layout: list) -> None:
    """Give each parameter of ``layout`` (:func:`param_major_layout`'s entries) a private gathered
    output again and reshard ``units``: FSDP's reshard frees that output (resizes it to nothing),
    which it cannot do to shared storage; the next gather allocates it again."""
    for fsdp_param, _, numel, dtype in layout:
        private = torch.empty(numel, dtype=dtype)  # never written
        fsdp_param.all_gather_outputs = [private]
        _bind_unsharded(fsdp_param, private)
    for unit in units:
        unit.set_reshard_after_forward(True, recurse=False)
        unit.reshard()


def _bind_unsharded(fsdp_param, whole: torch.Tensor) -> None:
    """Point the unsharded parameter (the module's while gathered) at ``whole``'s first elements."""
    fsdp_param._unsharded_param.data = torch.as_strided(
        whole, fsdp_param._orig_size, fsdp_param._contiguous_orig_stride, storage_offset=0)


def _bind_shard(fsdp_param, flat: torch.Tensor) -> None:
    """Make ``flat`` (the padded shard's elements) this rank's local shard, as FSDP2's own
    ``reset_sharded_param`` does."""
    padded = fsdp_param.padded_sharded_param_size
    length = fsdp_param.sharded_param._local_tensor.size(0)
    fsdp_param._sharded_param_data = flat
    fsdp_param.sharded_param._local_tensor = flat.view(padded).narrow(0, 0, length)
