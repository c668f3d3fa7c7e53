"""An all-gather through shared memory, for CPU ranks of one host.

FSDP2 gathers a unit in place: it allocates one output buffer of ``world x shard`` elements,
copies this rank's shard into its slice, then asks the collective to fill in the others. When
the output buffer is one shared-memory mapping that every rank of the shard group sees, the
copy-in *is* the gather: once every rank has written its slice (a barrier says so) every
rank's buffer holds the whole unit. gloo instead moves those bytes through TCP on loopback,
which on a CPU host costs as much processor time as the forward (measured in
benchmarks/step.py: ~0.8 GB/s).

The buffers are a ring of slots, files under /dev/shm taken in call order (the same order on
every rank, since all-gathers are collectives) and grown when a larger unit comes. A slot
must not be rewritten while a slower rank still copies out of it. With prefetch depth ``d`` a
rank issues gather ``j`` (writing its slice) only after its barrier for gather ``j - d`` has
passed, so after every rank issued ``j - d``, which each does only after its own copy-out of
``j - 2d``: ``2d + 1`` slots are enough (:func:`slots_for_depth`). Only the ring is held, not
the model: a few units' worth of shared memory per host.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import shutil
import socket
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGather

from shard_engine.overlap import fsdp_units, unit_gathered_bytes, unit_param_group

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"
_ALIGN = 1 << 20
STALE_AFTER_S = 60.0
"""A directory none of whose ranks is alive, and older than this, is a crashed job's: removed."""
_OWNED: set[str] = set()  # this process's /dev/shm directories, for remove_owned_now()


def own(directory: str) -> None:
    _OWNED.add(directory)


def disown(directory: str) -> None:
    _OWNED.discard(directory)
    shutil.rmtree(directory, ignore_errors=True)


def remove_owned_now() -> None:
    """Remove every /dev/shm directory of this process, for exits that skip ``atexit`` (the step
    watchdog's and the torchrun worker's ``os._exit``). Mapped pages stay valid for whoever maps them."""
    for directory in list(_OWNED):
        disown(directory)


def sweep_stale(root: str = SHM_ROOT, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Remove this user's ``hsdp-*`` directories whose ranks are all gone (each rank leaves a
    ``pid-N`` file in the directories it uses) and that are older than ``min_age_s``: what a job
    killed outright (SIGKILL of every rank, a node's agent killed with its workers) left behind.
    Returns what it removed."""
    import time

    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith("hsdp-"):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
                continue
            if time.time() - st.st_mtime < min_age_s:
                continue
            pids = [int(n[4:]) for n in os.listdir(path) if n.startswith("pid-") and n[4:].isdigit()]
        except OSError:
            continue
        if not any(_alive(pid) for pid in pids):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d stale shared-memory director%s of crashed jobs: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


class SharedMemoryPool:
    """The ring of shared buffers of one shard group; every rank of the group holds one."""

    def __init__(self, directory: str, slots: int):
        self.directory, self.slots = directory, slots
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._generation = [0] * slots
        self._linked: list[str | None] = [None] * slots  # slot files not yet unlinked
        self.calls = 0
        own(directory)
        atexit.register(self.close)  # a process that never closes it still removes its files

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        slot = self.calls % self.slots
        self.calls += 1
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        current = self._buffers[slot]
        if self._linked[slot] is not None:
            # every rank mapped this file before the gather that last used the slot ended (its
            # barrier): the name can go, the pages stay while mapped, so no crash leaves them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._linked[slot])
            self._linked[slot] = None
        if current is None or current.numel() < nbytes:
            self._generation[slot] += 1
            size = math.ceil(nbytes / _ALIGN) * _ALIGN
            path = os.path.join(self.directory, f"slot{slot}-{self._generation[slot]}")
            # the directory is this group's own (created exclusively, 0700): no link to follow
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, size)  # every rank sets the same size: order does not matter
            finally:
                os.close(fd)
            self._buffers[slot] = current = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._linked[slot] = path
        return current[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        """Shared memory the ring maps now (every rank of the host maps the same pages)."""
        return sum(b.numel() for b in self._buffers if b is not None)

    def close(self) -> None:
        self._buffers = [None] * self.slots
        disown(self.directory)
        atexit.unregister(self.close)


class SharedMemoryAllGather(AllGather):
    """FSDP2's all-gather comm (``FSDPModule.set_custom_all_gather``) over a :class:`SharedMemoryPool`."""

    def __init__(self, pool: SharedMemoryPool):
        self.pool = pool

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.pool.buffer(math.prod(size), dtype)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        # FSDP2 copied this rank's shard into its slice of the shared output already; the
        # barrier (on the same group, in the same place as the all-gather it replaces) says
        # that every rank has.
        return dist.barrier(group=group, async_op=async_op)


def slots_for_depth(prefetch_depth: int) -> int:
    """Ring slots that keep every gather's buffer intact until each rank has copied out of it."""
    return max(2 * prefetch_depth + 1, 3)


def enable_shared_memory_all_gather(model: nn.Module, *, slots: int = 5, run_id: str | None = None,
                                    min_free_bytes: int | None = None) -> SharedMemoryPool | None:
    """Have every FSDP2 unit of ``model`` gather through shared memory, when every rank of its
    shard group can map the same file; returns the pool (close it at the end), or None, having
    changed nothing, where that is not possible (not on CPU, several hosts, /dev/shm too small).

    Collective over the default group: every rank must call it, in the same place.
    """
    units = fsdp_units(model)
    shard_groups = [g.mesh_info.shard_process_group for g in map(unit_param_group, units) if g is not None]
    groups = {id(g): g for g in shard_groups}
    param = next(model.parameters(), None)
    reason = None
    if not units or len(groups) != 1:
        reason = "the model has no single FSDP shard group"
    elif param is None or param.device.type != "cpu":
        reason = "the parameters are not on the CPU"
    group = next(iter(groups.values())) if len(groups) == 1 else None
    largest = max((unit_gathered_bytes(u)[0] for u in units), default=0)
    need = min_free_bytes if min_free_bytes is not None else 2 * slots * largest
    token = [job_token(run_id)]
    dist.broadcast_object_list(token, src=0)  # one name for the whole run
    directory = None
    if reason is None:
        ranks = dist.get_process_group_ranks(group)
        directory = os.path.join(SHM_ROOT, f"hsdp-{token[0]}-g{ranks[0]}")
        reason = _probe(directory, group, ranks, need)
    if not agree_on_shared_memory(reason, directory, "all-gathers stay on the process group"):
        return None
    pool = SharedMemoryPool(directory, slots)
    comm = SharedMemoryAllGather(pool)
    for unit in units:
        unit.set_custom_all_gather(comm)
    return pool


def job_token(run_id: str | None = None) -> str:
    """This job's part of its /dev/shm names: the run id (the launcher's sweep removes
    ``hsdp-{run_id}-*``) and a random part, so that two jobs sharing a run id (torchrun's static
    rendezvous names every run ``none``) never share a file. Rank 0's is broadcast by the callers."""
    run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return f"{run_id}-{uuid.uuid4().hex[:12]}"


def agree_on_shared_memory(reason: str | None, directory: str | None, fallback: str) -> bool:
    """True when no rank of the job has a ``reason`` against sharing memory; else every rank
    removes ``directory`` (if it got that far), logs ``fallback: the first reason`` and gets False.
    Collective over the default group."""
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, reason)
    failed = next((v for v in verdicts if v is not None), None)
    if failed is None:
        return True
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    logger.info("%s: %s", fallback, failed)
    return False


