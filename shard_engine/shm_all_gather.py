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

The files, their directory and the agreement to use them are :mod:`shard_engine.shm`'s; what
FSDP2 is asked, and how its parameters are rebound to the slots, :mod:`shard_engine.torch_private`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import platform
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import shard_engine.wire as wire
from shard_engine.shared_weights import param_major_layout, reshard_privately
from shard_engine.shm import (
    SLOT_SIZE_ALIGN_BYTES,
    create_shared_files,
    disown,
    is_alive,
    map_shared,
    open_shared_directory,
    own,
    size_shared_file,
)
from shard_engine.torch_private import (
    AllGather,
    bind_gathered,
    copy_tensors,
    fsdp_params,
    has_all_gather_extension,
    is_gathered,
    is_row_sharded,
    modules_using,
    padded_shard,
    param_group,
    reshards_after_forward,
    shard_process_group,
    shard_rank,
)
from shard_engine.units import fsdp_units, unit_gathered_bytes

logger = logging.getLogger(__name__)


class SharedMemoryPool:
    """The ring of shared buffers of one shard group; every rank of the group holds one."""

    def __init__(self, directory: str, slots: int):
        self.directory, self.slots = directory, slots
        self._tensors: list[torch.Tensor | None] = [None] * slots
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
        current = self._tensors[slot]
        if self._linked[slot] is not None:
            # every rank mapped this file before the gather that last used the slot ended (its
            # barrier): the name can go, the pages stay while mapped, so no crash leaves them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._linked[slot])
            self._linked[slot] = None
        if current is None or current.numel() < nbytes:
            self._generation[slot] += 1
            size = math.ceil(nbytes / SLOT_SIZE_ALIGN_BYTES) * SLOT_SIZE_ALIGN_BYTES
            path = os.path.join(self.directory, f"slot{slot}-{self._generation[slot]}")
            size_shared_file(path, size)  # every rank, the same size
            self._tensors[slot] = current = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._linked[slot] = path
        return current[:nbytes].view(dtype)

    def trim(self) -> None:
        """Drop every buffer: the next gathers map new ones, sized for what they gather. Only
        between forwards, after every rank has mapped the current files (a gather's barrier)."""
        for path in self._linked:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._tensors = [None] * self.slots
        self._linked = [None] * self.slots

    @property
    def nbytes(self) -> int:
        """Shared memory the ring maps now (every rank of the host maps the same pages)."""
        ring = self.unit_ring.nbytes if self.unit_ring is not None else 0
        return sum(b.numel() for b in self._tensors if b is not None) + ring

    def close(self) -> None:
        if self.unit_ring is not None:
            self.unit_ring.release()
            self.unit_ring = None
        self._tensors = [None] * self.slots
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
        verdict = create_shared_files(files, group, leader)  # ENOSPC now, not SIGBUS mid-forward
        if verdict is not None:
            raise OSError(f"cannot create the unit slots: {verdict}")
        maps = [map_shared(path, nbytes) for path, nbytes in files]
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

    def slot(self, index: int) -> torch.Tensor:
        """The bytes of slot ``index`` (uint8), for a look at where the gathered parameters live."""
        return torch.frombuffer(self._maps[index], dtype=torch.uint8)

    def _bind(self, unit, slot: int) -> None:
        """Make ``unit``'s gathered parameters views of ``slot``."""
        rows, shards = [], []
        for fsdp_param, offset, numel, dtype in self._layouts[id(unit)]:
            whole = torch.frombuffer(self._maps[slot], dtype=dtype, count=numel, offset=offset)
            bind_gathered(fsdp_param, whole)  # FSDP2 allocates none while one is set
            shard = padded_shard(fsdp_param)
            rows.append(whole.narrow(0, shard_rank(fsdp_param) * shard.numel(), shard.numel()))  # its padded rows
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
            copy_tensors(rows, shards)
            self._barrier()  # every rank's rows are in: the slot holds the unit

        return fill

    def release(self) -> None:
        """Private gathered memory for the units again, resharded; the slots unmapped."""
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
                    if not is_alive(pid):
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
        if param_group(unit) is None or is_gathered(unit) or not reshards_after_forward(unit):
            continue
        inside = {id(m) for m in unit.modules()}
        if any(id(other) in inside for other in units if other is not unit):
            continue
        if all(is_row_sharded(p) and not has_all_gather_extension(p)
               and all(id(m) in inside for m in modules_using(p))
               for p in fsdp_params(unit)):
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
    groups = {id(g): g for g in (shard_process_group(u) for u in units if param_group(u) is not None)}
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
    directory = open_shared_directory(group, "g", need, reason=reason, run_id=run_id,
                                      fallback="all-gathers stay on the process group")
    if directory is None:
        return None
    pool = SharedMemoryPool(directory, slots)
    comm = SharedMemoryAllGather(pool)
    for unit in units:
        unit.set_custom_all_gather(comm)
    leaves = ring_units(model) if unit_ring else []
    if leaves:
        leader = dist.get_process_group_ranks(group)[0]
        pool.unit_ring = UnitRing(model, leaves, directory, group, leader=leader, timeout_s=timeout_s)
        model._hsdp_unit_ring = pool.unit_ring
        dist.barrier(group=group)  # every rank is past the ring's first gathers, which grew the buffers
        pool.trim()  # to the leaf units' size: from now on they serve the other units only
    return pool
