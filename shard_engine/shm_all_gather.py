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

That gather still copies every unit twice per forward: each rank's shard into the buffer, then
(FSDP2's copy-out) the whole unit out of it into each parameter's own storage, because the buffer
is laid out rank by rank and a parameter needs its rows contiguous. For *leaf* units (no unit
inside them, every parameter sharded by rows, none used outside the unit: an embedding, a
decoder layer, a head), :class:`UnitRing` removes the copy-out: two shared slots laid out
parameter by parameter, each unit's gathered parameters permanently views of a slot (FSDP2 sees
the unit as gathered and leaves it be), and a pre-forward hook in which each rank writes its own
rows of every parameter into the slot, then a barrier on the shard group. Units take the slots
in turns in execution order, so a slot is rewritten only after every rank has passed the
barrier of the unit in between, which each enters after finishing the unit before: two slots
suffice. Per forward each rank copies its shard once, not the whole model. Other units (the
root, whose forward spans every other unit) keep the gather above.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import platform
import shutil
import socket
import time
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGather

from shard_engine import wire
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


def reserve_shared_file(fd: int, nbytes: int, path: str) -> None:
    """Give a shared file its pages now: a tmpfs that is full fails here with a named error, where
    a file only sized with ``ftruncate`` raises SIGBUS at the first write past what it can hold
    (inside a forward). Where the file system cannot reserve (EOPNOTSUPP), it stays sized only."""
    import errno

    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise OSError(e.errno, f"cannot reserve {nbytes} bytes of shared memory for {path}: {e.strerror} "
                               f"(is {os.path.dirname(path) or SHM_ROOT} full?)") from None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: existing is all we know


class SharedMemoryPool:
    """The ring of shared buffers of one shard group; every rank of the group holds one."""

    def __init__(self, directory: str, slots: int):
        self.directory, self.slots = directory, slots
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._generation = [0] * slots
        self._linked: list[str | None] = [None] * slots  # slot files not yet unlinked
        self.calls = 0
        self.unit_ring: UnitRing | None = None  # the leaf units' slots, where there are any
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
                reserve_shared_file(fd, size, path)
            finally:
                os.close(fd)
            self._buffers[slot] = current = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._linked[slot] = path
        return current[:nbytes].view(dtype)

    def trim(self) -> None:
        """Drop every buffer: the next gathers map new ones, sized for what they gather. Only
        between forwards, after every rank has mapped the current files (a gather's barrier)."""
        for path in self._linked:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._buffers = [None] * self.slots
        self._linked = [None] * self.slots

    @property
    def nbytes(self) -> int:
        """Shared memory the ring maps now (every rank of the host maps the same pages)."""
        ring = self.unit_ring.nbytes if self.unit_ring is not None else 0
        return sum(b.numel() for b in self._buffers if b is not None) + ring

    def close(self) -> None:
        if self.unit_ring is not None:
            self.unit_ring.release()
            self.unit_ring = None
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


