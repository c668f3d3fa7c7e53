"""Independent step groups: one scheduler per group of ranks that step together, one router in front.

A step group is a replica (shard group) when a forward gathers units (a collective over the
shard group), and a single rank when every unit is resident and a forward runs no collective
(server.main ``_step_groups``); "replica" below means either. Each replica runs its own steps:
its scheduler plans for its ranks only, its ranks enter a forward only when it has work (an
idle replica runs none), and a replica's slow step (a long prefill) delays no other replica.
:class:`StepGroupRouter` is what rank 0's HTTP side sees: the
one scheduler interface (``try_submit``, ``cancel``, ``finish``, counts, per-rank stats in global
rank order), each request placed on a replica when it arrives:

0. among the replicas whose KV pools can ever hold the sequence,
1. the replica holding the longest cached prefix of the prompt (on any of its ranks), counted only
   while it has room in its share of the running requests;
2. else, among the replicas within one open request (running and queued: the work each owes) of
   the least loaded, the one whose step in progress is expected to end first (a replica between
   steps: at once), since a new request waits for that step before its first chunk runs. The
   sequence that just finished on a replica frees its place there at the moment that replica
   starts its next step: fewest open requests alone sends the next request of a closed loop to
   the replica that will keep it waiting longest. A replica whose running share is full (the
   request would queue there) is passed over for one with room;
3. then the fewest open requests, then the most free KV blocks.

Within the replica its scheduler places the sequence on a rank by blocks and prefix, as before.
The bound on open requests (``--max-concurrent-requests`` + ``--max-queued-requests``) holds
over the whole group; each replica may run its share of the concurrent requests.
"""

from __future__ import annotations

import threading
import time

from server.engine.blocks import chain_hashes
from server.engine.scheduler import RequestHandle, Scheduler


