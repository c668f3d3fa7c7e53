"""The control channels: rank 0's plan out to a step group's ranks, their tokens back, once per step.

A step group is the ranks that enter their forwards together: a replica (shard group) when a
forward gathers units, each rank alone when every unit is resident (server.main
``_step_groups``). One channel per group, each a gloo group of its own of rank 0 and the
group's ranks, also when the model's collectives run on NCCL: plans are small, and a CPU group
never queues behind the model's all-gathers. Rank 0 steps its own group from its main thread;
every other group is stepped by a thread of rank 0 that plans for it and waits for its tokens
(both :func:`run_engine_loop`), so the groups run their steps independently.

Nothing received is executed: plans and results travel as plain data (``shard_engine.wire``:
msgpack, never pickle) and are rebuilt only as the records of ``server.engine.plan``
(``server.engine.plan_wire``); a payload that is anything else (a pickle, a field no record
declares) raises :class:`shard_engine.wire.WireError` on the rank that received it."""

from __future__ import annotations

import datetime
import logging
import time

import torch.distributed as dist

from server.engine import RankEngine, StepPlan, StepResult
from server.engine.plan_wire import from_wire, to_wire
from shard_engine import wire

logger = logging.getLogger(__name__)


class ControlChannel:
    """Rank 0 and ``ranks`` (a replica's); rank 0 sends plans and gathers results."""

    def __init__(self, timeout_s: float, ranks: list[int]):
        self.ranks = sorted({0, *ranks})
        # Collective over the default group: every rank creates every channel, in the same order.
        self.group = dist.new_group(self.ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        # rank 0's own group of one (every unit resident): nothing to send, nobody to hear from.
        # Skipping the wire there saved ~1.2 ms a step (two broadcasts, an all-gather and a
        # gather over gloo, each payload encoded and decoded), 18% of rank 0's decode loop at
        # one client on the 24-layer tiny Llama compiled (py-spy).
        self.alone = self.ranks == [self.rank]

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0's ``plan`` on every member (theirs is ignored); rank 0 keeps its own object."""
        if self.alone:
            return plan
        sent = wire.broadcast(to_wire(plan) if self.rank == 0 else None, src=0, group=self.group)
        return plan if self.rank == 0 else from_wire(StepPlan, sent)

    def gather_results(self, result: StepResult | None) -> list[StepResult] | None:
        """Rank 0: every member's result (rank 0's own is None where it is not in the replica)."""
        if self.alone:
            return [result] if result is not None else []
        out = wire.gather(to_wire(result) if result is not None else None, dst=0, group=self.group)
        return [from_wire(StepResult, r) for r in out if r is not None] if out is not None else None


def control_channels(timeout_s: float, replicas: list[list[int]]) -> list[ControlChannel | None]:
    """One channel per replica, created on every rank (collectively); a rank keeps those it is in."""
    me = dist.get_rank()
    channels = []
    for replica in replicas:
        channel = ControlChannel(timeout_s, replica)
        channels.append(channel if me in channel.ranks else None)
    return channels


def run_engine_loop(engine: RankEngine | None, channel: ControlChannel, scheduler=None, watchdog=None) -> None:
    """Step until rank 0 plans a shutdown. Rank 0 passes the replica's scheduler; the others pass
    None. ``engine`` None: rank 0 stepping a replica it is not in (a thread of its own): it plans,
    sends and waits for the tokens, and an idle replica gets an empty plan each idle wait (its
    ranks' watchdogs see the group alive) and runs no forward.

    Symmetry: every rank receives every plan and answers it, so all ranks take the same
    number of steps and enter the same forwards. An exception on any rank ends its loop; the
    others' next collective then fails (the peer is gone) or their watchdog fires.
    """
    clock = time.perf_counter
    while True:
        planned = scheduler.next_plan() if scheduler is not None else None  # may wait while idle
        # Watched from before the plan goes out: a peer stopped between two steps blocks the
        # broadcast, and the other ranks wait there too while rank 0 idles (at most its idle
        # wait, which --step-timeout must exceed).
        if watchdog is not None:
            watchdog.step_started()
        t0 = clock()
        if scheduler is not None and planned.forward:
            scheduler.step_began(t0)
        plan = channel.broadcast_plan(planned)
        if plan.shutdown:
            return
        t1 = clock()
        result = engine.step(plan) if engine is not None else None
        t2 = clock()
        results = channel.gather_results(result)
        t3 = clock()
        if watchdog is not None:
            watchdog.step_finished()
        if scheduler is not None:
            if plan.forward:
                scheduler.step_ended(t3 - t0)
            scheduler.on_results(results)
            if plan.forward and engine is not None:
                scheduler.observe_step(step_s=t2 - t1, control_s=(t1 - t0) + (t3 - t2))
            elif plan.forward:  # a replica stepped from outside: its step is the whole round trip
                scheduler.observe_step(step_s=t3 - t0, control_s=0.0)
