"""Rank 0's scheduler of one replica: admits requests by KV blocks, places them, plans its ranks' steps.

Token ids only: text is the API side's business (``server.api.detokenize``). Each step:

1. every running sequence that has computed all its tokens decodes one more; one that crosses
   into a new block gets one, and when its rank has none left the youngest sequence there is
   preempted (its blocks freed, its tokens recomputed later), so the cache never overflows;
2. waiting requests are admitted in arrival order while one fits: the rank holding the longest
   cached prefix of the prompt, then the most of its images' embeddings (``ImageCacheBook``),
   then the fewest blocks in use (``_place``). All of a prompt's blocks are taken at admission;
3. prompts are computed in chunks: at most ``max_prefill_tokens`` prompt tokens per rank per
   step (on CPU shared by the prompts in flight there: ``_prefill_budgets``), new requests' first
   chunks before the rest of longer prompts, while decodes go on. With ``whole_images`` (Gemma 3:
   an image's tokens see one another) a chunk never ends inside an image: it is cut before the
   image, or, where it starts at or inside one, stretched to the image's end past that cap.

One per replica (``server.engine.step_groups`` routes requests between them), each planning for
its replica's ranks (``rank_ids``: plans name global ranks) on the rank 0 thread that steps that
replica; HTTP handlers talk to it only through ``try_submit``, ``cancel`` and ``finish``, which are
thread-safe. (With ``replicas`` of several groups one scheduler can still plan for all of them
in one step, as the engine tests do.)
"""

from __future__ import annotations

import collections
import itertools
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from server.engine.blocks import BlockPool, chain_hashes
from server.engine.multimodal import ImageCacheBook, image_keyed_tokens
from server.engine.plan import SequenceAdd, StepPlan, StepResult, Work
from server.engine.sampling import SamplingParams



@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token of one request: the engine's only record of it for the API side, made on
    rank 0's engine thread and never changed after. Text is the API side's (``server.api.outputs``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob) of the likeliest, where asked
    finish: str | None = None  # on the request's last token: length | eos_token
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    """On a request's first token, where it asked for them: (logprob, alternatives) of each prompt
    token after the first."""
    weights_version: str = ""  # the version of the weights that computed it (server.weights)


@dataclass
class ErrorEvent:
    message: str


@dataclass(eq=False)
class RequestHandle:
    """One sequence as rank 0 sees it.

    Threads: the API side creates it and reads ``prompt_ids``, ``params`` and ``cache_root``
    (never changed after); every other field is written only by the engine thread of the group
    it was placed on. The API side reads ``done`` and the timestamps only after the sequence's
    last event has reached its loop (``deliver``, called on the engine thread, hands each event
    over through ``loop.call_soon_threadsafe``, whose queue orders the writes before the reads),
    or, for ``done``, to decide whether to cancel: a stale False only sends a cancel the
    scheduler ignores for a finished sequence. No lock is needed, and none is taken."""

    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[object], None]
    tokens: list[int] = field(default_factory=list)  # prompt, then what was generated
    seq_id: int = -1
    rank: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    num_registered: int = 0  # full blocks entered in the prefix cache
    last_key: bytes = b""  # the prefix key of the last of those
    admitted_tokens: int = 0  # its tokens when last admitted (a length-dependent rope's frequencies: server.engine.rope)
    cache_root: bytes = b""  # where its prefix keys' chain starts: its cache_salt's (server.api.generation.cache_root)
    prompt_scores: list | None = None  # (logprob, top) of prompt tokens 1.., where asked for
    scheduler: object = None  # the Scheduler it was submitted to (a replica's, behind a StepGroupRouter)
    done: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    images: list = field(default_factory=list)  # the prompt's ImageInputs (server.engine.multimodal), in order

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self._keyed_prompt = image_keyed_tokens(self.prompt_ids, self.images) if self.images else None
        if self.params.prompt_logprobs is not None:
            self.prompt_scores = [None] * (len(self.prompt_ids) - 1)

    def keyed(self, start: int, end: int) -> list[int]:
        """Its tokens ``start:end`` as the prefix cache keys them: an image's placeholders by the image."""
        if self._keyed_prompt is None:
            return self.tokens[start:end]
        return (self._keyed_prompt + self.tokens[len(self.prompt_ids):])[start:end]

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