class StepGroupRouter:
    """What rank 0's HTTP side sees: one scheduler interface over the step groups' schedulers,
    each request placed on a group when it arrives (the module says how). Thread-safe as
    :class:`~server.engine.scheduler.Scheduler` is; its placement holds a lock of its own so that
    two arrivals never both take a group's last running place."""

    def __init__(self, schedulers: list[Scheduler], *, max_running: int, max_queued: int):
        self.schedulers = schedulers
        self.replicas = [list(s.rank_ids) for s in schedulers]
        flat = [rank for replica in self.replicas for rank in replica]
        if flat != list(range(len(flat))):
            raise ValueError(f"replicas must cover ranks 0..n-1 in order, got {self.replicas}")
        self.pools = [pool for s in schedulers for pool in s.pools]
        self.world_size = len(self.pools)
        self.block_size = schedulers[0].block_size
        self.max_prefill_tokens = schedulers[0].max_prefill_tokens
        self.max_running, self.max_queued = max_running, max_queued
        self._lock = threading.Lock()

    # -- placement -----------------------------------------------------------------------------
    def _choose(self, handle: RequestHandle) -> Scheduler:
        if len(self.schedulers) == 1:
            return self.schedulers[0]
        tokens = handle.tokens
        usable = (len(tokens) - 1) // self.block_size
        root = self.schedulers[0].prefix_root(handle)
        # keyed as the prefix cache keys them (an image's placeholders by its content)
        keys = chain_hashes(handle.keyed(0, usable * self.block_size), self.block_size, root) if usable else []

        def free(s: Scheduler) -> int:
            return sum(pool.num_available for pool in s.pools)

        fitting = [s for s in self.schedulers if s.fits_ever(len(tokens))] or self.schedulers
        fitting = [s for s in fitting if not s.paused] or fitting  # a replica updating its weights waits
        least = min(s.open_requests for s in fitting)
        if keys:
            # a cached prefix counts only while the replica has room in its running share and is within
            # one request of the least loaded: a shared system prompt (or prompts an earlier burst left
            # cached on one replica) must not send a burst to one replica while another idles (CI saw
            # six concurrent requests placed [5, 1])
            cached = {id(s): max((len(pool.match_prefix(keys)) for pool in s.pools), default=0)
                      if s.open_requests < s.max_running and s.open_requests <= least + 1 else 0 for s in fitting}
            best = max(cached.values())
            if best:
                return max((s for s in fitting if cached[id(s)] == best), key=lambda s: (-s.open_requests, free(s)))
        near = [s for s in fitting if s.open_requests <= least + 1]
        near = [s for s in near if s.open_requests < s.max_running] or near  # one that admits it now
        now = time.perf_counter()
        return min(near, key=lambda s: (s.step_remaining(now), s.open_requests, -free(s)))

    def try_submit(self, handle: RequestHandle) -> bool:
        with self._lock:  # the bound holds over every replica
            if sum(s.open_requests for s in self.schedulers) >= self.max_running + self.max_queued:
                return False
            self._choose(handle).submit(handle)
        return True

    def submit(self, handle: RequestHandle) -> None:
        with self._lock:
            self._choose(handle).submit(handle)

    def cancel(self, handle: RequestHandle) -> None:
        if handle.scheduler is not None:
            handle.scheduler.cancel(handle)

    def finish(self, handle: RequestHandle) -> None:
        if handle.scheduler is not None:
            handle.scheduler.finish(handle)

    def share_weights(self, share) -> None:
        """Every step group's ranks start sending their shards to a peer group (``PeerShare``)."""
        for s in self.schedulers:
            s.share_weights(share)

    def update_weights(self, update, mode: str, failed=lambda: False, rolling: list[list[int]] | None = None) -> list:
        """The step groups update (``Scheduler.update_weights``), in two phases: all quiet, then
        all write, then all resume together (a host's ranks share their resident weights: none may
        step on rows another is still writing). ``rolling``: the step groups (indices) of each
        replica, updated one replica at a time while the others serve (placement skips a paused
        group): replicas share no weights. Returns every rank's (rank, UpdateReport);
        RuntimeError where ``failed()`` turns true first (the group went down)."""
        reports = []
        for indices in rolling or [list(range(len(self.schedulers)))]:
            schedulers = [self.schedulers[i] for i in indices]
            for s in schedulers:
                s.update_weights(update, mode)
            try:
                # nothing computes on these weights...
                self._wait_all([s.quiet for s in schedulers], failed, "the weight update")
                for s in schedulers:
                    s.start_update()  # ...before any rank writes them
                self._wait_all([s.updated for s in schedulers], failed, "the weight update")
            finally:
                for s in schedulers:
                    s.release_update()
            reports += [r for s in schedulers for r in s.update_reports]
        return sorted(reports)

    def pause(self, mode: str, clear_cache: bool = True, failed=lambda: False) -> bool:
        """vLLM's pause on every step group (``Scheduler.pause``); returns once each has settled:
        its running sequences done (``wait``), ended (``abort``) or frozen (``keep``): whether it is
        still paused then (False: resumed first). RuntimeError where ``failed()`` turns true first."""
        self._wait_all([s.pause(mode, clear_cache) for s in self.schedulers], failed, "the pause")
        return self.paused_by_request

    def resume(self) -> None:
        for s in self.schedulers:
            s.resume()

    @property
    def paused_by_request(self) -> bool:
        return any(s.paused_by_request for s in self.schedulers)

    @staticmethod
    def _wait_all(events: list[threading.Event], failed, during: str) -> None:
        for event in events:
            while not event.wait(0.5):
                if failed():
                    raise RuntimeError(f"the model group failed during {during}")

    @property
    def paused(self) -> bool:
        return any(s.paused for s in self.schedulers)

    def request_shutdown(self, timeout_s: float = float("inf")) -> None:
        for s in self.schedulers:
            s.request_shutdown(timeout_s)

    def fail_all(self, message: str) -> None:
        for s in self.schedulers:
            s.fail_all(message)

    # -- what the HTTP side reads ---------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    def stalled_for(self, now: float) -> float:
        """The longest any step group has had work and made no progress (``Scheduler.stalled_for``)."""
        return max(s.stalled_for(now) for s in self.schedulers)

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.schedulers)

    @property
    def max_sequence_tokens(self) -> int:
        return max(s.max_sequence_tokens for s in self.schedulers)

    @property
    def rank_stats(self) -> list:
        """Every rank's latest step result, in global rank order."""
        return [stat for s in self.schedulers for stat in s.rank_stats]

    @property
    def rank_memory(self) -> list:
        return [memory for s in self.schedulers for memory in s.rank_memory]

    def replica_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.replicas) if rank in ranks)