def cleanup_run(run_id: str) -> None:
    """Remove what a run's ranks left under /dev/shm (for a launcher, after its ranks ended)."""
    prefix = f"hsdp-{run_id}-"  # the gather rings (-g) and the shared resident weights (-w)
    try:
        names = os.listdir(SHM_ROOT)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(SHM_ROOT, name), ignore_errors=True)


def _probe(directory: str, group: dist.ProcessGroup, ranks: list[int], need_bytes: int) -> str | None:
    """None if every rank of ``group`` sees the bytes the group's first rank writes, else why not.
    Ranks of different nodes (hosts, or torchrun's nodes: ``GROUP_RANK``) never share memory, even
    where two nodes run on one host and would see the same /dev/shm."""
    nodes = [None] * len(ranks)
    dist.all_gather_object(nodes, (socket.gethostname(), os.environ.get("GROUP_RANK", "0")), group=group)
    if len(set(nodes)) > 1:
        return f"the shard group spans {len(set(nodes))} nodes"
    me = dist.get_rank()
    path = os.path.join(directory, "probe")
    stamp = uuid.uuid4().bytes
    box = [stamp]
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    problem = None
    try:
        if me == ranks[0]:
            sweep_stale()
            os.mkdir(directory, mode=0o700)  # exclusively: an existing one (or a link) is refused
            stat = os.statvfs(directory)
            if stat.f_bavail * stat.f_frsize < need_bytes:
                problem = f"{SHM_ROOT} has {stat.f_bavail * stat.f_frsize >> 20} MiB free, {need_bytes >> 20} needed"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(box[0])
    except OSError as e:
        problem = f"cannot write {path}: {e}"
    dist.barrier(group=group)
    with contextlib.suppress(OSError):  # whose directory this is, for sweep_stale of a crashed job
        os.close(os.open(os.path.join(directory, f"pid-{os.getpid()}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    if problem is None and me != ranks[0]:
        try:
            with open(path, "rb") as f:
                if f.read() != box[0]:
                    problem = f"{path} differs between ranks"
        except OSError:
            problem = f"rank {me} does not see {path}: another host or another /dev/shm"
    dist.barrier(group=group)
    return problem
