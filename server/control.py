"""The control channel: rank 0's plan out to every rank, every rank's tokens back, once per step.

It is a gloo group of its own, also when the model's collectives run on NCCL: plans are small
pickled objects, and a CPU group never queues behind the model's all-gathers.
"""

from __future__ import annotations

import datetime
import logging
import time

import torch.distributed as dist

from server.engine import RankEngine, StepPlan, StepResult

logger = logging.getLogger(__name__)


class ControlChannel:
    def __init__(self, timeout_s: float):
        # Collective: every rank creates the group in the same order.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan:
        box = [plan]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_results(self, result: StepResult) -> list[StepResult] | None:
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(result, out, dst=0, group=self.group)
        return out


def run_engine_loop(engine: RankEngine, channel: ControlChannel, scheduler=None, watchdog=None) -> None:
    """Step until rank 0 plans a shutdown. Rank 0 passes its scheduler; the others pass None.

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
        plan = channel.broadcast_plan(planned)
        if plan.shutdown:
            return
        t1 = clock()
        result = engine.step(plan)
        t2 = clock()
        results = channel.gather_results(result)
        t3 = clock()
        if watchdog is not None:
            watchdog.step_finished()
        if scheduler is not None:
            scheduler.on_results(results)
            if plan.forward:
                scheduler.observe_step(step_s=t2 - t1, control_s=(t1 - t0) + (t3 - t2))