class UnitRing:
    """Two shared slots that the gathered parameters of the leaf units live in, in turns, laid out
    parameter by parameter; each rank fills its own rows before a unit runs (module docstring).

    Built by :func:`enable_shared_memory_all_gather` for the units :func:`ring_units` picks, once
    every rank has mapped both slot files (then unlinked). :meth:`release` gives the units private
    gathered memory back and resharded, as before; FSDP cannot free shared storage itself, so
    anything that reshards these units (``set_resident_units``, ``state_dict``) releases it first.
    """

    SLOTS = 2

    def __init__(self, model: nn.Module, units: list, directory: str, group: dist.ProcessGroup, leader: int,
                 timeout_s: float = 600.0):
        import mmap

        from shard_engine.shared_weights import param_major_layout

        self.units, self.group = units, group
        self._layouts: dict[int, list] = {}  # id(unit) -> [(fsdp_param, offset, numel, dtype)]
        size = 0
        for unit in units:
            self._layouts[id(unit)], end = param_major_layout(unit)
            size = max(size, end)
        self.slot_bytes = max(size, 1)
        world = dist.get_world_size(group)
        files = [(os.path.join(directory, f"unit-slot{i}"), self.slot_bytes) for i in range(self.SLOTS)]
        files.append((os.path.join(directory, "unit-counters"), _COUNTER_STRIDE * 8 * world))
        problem = None
        if dist.get_rank() == leader:
            try:
                for path, nbytes in files:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS mid-forward
                    finally:
                        os.close(fd)
            except OSError as e:
                problem = f"cannot create the unit slots: {e}"
        verdict = wire.broadcast(problem, src=leader, group=group)
        if verdict is not None:
            raise OSError(verdict)
        maps = []
        for path, nbytes in files:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                maps.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            finally:
                os.close(fd)
        dist.barrier(group=group)  # every rank has mapped them all: the names can go
        if dist.get_rank() == leader:
            for path, _ in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._maps = maps[:self.SLOTS]
        self._barrier = CounterBarrier(maps[self.SLOTS], dist.get_rank(group), world, group, timeout_s)
        self._bound: dict[int, int] = {}
        self._copies: dict[int, tuple[list, list]] = {}  # id(unit) -> (this rank's rows, its shards)
        for i, unit in enumerate(units):
            self._bind(unit, i % self.SLOTS)
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in units:  # FSDP2 gathers each once, into its slot: from now on it sees them gathered
            unit.unshard()
        self._turn = 0
        self._hooks = [model.register_forward_pre_hook(self._start_forward)]
        self._hooks += [unit.register_forward_pre_hook(self._filler(unit), prepend=True) for unit in units]

    @property
    def nbytes(self) -> int:
        return self.SLOTS * self.slot_bytes if self._maps else 0

    def _bind(self, unit, slot: int) -> None:
        """Make ``unit``'s gathered parameters views of ``slot``."""
        from shard_engine.shared_weights import _bind_unsharded

        rows, shards = [], []
        for fsdp_param, offset, numel, dtype in self._layouts[id(unit)]:
            whole = torch.frombuffer(self._maps[slot], dtype=dtype, count=numel, offset=offset)
            fsdp_param.all_gather_outputs = [whole]  # FSDP2 allocates none while one is set
            if hasattr(fsdp_param, "_unsharded_param"):
                _bind_unsharded(fsdp_param, whole)
            shard = fsdp_param._sharded_param_data
            rank = fsdp_param.mesh_info.shard_mesh_rank
            rows.append(whole.narrow(0, rank * shard.numel(), shard.numel()))  # its padded rows
            shards.append(shard)
        self._bound[id(unit)], self._copies[id(unit)] = slot, (rows, shards)

    def _start_forward(self, module, args) -> None:
        self._turn = 0  # every forward runs the units in the same order on every rank

    def _filler(self, unit):
        def fill(module, args) -> None:
            slot = self._turn % self.SLOTS
            self._turn += 1
            if self._bound[id(unit)] != slot:  # an order that differs from the last forward's
                self._bind(unit, slot)
            rows, shards = self._copies[id(unit)]
            torch._foreach_copy_(rows, shards)
            self._barrier()  # every rank's rows are in: the slot holds the unit

        return fill

    def release(self) -> None:
        """Private gathered memory for the units again, resharded; the slots unmapped."""
        from shard_engine.shared_weights import reshard_privately

        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        reshard_privately(self.units, [entry for unit in self.units for entry in self._layouts[id(unit)]])
        self.units, self._copies, self._maps = [], {}, []
        self._barrier.close()


_COUNTER_STRIDE = 8  # int64s between two ranks' counters: a cache line each, no false sharing
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
"""x86 makes stores visible in program order (TSO): a rank's rows are in the slot before its
counter says so, and a reader that saw the counter reads them after it. Elsewhere (Arm's weaker
model) nothing in Python orders them, and the barrier is the process group's."""


class PeerGone(RuntimeError):
    """A rank of the shard group exited while this one waited for it in shared memory."""


