"""What every generate endpoint shares: admission checks, and the bridge from the engine thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from server.errors import GenerationError, InputValidationError, OverloadedError, UnavailableError
from server.sampling import SamplingParams
from server.scheduler import ErrorEvent, RequestHandle, TokenEvent, choose_seed
from server.state import ServerState


def check_admission(state: ServerState, prompt_ids: list[int], max_new_tokens: int | None) -> int:
    """Raise unless the server is ready and the request fits the limits; the new-token budget."""
    if not state.ready:
        raise UnavailableError(f"not ready: {state.phase}")
    limits = state.limits
    if not prompt_ids:
        raise InputValidationError("the input must not tokenize to an empty sequence", param="inputs")
    if len(prompt_ids) > limits.max_input_tokens:
        raise InputValidationError(
            f"inputs must have less than {limits.max_input_tokens + 1} tokens. Given: {len(prompt_ids)}",
            param="inputs",
        )
    budget = limits.max_total_tokens - len(prompt_ids)
    if max_new_tokens is None:
        return budget
    if max_new_tokens > budget:
        raise InputValidationError(
            f"inputs tokens + max_new_tokens must be <= {limits.max_total_tokens}. "
            f"Given: {len(prompt_ids)} inputs tokens and {max_new_tokens} max_new_tokens",
            param="max_new_tokens",
        )
    return max_new_tokens


class RequestStream:
    """One request, submitted on construction; its events carried from the engine thread into this loop."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: SamplingParams, stop: list[str]):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.state = state
        self.handle = RequestHandle(
            prompt_ids, choose_seed(params), stop,
            deliver=lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event),
        )
        self.arrived_at = time.monotonic()
        self.finished_at: float | None = None
        self._submit()

    def _submit(self) -> None:
        """Hand the request to the scheduler; 429 when running and queued requests are at their bounds."""
        if not self.state.scheduler.try_submit(self.handle):
            self.state.metrics.failures.labels("overloaded").inc()
            raise OverloadedError(
                "overloaded: too many requests running and queued; retry later", headers={"Retry-After": "1"}
            )

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Token events until the last (``event.finish`` set); frees the sequence if abandoned."""
        scheduler = self.state.scheduler
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, ErrorEvent):
                    self.state.metrics.failures.labels("engine").inc()
                    raise GenerationError(event.message)
                yield event
                if event.finish is not None:
                    self.finished_at = time.monotonic()
                    return
        finally:
            if not self.handle.done:
                self.state.metrics.failures.labels("cancelled").inc()
                scheduler.cancel(self.handle)  # the client went away: freed on its rank next step

    async def collect(self, request) -> list[TokenEvent]:
        """All events of a non-streamed request; a client that disconnects first cancels it."""
        collected: list[TokenEvent] = []

        async def consume() -> None:
            async for event in self.events():
                collected.append(event)

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()  # its events() finally cancels the sequence
                raise asyncio.CancelledError("client disconnected")
        consumer.result()  # re-raise a generation error
        return collected

    def timing_headers(self, validation_s: float) -> dict[str, str]:
        """text-generation-inference's per-request timing headers (milliseconds)."""
        h = self.handle
        end = self.finished_at or time.monotonic()
        started = h.started_at or end
        inference = end - started
        tokens = max(1, len(h.generated))
        return {
            "x-compute-type": "hsdp",
            "x-total-time": str(round((end - self.arrived_at + validation_s) * 1000)),
            "x-validation-time": str(round(validation_s * 1000)),
            "x-queue-time": str(round((started - h.submitted_at) * 1000)),
            "x-inference-time": str(round(inference * 1000)),
            "x-time-per-token": str(round(inference * 1000 / tokens)),
            "x-prompt-tokens": str(len(h.prompt_ids)),
            "x-generated-tokens": str(len(h.generated)),
        }
