"""The control channels: rank 0's plan out to a step group's ranks, their tokens back, once per step.

A step group is the ranks that enter their forwards together: a replica (shard group) when a
forward gathers units, each rank alone when every unit is resident (server.main
``_step_groups``). One channel per group, over rank 0's links to the group's ranks
(``server.group.links``: a TCP connection per rank, also when the model's collectives run on
NCCL; a gloo collective cost 0.5-1 ms a message, a link's ping-pong 0.03 ms). Rank 0 steps its own
group from its main thread; every other group is stepped by a thread of rank 0 that plans for
it and waits for its tokens (both :func:`run_engine_loop`), so the groups run their steps
independently.

Nothing received is executed: plans and results travel as plain data (``shard_engine.wire``:
msgpack, never pickle) and are rebuilt only as the records of ``server.engine.plan``
(``server.engine.plan_wire``); a payload that is anything else (a pickle, a field no record
declares) raises :class:`shard_engine.wire.WireError` on the rank that received it."""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from server.engine import RankEngine, StepPlan, StepResult
from server.engine.plan_wire import from_wire, to_wire
from shard_engine import wire
from shard_engine.wire import WireError

logger = logging.getLogger(__name__)


class ControlChannel:
    """Rank 0 and ``ranks`` (a replica's); rank 0 sends plans and gathers results over ``links``
    (:func:`server.group.links.open_links`: rank 0's to every rank, another rank's to rank 0)."""

    def __init__(self, links: dict, ranks: list[int]):
        self.rank = dist.get_rank()
        self.ranks = sorted({0, *ranks})
        # rank 0: one link per member; a member: its link to rank 0. Rank 0's own group of one
        # (every unit resident) has none: nothing to send, nobody to hear from.
        self.links = [links[r] for r in self.ranks if r != 0] if self.rank == 0 else [links[0]]
        self.alone = self.ranks == [self.rank]

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0's ``plan`` on every member (theirs is ignored); rank 0 keeps its own object."""
        if self.rank != 0:
            return from_wire(StepPlan, self.links[0].recv())
        if self.links:
            # encoded once for every member; a plan that cannot be (not plain data) goes as length 0,
            # so that every member raises too instead of waiting for a plan
            try:
                data = wire.encode(to_wire(plan))
            except WireError:
                for link in self.links:
                    link.send_bytes(b"")
                raise
            for link in self.links:  # a write into the kernel's buffer each: no waiting on a peer
                link.send_bytes(data)
        return plan

    def gather_results(self, result: StepResult | None) -> list[StepResult] | None:
        """Rank 0: every member's result, by rank (rank 0's own first; none where it is not in
        the replica). None on the others."""
        if self.rank != 0:
            self.links[0].send(to_wire(result))
            return None
        results = [result] if result is not None else []
        results += [from_wire(StepResult, link.recv()) for link in self.links]
        return results


def control_channels(timeout_s: float, replicas: list[list[int]]) -> list[ControlChannel | None]:
    """One channel per replica, on every rank (collectively: rank 0 opens a link to every other
    rank); a rank keeps those it is in."""
    from server.group.links import open_links

    me = dist.get_rank()
    links = open_links(timeout_s)
    return [ControlChannel(links, replica) if me in {0, *replica} else None for replica in replicas]


def run_engine_loop(engine: RankEngine | None, channel: ControlChannel, scheduler=None, watchdog=None,
                    on_share=None, on_update=None) -> None:
    """Step until rank 0 plans a shutdown. Rank 0 passes the replica's scheduler; the others pass
    None. ``engine`` None: rank 0 stepping a replica it is not in (a thread of its own): it plans,
    sends and waits for the tokens, and an idle replica gets an empty plan each idle wait (its
    ranks' watchdogs see the group alive) and runs no forward.

    ``on_share(PeerShare)``: a plan asks this rank to send its shards to a peer group; called on
    the stepping thread between two steps, it starts a thread of its own and returns.
    ``on_update(WeightUpdate) -> UpdateReport``: a plan brings new weights; called on the stepping
    thread (the plan has no work), its report goes back with the step's result.

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
        if plan.share is not None and engine is not None and on_share is not None:
            on_share(plan.share)
        report = on_update(plan.update) if plan.update is not None and engine is not None and on_update else None
        t1 = clock()
        result = engine.step(plan) if engine is not None else None
        if result is not None:
            result.update = report
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
