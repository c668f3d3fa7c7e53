"""Cores where the work is: a busy rank takes the cores of the idle ranks of its host.

Each CPU rank starts with its share of the host's cores (``server.group.process_group``: cores //
local ranks, one thread each on 2 cores and 2 ranks). With every unit resident each rank is its
own step group, and at low load most of them are idle: one sequence's decode ran on one core
while the other waited, although a step of a real model is bound by how fast its weights stream
from memory, which two cores do faster than one (SmolLM2-135M in bf16, one process: 60 ms a
step on one thread, 45 on two).

:class:`HostCores` lives on rank 0, beside the schedulers. Each step group's scheduler tells it,
with every plan, which of its ranks have work; the plan then carries the intra-op threads its
busy ranks use (``StepPlan.threads``): the host's cores over the ranks of that host with work,
never fewer than a rank's own share. The ranks apply it before an eager forward
(``RankEngine._forward``: ``torch.set_num_threads``, which the matmuls follow at once).

Compiled layers (``--compile-region layer``, the default) are entered at the plan's count: their
kernels take the thread count when they run (inductor's ``cpp.dynamic_threads``,
``server.engine.compiled.INDUCTOR_OPTIONS``). The model's graph (``--compile-region model``) must
be entered at the count it was compiled at (the rank's own share: torch.compile guards on it,
dynamo's global-state guard); its opaque ops (the packed linears, the decode attention: most of a
step's time) read the thread count when they run, so they follow the plan all the same: the
compiled call runs inside :func:`threads_inside`, and the first of them to run switches to the
plan's count (:func:`follow_threads`), and the next call is entered at the compiled count again.
Two groups that plan at the same moment may
both count the other idle: the host is oversubscribed for that one step, and each group's next
plan counts again. GPU ranks are left as they are (their host threads feed a device), and so are
models smaller than :data:`MIN_WEIGHT_BYTES`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

MIN_WEIGHT_BYTES = 64 << 20
"""Models whose weights are fewer bytes than this keep one share of cores per rank: their step is
host time (module calls), which a second thread cannot shorten. Measured on the 1M-parameter
24-layer Llama, eager, one client: 57-63 tok/s with the idle core, 64-73 without, 56-66 with this
bound leaving it out, all within run-to-run noise; SmolLM2-135M in bf16 (270 MB): 17.8 tok/s with
it, 14.5 without."""


def cores_follow_work(device_type: str, weight_bytes: int, step_groups: int) -> bool:
    """Whether a busy rank takes its host's idle cores: CPU ranks, several step groups, a model
    of at least :data:`MIN_WEIGHT_BYTES`."""
    return device_type == "cpu" and step_groups > 1 and weight_bytes >= MIN_WEIGHT_BYTES


class HostCores:
    """Which ranks have work now, per host; ``threads(group, busy)`` records a group's plan and
    returns the threads its busy ranks use. Thread-safe: every step group's planner calls it."""

    def __init__(self, ranks_per_host: int, threads_per_rank: int, world_size: int):
        if ranks_per_host < 1 or threads_per_rank < 1:
            raise ValueError(f"ranks_per_host {ranks_per_host} and threads_per_rank {threads_per_rank} must be >= 1")
        self.ranks_per_host, self.threads_per_rank = ranks_per_host, threads_per_rank
        self.cores_per_host = ranks_per_host * threads_per_rank
        self._host = [rank // ranks_per_host for rank in range(world_size)]  # ranks are numbered host by host
        self._busy: set[int] = set()
        self._lock = threading.Lock()

    def threads(self, group: list[int], busy: list[int]) -> int:
        """Records that of ``group``'s ranks exactly ``busy`` have work in its next step; returns the
        threads each of them uses in it (the fewest any of their hosts can give)."""
        with self._lock:
            self._busy.difference_update(group)
            self._busy.update(busy)
            hosts = {self._host[rank] for rank in busy}
            if not hosts:
                return self.threads_per_rank
            working = {host: 0 for host in hosts}
            for rank in self._busy:
                if self._host[rank] in working:
                    working[self._host[rank]] += 1
            return max(self.threads_per_rank, min(self.cores_per_host // working[host] for host in hosts))


_threads_inside = 0
"""The intra-op threads the opaque ops of the compiled forward in progress run at; 0 outside one.
One rank's forwards run on one thread (its engine loop), so a module global serves it."""


@contextlib.contextmanager
def threads_inside(threads: int) -> Iterator[None]:
    """Within: :func:`follow_threads` (called by the opaque ops of a compiled forward) switches to
    ``threads`` (0: leaves the count alone). The count stays switched afterwards; whoever enters a
    compiled graph next sets the graph's own count first."""
    global _threads_inside
    _threads_inside = threads
    try:
        yield
    finally:
        _threads_inside = 0


def follow_threads() -> None:
    """Called first by each opaque op a compiled forward calls (``hsdp::linear``,
    ``hsdp::paged_decode``): inside :func:`threads_inside`, the intra-op threads become its count."""
    if _threads_inside and torch.get_num_threads() != _threads_inside:
        torch.set_num_threads(_threads_inside)