class CounterBarrier:
    """A barrier over one page of shared memory: each rank of the group bumps its own counter and
    waits until every other rank's has reached it, yielding the processor (and the GIL) while it
    waits. Where the ranks run in step it costs microseconds; gloo's barrier took ~1.5 ms inside
    a forward on a 2-core host (its threads wake on a busy core), 20 ms a step for 13 units.

    A peer that dies is seen while waiting (its process is looked for every
    ``LIVENESS_CHECK_S``: the ranks share a host) and raises :class:`PeerGone`, as a collective
    whose peer is gone fails; one that never arrives raises :class:`TimeoutError` after
    ``timeout_s`` (a stuck rank is normally caught sooner, by the step watchdog). Not on x86: the
    process group's barrier (``_ORDERED_STORES``). Collective to build: every rank of ``group``."""

    LIVENESS_CHECK_S = 0.05

    def __init__(self, mapping, rank: int, world: int, group: dist.ProcessGroup, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self._mapping = mapping
        self._view = memoryview(mapping).cast("q")
        self._mine = rank * _COUNTER_STRIDE
        pids = wire.all_gather(os.getpid(), group=group)
        self._others = [(r * _COUNTER_STRIDE, r, pids[r]) for r in range(world) if r != rank]
        self.count = 0

    def __call__(self) -> None:
        if not _ORDERED_STORES:
            dist.barrier(group=self.group)
            return
        self.count += 1
        view, count = self._view, self.count
        view[self._mine] = count
        started = check_at = None
        for slot, rank, pid in self._others:
            while view[slot] < count:
                now = time.monotonic()
                if started is None:
                    started, check_at = now, now + self.LIVENESS_CHECK_S
                elif now > check_at:
                    check_at = now + self.LIVENESS_CHECK_S
                    if not _alive(pid):
                        raise PeerGone(f"rank {rank} of the shard group (pid {pid}) exited while the others "
                                       "waited for it at a unit barrier")
                    if now - started > self.timeout_s:
                        raise TimeoutError(f"rank {rank} of the shard group did not reach the unit barrier "
                                           f"in {self.timeout_s:.0f} s")
                time.sleep(0)  # yields the core and the GIL (rank 0's HTTP thread)

    def close(self) -> None:
        self._view.release()
        self._mapping = None


def ring_units(model: nn.Module) -> list:
    """The units whose gathered parameters can live in a :class:`UnitRing`: sharded now (not
    resident), holding no other unit (their forward runs while no other unit's does), every
    parameter sharded by rows with no all-gather extension, and none of them used by a module
    outside the unit (a tied head)."""
    units = fsdp_units(model)
    chosen = []
    for unit in units:
        group = unit_param_group(unit)
        if group is None or group.is_unsharded or not group._reshard_after_forward:
            continue
        inside = {id(m) for m in unit.modules()}
        if any(id(other) in inside for other in units if other is not unit):
            continue
        if all(p.fsdp_placement.dim == 0 and not hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")
               and all(id(m) in inside for m in (p._module_info.module, *p._module_info.shared_modules))
               for p in group.fsdp_params):
            chosen.append(unit)
    return chosen


def slots_for_depth(prefetch_depth: int) -> int:
    """Ring slots that keep every gather's buffer intact until each rank has copied out of it."""
    return max(2 * prefetch_depth + 1, 3)


def enable_shared_memory_all_gather(model: nn.Module, *, slots: int = 5, run_id: str | None = None,
                                    min_free_bytes: int | None = None, unit_ring: bool = True,
                                    timeout_s: float = 600.0) -> SharedMemoryPool | None:
    """Have every FSDP2 unit of ``model`` gather through shared memory, when every rank of its
    shard group can map the same file; returns the pool (close it at the end), or None, having
    changed nothing, where that is not possible (not on CPU, several hosts, /dev/shm too small).
    ``unit_ring``: the leaf units sharded now gather into a :class:`UnitRing` (no copy-out); set
    residency first. ``timeout_s``: how long a rank waits for the others at a unit's barrier.

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
    # the gather ring, and the leaf units' two slots
    need = min_free_bytes if min_free_bytes is not None else 2 * slots * largest + UnitRing.SLOTS * largest
    token = wire.broadcast(job_token(run_id), src=0)  # one name for the whole run
    directory = None
    if reason is None:
        ranks = dist.get_process_group_ranks(group)
        directory = os.path.join(SHM_ROOT, f"hsdp-{token}-g{ranks[0]}")
        reason = _probe(directory, group, ranks, need)
    if not agree_on_shared_memory(reason, directory, "all-gathers stay on the process group"):
        return None
    pool = SharedMemoryPool(directory, slots)
    comm = SharedMemoryAllGather(pool)
    for unit in units:
        unit.set_custom_all_gather(comm)
    leaves = ring_units(model) if unit_ring else []
    if leaves:
        pool.unit_ring = UnitRing(model, leaves, directory, group, leader=ranks[0], timeout_s=timeout_s)
        model._hsdp_unit_ring = pool.unit_ring
        dist.barrier(group=group)  # every rank is past the ring's first gathers, which grew the buffers
        pool.trim()  # to the leaf units' size: from now on they serve the other units only
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
    verdicts = wire.all_gather(reason)
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
    nodes = wire.all_gather(f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}", group=group)
    if len(set(nodes)) > 1:
        return f"the shard group spans {len(set(nodes))} nodes"
    me = dist.get_rank()
    path = os.path.join(directory, "probe")
    stamp = wire.broadcast(uuid.uuid4().bytes, src=ranks[0], group=group)
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
                f.write(stamp)
    except OSError as e:
        problem = f"cannot write {path}: {e}"
    dist.barrier(group=group)
    with contextlib.suppress(OSError):  # whose directory this is, for sweep_stale of a crashed job
        os.close(os.open(os.path.join(directory, f"pid-{os.getpid()}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    if problem is None and me != ranks[0]:
        try:
            with open(path, "rb") as f:
                if f.read() != stamp:
                    problem = f"{path} differs between ranks"
        except OSError:
            problem = f"rank {me} does not see {path}: another host or another /dev/shm"
    dist.barrier(group=group)
    return problem
