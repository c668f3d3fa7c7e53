"""Rank 0's scheduler: admits requests, spreads their sequences over ranks, turns tokens into text.

Iteration-level: each step admits waiting requests up to the concurrency limit and retires
finished ones at once, so a short request never waits for a long one. Runs on rank 0's engine
thread; HTTP handlers talk to it only through ``submit`` and ``cancel``, which are thread-safe.
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

from server.engine import NewSequence, StepPlan, StepResult
from server.sampling import SamplingParams


@dataclass
class FinishEvent:
    reason: str  # length | eos_token | stop_sequence
    generated_text: str
    generated_tokens: int
    seed: int | None


@dataclass
class TokenEvent:
    id: int
    text: str
    logprob: float
    special: bool
    full_text: str = ""  # the generated text so far, decoded as a whole
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)
    finish: FinishEvent | None = None  # set on the request's last token


@dataclass
class ErrorEvent:
    message: str


@dataclass(eq=False)
class RequestHandle:
    """One request's sequence as rank 0 sees it. ``deliver`` is called on the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    deliver: Callable[[object], None]
    seq_id: int = -1
    rank: int = -1
    generated: list[int] = field(default_factory=list)
    text: str = ""
    cancelled: bool = False
    done: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


class Scheduler:
    def __init__(
        self,
        tokenizer,
        *,
        world_size: int,
        max_running: int,
        max_total_tokens: int,
        eos_token_ids: set[int],
        max_queued: int = 256,
        idle_wait_s: float = 1.0,
        metrics=None,
    ):
        self.tokenizer = tokenizer
        self.world_size = world_size
        self.max_running = max_running
        self.max_queued = max_queued
        self._open = 0  # requests submitted and not yet finished or cancelled
        self._open_lock = threading.Lock()
        self.max_total_tokens = max_total_tokens
        self.eos_token_ids = eos_token_ids
        self.special_ids = set(getattr(tokenizer, "all_special_ids", ()))
        self.idle_wait_s = idle_wait_s
        self.metrics = metrics
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: dict[int, RequestHandle] = {}
        self._to_remove: list[int] = []
        self._ids = itertools.count()
        self._shutdown = threading.Event()
        self._shutdown_deadline = float("inf")
        self.per_rank_active = [0] * world_size
        self.rank_stats: list[StepResult | None] = [None] * world_size

    # -- thread-safe entry points ------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> None:
        """Queue ``handle`` whatever the load (warm-up); requests go through ``try_submit``."""
        with self._open_lock:
            self._open += 1
        self._inbox.put(("submit", handle))

    def try_submit(self, handle: RequestHandle) -> bool:
        """Queue ``handle`` unless running and waiting requests are both at their bounds."""
        with self._open_lock:
            if self._open >= self.max_running + self.max_queued:
                return False
            self._open += 1
        self._inbox.put(("submit", handle))
        return True

    def _close(self, handle: RequestHandle) -> None:
        handle.done = True
        with self._open_lock:
            self._open -= 1

    def cancel(self, handle: RequestHandle) -> None:
        self._inbox.put(("cancel", handle))

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

    # -- engine thread ---------------------------------------------------------------------
    def next_plan(self) -> StepPlan:
        """The plan for the next step; blocks up to ``idle_wait_s`` while nothing runs."""
        idle = not self._running and not self._waiting and not self._to_remove
        self._drain_inbox(block=idle)
        plan = StepPlan(remove=self._to_remove)
        self._to_remove = []
        for seq_id in plan.remove:
            handle = self._running.pop(seq_id)
            self.per_rank_active[handle.rank] -= 1
        while self._waiting and len(self._running) < self.max_running:
            handle = self._waiting.popleft()
            handle.seq_id = next(self._ids)
            handle.rank = min(range(self.world_size), key=lambda r: (self.per_rank_active[r], r))
            handle.started_at = time.monotonic()
            if self.metrics is not None:
                self.metrics.queue_time.observe(handle.started_at - handle.submitted_at)
                self.metrics.prompt_tokens.inc(len(handle.prompt_ids))
            self.per_rank_active[handle.rank] += 1
            self._running[handle.seq_id] = handle
            plan.add.append(NewSequence(handle.seq_id, handle.rank, handle.prompt_ids, handle.params))
        plan.forward = bool(self._running)
        if self._shutdown.is_set() and time.monotonic() > self._shutdown_deadline:
            self.fail_all("the server is shutting down: the shutdown timeout cut this request short")
        plan.shutdown = self._shutdown.is_set() and not self._running and not self._waiting
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
            elif kind == "cancel":
                self._cancel(handle)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, handle: RequestHandle) -> None:
        if handle.done:
            return
        handle.cancelled = True
        self._close(handle)
        if handle.seq_id in self._running:
            self._to_remove.append(handle.seq_id)  # freed on its rank at the next step
        else:
            try:
                self._waiting.remove(handle)
            except ValueError:
                pass

    def on_results(self, results: list[StepResult]) -> None:
        for result in results:
            self.rank_stats[result.rank] = result
            for token in result.tokens:
                handle = self._running.get(token.seq_id)
                if handle is None or handle.done:
                    continue
                if token.error is not None:
                    self._close(handle)
                    self._to_remove.append(handle.seq_id)  # already dropped on its rank
                    handle.deliver(ErrorEvent(f"generation failed: {token.error}"))
                else:
                    self._on_token(handle, token)

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
        handle.generated.append(token_id)
        text = self.tokenizer.decode(handle.generated, skip_special_tokens=True)
        reason = None
        if token_id in self.eos_token_ids:
            reason = "eos_token"
        elif any(stop in text[max(0, len(handle.text) - len(stop)):] for stop in handle.stop):
            reason = "stop_sequence"
        elif len(handle.generated) >= handle.params.max_new_tokens:
            reason = "length"
        elif len(handle.prompt_ids) + len(handle.generated) >= self.max_total_tokens:
            reason = "length"
        handle.text = text
        finish = None
        if reason is not None:
            self._close(handle)
            self._to_remove.append(handle.seq_id)  # freed on its rank at the next step
            seed = handle.params.seed if handle.params.samples else None
            finish = FinishEvent(reason, text, len(handle.generated), seed)
        top = [(t, self.tokenizer.decode([t]), lp) for t, lp in result.top]
        handle.deliver(TokenEvent(
            token_id, self.tokenizer.decode([token_id]), result.logprob, token_id in self.special_ids, text, top, finish
        ))

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
        self._running.clear()
        self._waiting.clear()


def choose_seed(params: SamplingParams) -> SamplingParams:
    """Sampling without a seed gets one here, so that the response can report it."""
    if params.samples and params.seed is None:
        params.seed = random.randrange(2**63)
    return params