class Scheduler:
    """Rank 0's scheduler of one step group (the module says how it admits, places and plans).

    Threads: HTTP handlers call only :meth:`try_submit`, :meth:`cancel` and :meth:`finish`, which
    put into an inbox; everything else (:meth:`next_plan`, :meth:`on_result`, the queues, the
    pools) belongs to the engine thread that steps this group. Counts (``num_running``,
    ``num_waiting``) and per-rank stats are read from any thread as a snapshot that may be one
    step old. Bounded: at most ``max_running`` sequences run and ``max_queued`` wait; beyond,
    :meth:`try_submit` refuses (the API's 429)."""

    def __init__(
        self,
        *,
        pools: list[BlockPool],
        replicas: list[list[int]],
        max_running: int,
        max_total_tokens: int,
        eos_token_ids: set[int],
        max_prefill_tokens: int = 512,
        prefill_share: int = 1,
        max_queued: int = 256,
        idle_wait_s: float = 1.0,
        metrics=None,
        rank_ids: list[int] | None = None,
        cores=None,
        rope=None,
        whole_images: bool = False,
        image_cache: int = 0,
    ):
        self.pools = pools
        self.world_size = len(pools)
        # the global ranks of the pools (a replica's scheduler plans for its own ranks only): plans
        # name them, results come back from them; inside, ranks are the pools' indices
        self.rank_ids = list(rank_ids) if rank_ids is not None else list(range(len(pools)))
        self._local = {rank: i for i, rank in enumerate(self.rank_ids)}
        self.block_size = pools[0].block_size
        self.replicas = replicas
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        # the prompts in flight on a rank share its budget down to max_prefill_tokens // prefill_share (1: the
        # whole budget a step whatever waits; server.config.PREFILL_SHARE per device)
        self.prefill_share = prefill_share
        self.eos_token_ids = eos_token_ids
        self.idle_wait_s = idle_wait_s
        self.metrics = metrics
        self.cores = cores  # a server.engine.cores.HostCores shared by the step groups, or None
        self.rope = rope  # the model's server.engine.rope.RopeSwitch (length-dependent rope), or None
        # a chunk never ends inside an image: the model attends over an image's tokens both ways (Gemma 3)
        self.whole_images = whole_images
        # each rank's image embeddings by content, in rows (server.engine.multimodal.ImageCacheBook); with 0,
        # each image is let go in the step it is encoded
        self.image_cache = ImageCacheBook(len(pools), image_cache)
        self._open = 0  # requests submitted and not yet finished or cancelled
        self._open_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: dict[int, RequestHandle] = {}  # seq_id -> handle, in admission order
        self._to_remove: list[RequestHandle] = []
        self._share = None  # a PeerShare for the next plan (share_weights)
        self._update = None  # (WeightUpdate, mode) not yet planned (update_weights)
        self._go = False  # every group is quiet: plan the update (start_update)
        self._holding = False  # quiet for an update: no work until release_update
        # vLLM's POST /pause: (mode, clear_cache, its event) while paused (pause); the event is set once its
        # running sequences are done (wait), ended (abort) or frozen (keep), or once resumed first
        self._pause: tuple[str, bool, threading.Event] | None = None
        self.update_reports: list = []  # its ranks' UpdateReports of the last update
        self.weights_version = ""  # what its tokens are computed with: the last update that every rank wrote
        self._next_version = ""  # the planned update's, once every rank reports it written
        self.quiet = threading.Event()  # this group holds, nothing running (or kept): it may update
        self.updated = threading.Event()  # every rank of the group has reported
        self._ids = itertools.count()
        self._shutdown = threading.Event()
        self._shutdown_deadline = float("inf")
        self.rank_stats: list[StepResult | None] = [None] * self.world_size
        self.rank_memory: list[dict | None] = [None] * self.world_size  # each rank's latest memory report
        self.preemptions = 0
        self._step_started: float | None = None  # (time.perf_counter) while a step with a forward runs
        self._planned_at = time.perf_counter()  # when next_plan last returned
        self._step_estimate = 0.0  # the last such step's duration

    # -- thread-safe entry points ------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> None:
        """Queue ``handle`` whatever the load (warm-up); requests go through ``try_submit``."""
        with self._open_lock:
            self._open += 1
        handle.scheduler = self
        self._inbox.put(("submit", handle))

    def try_submit(self, handle: RequestHandle) -> bool:
        """Queue ``handle`` unless running and waiting requests are both at their bounds."""
        with self._open_lock:
            if self._open >= self.max_running + self.max_queued:
                return False
            self._open += 1
        handle.scheduler = self
        self._inbox.put(("submit", handle))
        return True

    @property
    def open_requests(self) -> int:
        """Submitted and not yet finished or cancelled."""
        return self._open

    def cancel(self, handle: RequestHandle) -> None:
        """The client went away: free the sequence at the next step."""
        self._inbox.put(("cancel", handle))

    def finish(self, handle: RequestHandle) -> None:
        """The API side ended the request (a stop sequence): free it at the next step."""
        self._inbox.put(("finish", handle))

    def share_weights(self, share) -> None:
        """Hand the next plan a ``PeerShare`` (its ranks start sending to a peer group; steps go on)."""
        self._inbox.put(("share", share))

    def update_weights(self, update, mode: str) -> None:
        """Plan ``update`` (a ``WeightUpdate``) as vLLM's pause modes say: ``wait`` lets the running
        sequences finish first (new ones wait), ``abort`` ends them now with an error, ``keep``
        updates at the next step and goes on with them (their cached keys and values are the old
        weights'). Admission stops at once; once its running sequences are done (or kept) the group
        holds, stepping nothing, and sets ``quiet``; :meth:`start_update` then plans the update
        step, ``updated`` is set once every rank has reported, and the group holds until
        :meth:`release_update`. Two phases, so that no group writes weights while another still
        computes with them (a host's ranks share their resident copy)."""
        self.quiet.clear()
        self.updated.clear()
        self.update_reports = []
        self._inbox.put(("update", (update, mode)))

    def start_update(self) -> None:
        self._inbox.put(("go", None))

    def pause(self, mode: str, clear_cache: bool = True) -> threading.Event:
        """vLLM's pause: admission stops (new requests queue until :meth:`resume`); ``wait`` lets the
        running sequences finish (those preempted meanwhile too), ``abort`` ends the running and
        queued ones with an error, ``keep`` freezes the running ones. ``clear_cache``: the cached
        prefixes and image embeddings are dropped once settled (on the ranks too), and kept
        sequences give their blocks back, to be recomputed at resume (as vLLM discards their KV:
        whatever weights are loaded meanwhile compute all of it). Returns an event set once the
        running sequences are done, ended or frozen, or once resumed before that (``paused_by_request``
        tells which); a pause while paused changes nothing and its event is set at once."""
        settled = threading.Event()
        self._inbox.put(("pause", (mode, clear_cache, settled)))
        return settled

    def resume(self) -> None:
        self._inbox.put(("resume", None))

    def release_update(self) -> None:
        self._inbox.put(("release", None))

    @property
    def paused(self) -> bool:
        """An update is planned, this group holds for the others, or it is paused: nothing is admitted."""
        return self._update is not None or self._holding or self._pause is not None

    @property
    def updating(self) -> bool:
        """A weight update is planned or this group holds for one (``server.weights``)."""
        return self._update is not None or self._holding

    @property
    def paused_by_request(self) -> bool:
        """Paused by :meth:`pause` (vLLM's ``/is_paused``)."""
        return self._pause is not None

    def _drained(self) -> bool:
        """No sequence runs, and none waits that had started (preempted: it must finish too)."""
        return not self._running and not any(h.started_at is not None for h in self._waiting)

    def _frozen(self) -> bool:
        """Paused with nothing to compute: every running sequence kept, or none left."""
        return self._pause is not None and (self._pause[0] == "keep" or self._drained())

    def request_shutdown(self, timeout_s: float = float("inf")) -> None:
        """Stop once the open requests have finished, or after ``timeout_s`` whatever remains."""
        self._shutdown_deadline = time.monotonic() + timeout_s
        self._shutdown.set()
        self._inbox.put(("wake", None))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence some rank's whole KV pool holds."""
        return max(p.num_blocks for p in self.pools) * self.block_size

    def fits_ever(self, tokens: int) -> bool:
        return tokens <= self.max_sequence_tokens

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- engine thread ---------------------------------------------------------------------
    def next_plan(self) -> StepPlan:
        """The plan for the next step; blocks up to ``idle_wait_s`` while nothing runs."""
        idle = not self._running and not self._waiting and not self._to_remove
        self._drain_inbox(block=idle or (self._holding and not self._go) or (self._frozen() and not self._to_remove))
        plan = StepPlan()
        for handle in self._to_remove:
            self._release(handle, plan)
        self._to_remove = []
        if self._frozen() and not self._pause[2].is_set():
            self._settle_pause(plan)
        if self._update is not None and not self._holding and (
                self._update[1] == "keep" or self._drained() or self._frozen()):
            self._holding = True  # quiet: the router starts every group's update once all are
            self.quiet.set()
        if self._holding and self._go and self._update is not None:
            plan.update, self._update, self._go = self._update[0], None, False  # no work: every rank updates
            self._next_version = plan.update.version
            for pool in self.pools:  # what the cache holds was computed by the old weights
                pool.forget_prefixes()
            self.image_cache.clear()  # the ranks drop theirs as they update
        elif not self._holding and not self._frozen():
            continuing = self._plan_decodes(plan)
            budget = self._prefill_budgets(continuing)
            # while an update or a pause waits for the running, only those preempted meanwhile come back
            self._admit(plan, budget, started_only=self._update is not None or self._pause is not None)
            for handle in continuing:  # the rest of longer prompts, after new requests' first chunks
                self._plan_chunk(handle, plan, budget)
        plan.forward = any(plan.work.values())
        plan.share, self._share = self._share, None
        if self._shutdown.is_set() and time.monotonic() > self._shutdown_deadline:
            self.fail_all("the server is shutting down: the shutdown timeout cut this request short")
        plan.shutdown = self._shutdown.is_set() and not self._running and not self._waiting
        plan.forget_images = {r: keys for r, keys in plan.forget_images.items() if keys}
        if self.rank_ids != list(range(self.world_size)):  # pools' indices to global ranks
            plan.work = {self.rank_ids[r]: work for r, work in plan.work.items()}
            plan.forget_images = {self.rank_ids[r]: keys for r, keys in plan.forget_images.items()}
            for add in plan.add:
                add.rank = self.rank_ids[add.rank]
        if self.cores is not None:
            plan.threads = self.cores.threads(self.rank_ids, [rank for rank, work in plan.work.items() if work])
        self._planned_at = time.perf_counter()
        return plan

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = item
            if kind == "submit":
                self._waiting.append(handle)
            elif kind in ("cancel", "finish"):
                self._end(handle)
            elif kind == "share":
                self._share = handle
            elif kind == "update":
                self._update = handle
                if handle[1] == "abort":
                    self._abort(list(self._running.values()),
                                "aborted: the server's weights are being updated (POST /admin/weights, mode abort)")
            elif kind == "pause":
                if self._pause is not None:  # already paused: as it was
                    handle[2].set()
                else:
                    self._pause = handle
                    if handle[0] == "abort":
                        self._abort(list(self._running.values()) + list(self._waiting),
                                    "aborted: generation was paused (POST /pause, mode abort)")
            elif kind == "resume":
                if self._pause is not None:
                    self._pause[2].set()  # a pause not yet settled answers now
                self._pause = None
            elif kind == "go":
                self._go = True
            elif kind == "release":
                self._holding = False
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _settle_pause(self, plan: StepPlan) -> None:
        """The pause has taken: with ``clear_cache`` the prefixes and image embeddings go, and the kept
        sequences give back their blocks (recomputed once resumed)."""
        if self._pause[1]:
            for handle in sorted(self._running.values(), key=lambda h: h.seq_id, reverse=True):
                self._preempt(handle, plan, counted=False)  # queued first again, oldest first
            for pool in self.pools:
                pool.forget_prefixes()
            self.image_cache.clear(plan.forget_images)  # and the ranks let theirs go
        self._pause[2].set()

    def _abort(self, handles: list[RequestHandle], message: str) -> None:
        for handle in handles:
            self._end(handle)
            handle.deliver(ErrorEvent(message))

    def _end(self, handle: RequestHandle) -> None:
        if handle.done:
            return
        self._close(handle)
        if handle.seq_id in self._running:
            self._to_remove.append(handle)  # freed on its rank at the next step
        else:
            try:
                self._waiting.remove(handle)
            except ValueError:
                pass

    def _close(self, handle: RequestHandle) -> None:
        handle.done = True
        with self._open_lock:
            self._open -= 1

    def _release(self, handle: RequestHandle, plan: StepPlan) -> None:
        """Take ``handle``'s sequence off its rank and give its blocks back."""
        if self._running.pop(handle.seq_id, None) is None:
            return
        plan.remove.append(handle.seq_id)
        self.pools[handle.rank].release(handle.blocks)
        handle.blocks = []

    # -- planning ----------------------------------------------------------------------------
    def _plan_decodes(self, plan: StepPlan) -> list[RequestHandle]:
        """One token for every sequence whose tokens are all computed; returns those still in
        their prompt, oldest first."""
        continuing = []
        for handle in list(self._running.values()):
            if handle.seq_id not in self._running:  # preempted earlier in this loop
                continue
            remaining = len(handle.tokens) - handle.num_computed
            if remaining > 1:
                continuing.append(handle)
                continue
            if self.rope is not None and self.rope.recomputes_at(handle.admitted_tokens, handle.num_computed,
                                                                 len(handle.tokens)):
                # past the rope's switch: computed again whole, as its family's generate does (server.engine.rope)
                self._preempt(handle, plan, counted=False)
                continue
            new_blocks = self._grow(handle, plan)
            if new_blocks is None:  # preempted itself
                continue
            plan.work.setdefault(handle.rank, []).append(Work(handle.seq_id, handle.num_computed, 1, new_blocks))
            handle.num_computed += 1
        return continuing

    def _grow(self, handle: RequestHandle, plan: StepPlan) -> list[int] | None:
        """The blocks ``handle`` needs for one more token, preempting the youngest sequences of
        its rank while none is free; None if ``handle`` itself was the one preempted."""
        pool = self.pools[handle.rank]
        need = self._blocks_for(handle.num_computed + 1) - len(handle.blocks)
        new = []
        while len(new) < need:
            block = pool.allocate()
            if block is not None:
                new.append(block)
                continue
            victim = self._youngest_on(handle.rank)
            self._preempt(victim, plan)
            if victim is handle:
                pool.release(new)
                return None
        handle.blocks += new
        return new

    def _youngest_on(self, rank: int) -> RequestHandle:
        return next(h for h in reversed(self._running.values()) if h.rank == rank)

    def _preempt(self, handle: RequestHandle, plan: StepPlan, counted: bool = True) -> None:
        """Free ``handle``'s blocks and queue it first again; its tokens so far become its prompt.
        ``counted``: a preemption for blocks (not a recompute the model asks for)."""
        self._release(handle, plan)
        for work in plan.work.get(handle.rank, []):
            if work.seq_id == handle.seq_id:  # planned earlier this step: undo
                plan.work[handle.rank].remove(work)
                break
        handle.num_computed = handle.num_registered = 0
        handle.last_key = handle.cache_root
        if counted:
            self.preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        self._waiting.appendleft(handle)

    def prefix_root(self, handle: RequestHandle) -> bytes:
        """Where ``handle``'s prefix keys' chain starts: its cache salt's root, salted again where a
        length-dependent rope computes its keys with other frequencies (``RopeSwitch.prefix_root``)."""
        if self.rope is None:
            return handle.cache_root
        return self.rope.prefix_root(handle.cache_root,
                                     self.rope.prompt_length(len(handle.tokens), handle.num_generated))

    def _prefill_budgets(self, continuing: list[RequestHandle]) -> list[int]:
        """Each rank's prompt tokens this step: ``max_prefill_tokens`` shared by the prompts in
        flight on it (those mid-prompt there, and an even share of those waiting that could be
        admitted), down to ``max_prefill_tokens // prefill_share``. A prompt alone gets the whole budget; a wave of
        short prompts is spread over a few steps, so that its first tokens come as each prompt is
        done rather than all after the wave's one long step (the 85M on 2 CPU ranks, TTFT p50: 16
        clients 226-296 ms against 276-338 at a fixed 512; 64 clients 503-653 against 931 ms;
        benchmarks/RESULTS.md, session 24)."""
        if self.prefill_share <= 1:
            return [self.max_prefill_tokens] * self.world_size
        prompts = [0] * self.world_size
        for handle in continuing:
            prompts[handle.rank] += 1
        admissible = max(0, min(len(self._waiting), self.max_running - len(self._running)))
        share = -(-admissible // self.world_size)
        least = max(1, self.max_prefill_tokens // self.prefill_share)
        return [max(least, self.max_prefill_tokens // max(1, n + share)) for n in prompts]

    def _plan_chunk(self, handle: RequestHandle, plan: StepPlan, budget: list[int]) -> None:
        if handle.seq_id not in self._running:
            return
        count = min(len(handle.tokens) - handle.num_computed, budget[handle.rank])
        if count <= 0:
            return
        if self.whole_images and handle.images:
            count = _whole_images(handle.images, handle.num_computed, count)
        budget[handle.rank] -= count
        plan.work.setdefault(handle.rank, []).append(Work(handle.seq_id, handle.num_computed, count))
        handle.num_computed += count

    def _admit(self, plan: StepPlan, budget: list[int], started_only: bool = False) -> None:
        while self._waiting and len(self._running) < self.max_running:
            handle = self._waiting[0]
            if started_only and handle.started_at is None:
                return
            tokens = handle.tokens
            usable = (len(tokens) - 1) // self.block_size  # the last token is always computed
            if handle.params.prompt_logprobs is not None:
                usable = 0  # every prompt position is computed, to be scored
            root = self.prefix_root(handle)
            keys = chain_hashes(handle.keyed(0, usable * self.block_size), self.block_size, root)
            placed = self._place(len(tokens), keys, budget, handle.images)
            if placed is None:
                if not self.fits_ever(len(tokens)):  # admission checks make this rare: a long preempted sequence
                    self._waiting.popleft()
                    self._close(handle)
                    handle.deliver(ErrorEvent(f"the sequence ({len(tokens)} tokens) no longer fits the KV cache"))
                    continue
                return  # head of line waits for blocks
            rank, cached = placed
            self._waiting.popleft()
            pool = self.pools[rank]
            pool.take(cached)
            need = self._blocks_for(len(tokens)) - len(cached)
            handle.blocks = cached + [pool.allocate() for _ in range(need)]
            pool.count_lookup(len(tokens), len(cached) * self.block_size)
            if self.metrics is not None:  # every lookup, as the pool's own counters (/info) count them
                self.metrics.prefix_queried_tokens.inc(len(tokens))
                self.metrics.prefix_hit_tokens.inc(len(cached) * self.block_size)
            handle.num_computed = len(cached) * self.block_size
            handle.num_registered = len(cached)
            handle.admitted_tokens = len(tokens)
            handle.last_key = keys[len(cached) - 1] if cached else root
            handle.seq_id, handle.rank = next(self._ids), rank
            if handle.started_at is None:  # its first admission (not a return after a preemption)
                handle.started_at = time.monotonic()
                if self.metrics is not None:
                    self.metrics.queue_time.observe(handle.started_at - handle.submitted_at)
                    self.metrics.prompt_tokens.inc(len(handle.prompt_ids))
            self._running[handle.seq_id] = handle
            images = [image for image in handle.images if image.end > handle.num_computed]
            if images:
                forget = plan.forget_images.setdefault(rank, [])
                images = [self.image_cache.take(rank, image, forget) for image in images]
                if self.metrics is not None:
                    for image in images:
                        self.metrics.images.labels("cached" if image.cached else "encoded").inc()
            grids = [[image.start, image.count, *image.grid] for image in handle.images if image.grid]
            plan.add.append(SequenceAdd(handle.seq_id, rank, list(tokens), handle.params, list(handle.blocks),
                                        handle.num_generated, images, grids))
            plan.encode = plan.encode or any(not image.cached for image in images)
            self._plan_chunk(handle, plan, budget)

    def _place(self, num_tokens: int, keys: list[bytes], budget: list[int], images: list = ()
               ) -> tuple[int, list[int]] | None:
        """(rank, its cached prefix blocks) for a new sequence, or None where none fits now.

        A replica first (the fewest blocks in use), then the rank within it that holds the
        longest cached prefix, then the most of its images' embeddings (``ImageCacheBook``), then has
        the fewest blocks in use: the work spreads by the memory
        it takes, whatever the pools' sizes (auto-sized pools differ by a few hundred blocks
        between ranks, which once sent a whole burst to the larger one). A rank must have room
        for the sequence and keep 1% of its blocks for its running sequences to grow into, and
        have prompt budget left this step, so that the first chunk runs in the very next step."""
        blocks = self._blocks_for(num_tokens)
        busy = {h.rank for h in self._running.values()}
        for replica in sorted(self.replicas, key=lambda r: sum(self.pools[i].num_used for i in r)):
            best = None
            for rank in replica:
                pool = self.pools[rank]
                cached = pool.match_prefix(keys)
                reserve = max(1, pool.num_blocks // 100) if rank in busy else 0
                if blocks - len(cached) + reserve > pool.num_available - pool.count_unreferenced(cached):
                    continue
                if budget[rank] <= 0 and num_tokens - len(cached) * self.block_size > 1:
                    continue
                score = (len(cached), self.image_cache.held(rank, images) if images else 0, -pool.num_used)
                if best is None or score > best[0]:
                    best = (score, rank, cached)
            if best is not None:
                return best[1], best[2]
        return None

    # -- results -----------------------------------------------------------------------------
    def on_results(self, results: list[StepResult]) -> None:
        for result in results:
            if result.update is not None:
                self.update_reports.append((result.rank, result.update))
                if len(self.update_reports) == len(self.rank_ids):
                    if all(report.error is None for _, report in self.update_reports):
                        self.weights_version = self._next_version  # the next step computes with them
                    self.updated.set()
            local = self._local[result.rank]
            self.rank_stats[local] = result
            if result.memory is not None:
                self.rank_memory[local] = result.memory
            for scores in result.prompt_logprobs:
                handle = self._running.get(scores.seq_id)
                if handle is not None and handle.prompt_scores is not None:  # (a recomputation: the same again)
                    at = scores.start - 1
                    handle.prompt_scores[at:at + len(scores.logprobs)] = list(zip(scores.logprobs, scores.top))
            for token in result.tokens:
                handle = self._running.get(token.seq_id)
                if handle is None or handle.done:
                    continue
                if token.error is not None:
                    # its blocks may never have been computed (an image that failed before the forward)
                    handle.num_computed = handle.num_registered * self.block_size
                    self._close(handle)
                    self._to_remove.append(handle)  # already dropped on its rank
                    handle.deliver(ErrorEvent(f"generation failed: {token.error}"))
                else:
                    self._on_token(handle, token)
        for handle in self._running.values():
            self._register_blocks(handle)

    def _register_blocks(self, handle: RequestHandle) -> None:
        """Enter ``handle``'s newly completed full blocks in its rank's prefix cache."""
        full = min(handle.num_computed // self.block_size, len(handle.blocks))
        if full <= handle.num_registered:
            return
        keys = chain_hashes(handle.keyed(handle.num_registered * self.block_size, full * self.block_size),
                            self.block_size, handle.last_key)
        pool = self.pools[handle.rank]
        for i, key in enumerate(keys, start=handle.num_registered):
            pool.register(handle.blocks[i], key)
        handle.num_registered, handle.last_key = full, keys[-1]

    def _on_token(self, handle: RequestHandle, result) -> None:
        token_id = result.token_id
        now = time.monotonic()
        if self.metrics is not None:
            if handle.first_token_at is None:
                self.metrics.time_to_first_token.observe(now - handle.submitted_at)
            else:
                self.metrics.inter_token_latency.observe(now - handle.last_token_at)
            self.metrics.generated_tokens.inc()
        if handle.first_token_at is None:
            handle.first_token_at = now
        handle.last_token_at = now
        handle.tokens.append(token_id)
        reason = None
        params = handle.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids \
                or result.stop:  # (stop: its grammar is complete)
            reason = "eos_token"
        elif handle.num_generated >= handle.params.max_new_tokens or len(handle.tokens) >= self.max_total_tokens:
            reason = "length"
        if reason is not None:
            self._close(handle)
            self._to_remove.append(handle)  # freed on its rank at the next step
        first = handle.prompt_scores is not None and handle.num_generated == 1
        handle.deliver(TokenEvent(token_id, result.logprob, result.top, reason,
                                  handle.prompt_scores if first else None, self.weights_version))

    def step_began(self, at: float) -> None:
        """The engine thread: a step with a forward went out at ``at`` (``time.perf_counter``)."""
        self._step_started = at

    def step_ended(self, duration_s: float) -> None:
        self._step_started, self._step_estimate = None, duration_s

    def stalled_for(self, now: float) -> float:
        """Seconds this group has made no progress while it has work (``time.perf_counter``; any
        thread): the step in progress so far, or, with requests in, since the last plan went out
        (a healthy loop plans again at once, and at least every idle wait)."""
        started = self._step_started
        if started is not None:
            return max(0.0, now - started)
        if self._holding or self._frozen():  # waiting for the other groups' weight updates, or paused: not stuck
            return 0.0
        if self._running or self._waiting or not self._inbox.empty():
            return max(0.0, now - self._planned_at)
        return 0.0

    def step_remaining(self, now: float) -> float:
        """Seconds until the step in progress is expected to end (0 between steps): how long a
        request submitted now waits before its first chunk can be planned. Any thread."""
        started = self._step_started
        return 0.0 if started is None else max(0.0, started + self._step_estimate - now)

    def observe_step(self, *, step_s: float, control_s: float) -> None:
        """Rank 0's timing of one step with a forward: its own engine step, and the time spent in
        the control channel (the plan out, every rank's tokens back, waiting for the slowest)."""
        if self.metrics is not None:
            self.metrics.step_duration.observe(step_s)
            self.metrics.control_duration.observe(control_s)

    def fail_all(self, message: str) -> None:
        """Answer every request still open with an error (the group is going down)."""
        for handle in list(self._running.values()) + list(self._waiting):
            if not handle.done:
                self._close(handle)
                handle.deliver(ErrorEvent(message))
        for handle in list(self._running.values()):
            self.pools[handle.rank].release(handle.blocks)
            handle.blocks = []
        self._running.clear()
        self._waiting.clear()


def choose_seed(params: SamplingParams) -> SamplingParams:
    """Sampling without a seed gets one here, so that the response can report it."""
    if params.samples and params.seed is None:
        params.seed = random.randrange(2**63)
    return params


def _whole_images(images: list, start: int, count: int) -> int:
    """A chunk of ``count`` tokens from ``start`` cut before an image it would end inside, or, where
    it starts inside that image or at it, stretched to the image's end (beyond the step's budget:
    an image is never split)."""
    end = start + count
    for image in images:
        first, last = image.start, image.end
        if first < end < last:
            end = first if first > start else last
            break
    return end - start
