"""What every generate endpoint shares: admission checks, and the bridge from the engine thread.

:class:`RequestStream` is one request on the asyncio side: it submits the token ids, receives the
engine's token events and yields each as its :class:`~server.api.outputs.TokenOutput` (the text it
adds, what a client may see, the finish); a stop sequence ends the request here (the scheduler is
told to free the sequence). Both APIs read the same outputs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

from server.api.outputs import OutputProcessor, TokenOutput
from server.engine.sampling import SamplingParams
from server.engine.scheduler import ErrorEvent, RequestHandle, choose_seed
from server.http.errors import GenerationError, InputValidationError, OverloadedError, UnavailableError
from server.http.state import ServerState


def require_ready(state: ServerState) -> None:
    """503 until the model is loaded and warmed up (before then there is no tokenizer to use)."""
    if not state.ready:
        raise UnavailableError(f"not ready: {state.phase}", headers={"Retry-After": "1"})


async def off_loop(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a worker thread: tokenizing a long text or rendering a chat
    template takes milliseconds to seconds, and on the event loop every other request (and
    ``/health``) would wait for it."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def tokenize(state: ServerState, text: str, **kwargs) -> list[int]:
    """``text``'s token ids, off the event loop."""
    return (await off_loop(state.tokenizer, text, **kwargs)).input_ids


def check_request_bounds(state: ServerState, *, sequences: int, sequences_param: str, stops: list[str] = (),
                         stop_param: str = "stop", top_logprobs: int = 0, top_param: str = "logprobs") -> None:
    """The work one request may ask for (``--max-sequences-per-request``, ``--max-stop-sequences``,
    ``--max-stop-sequence-chars``, ``--max-top-logprobs``): else the API's validation error naming
    the parameter."""
    limits = state.limits
    if sequences > limits.max_sequences_per_request:
        raise InputValidationError(
            f"{sequences_param}: the request asks for {sequences} sequences; at most "
            f"{limits.max_sequences_per_request} per request (--max-sequences-per-request)", param=sequences_param)
    if len(stops) > limits.max_stop_sequences:
        raise InputValidationError(f"{stop_param}: at most {limits.max_stop_sequences} stop sequences, got "
                                   f"{len(stops)} (--max-stop-sequences)", param=stop_param)
    if any(len(s) > limits.max_stop_sequence_chars for s in stops):
        raise InputValidationError(f"{stop_param}: a stop sequence has at most {limits.max_stop_sequence_chars} "
                                   f"characters (--max-stop-sequence-chars)", param=stop_param)
    if top_logprobs > limits.max_top_logprobs:
        raise InputValidationError(f"{top_param}: at most {limits.max_top_logprobs} alternatives per token, got "
                                   f"{top_logprobs} (--max-top-logprobs)", param=top_param)


def check_admission(state: ServerState, prompt_ids: list[int], max_new_tokens: int | None) -> int:
    """Raise unless the server is ready and the request fits the limits; the new-token budget."""
    require_ready(state)
    limits = state.limits
    if not prompt_ids:
        raise InputValidationError("the input must not tokenize to an empty sequence", param="inputs")
    if len(prompt_ids) > limits.max_input_tokens:
        raise InputValidationError(
            f"inputs must have less than {limits.max_input_tokens + 1} tokens. Given: {len(prompt_ids)}",
            param="inputs",
        )
    capacity = state.scheduler.max_sequence_tokens
    if max_new_tokens is None:  # as much as the context allows, and the KV cache holds
        room = min(limits.max_total_tokens, capacity)
        if len(prompt_ids) >= room:
            raise InputValidationError(
                f"the input ({len(prompt_ids)} tokens) leaves no room for new tokens: a sequence holds at most "
                f"{room} tokens", param="inputs")
        return room - len(prompt_ids)
    if len(prompt_ids) + max_new_tokens > limits.max_total_tokens:
        raise InputValidationError(
            f"inputs tokens + max_new_tokens must be <= {limits.max_total_tokens}. "
            f"Given: {len(prompt_ids)} inputs tokens and {max_new_tokens} max_new_tokens",
            param="max_new_tokens",
        )
    if len(prompt_ids) + max_new_tokens > capacity:
        raise InputValidationError(
            f"inputs tokens + max_new_tokens ({len(prompt_ids)} + {max_new_tokens}) can never fit a rank's KV cache "
            f"({capacity} tokens; raise --kv-cache-memory)", param="max_new_tokens",
        )
    return max_new_tokens


def check_token_ids(ids, vocab: int, param: str) -> None:
    """Token ids a request gives (prompts, logit_bias, stop_token_ids, detokenize) must lie in the
    vocabulary (``state.vocab_size`` for what reaches the model: the embedding's rows may be fewer
    than the tokenizer's tokens, and an id past them would fail inside the forward on every rank);
    the first that does not is the API's validation error naming ``param``."""
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise InputValidationError(f"{param}: token id {bad[0]} is outside the vocabulary ({vocab} tokens)",
                                   param=param)


GRAMMAR_THREADS = 2
"""Grammar builds and checks that run at once on rank 0, off its event loop (llguidance drops the
GIL while it compiles: each holds a core for up to a second); more wait their turn."""


@functools.cache
def _grammar_threads():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="hsdp-grammar-check")


async def run_grammar_work(fn, *args):
    """``fn(*args)`` on rank 0's bounded grammar threads, awaited: the event loop (``/health``
    among the rest) answers while a large grammar compiles."""
    return await asyncio.get_running_loop().run_in_executor(_grammar_threads(), fn, *args)


async def checked_grammar(state: ServerState, build, param: str, what: str | None = None) -> str:
    """``build()``'s llguidance grammar, checked against the served vocabulary, both off the event
    loop (rank 0's engine then copies the compiled form); one it cannot take is the API's
    validation error naming ``param``, its message after ``what`` (default: the parameter)."""
    from server.engine.grammar import grammars_of

    def checked() -> str:
        grammar = build()
        grammars_of(state.tokenizer).check(grammar)
        return grammar

    try:
        return await run_grammar_work(checked)
    except Exception as e:  # noqa: BLE001 - llguidance's errors are plain exceptions with a message
        raise InputValidationError(f"{what or param}: {e}", param=param) from e


async def compile_grammar(state: ServerState, kind: str, spec, param: str) -> str:
    """The grammar of a request's structured-output field (``response_format``, TGI's ``grammar``)."""
    from server.engine.grammar import grammar_for

    return await checked_grammar(state, lambda: grammar_for(kind, spec), param)


class RequestStream:
    """One request, submitted on construction; its events carried from the engine thread into this loop."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: SamplingParams, stop: list[str],
                 cache_salt: str | None = None, images: list | None = None):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.state = state
        self.handle = RequestHandle(
            prompt_ids, choose_seed(params),
            deliver=lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event),
            cache_root=cache_root(cache_salt), images=list(images or ()),
        )
        self.output = OutputProcessor(state.tokenizer, stop, state.special_ids)
        self.num_tokens = 0  # tokens delivered (the engine may have made one or two more after a stop)
        self.finish_reason: str | None = None
        self.weights_version: str | None = None  # the version of the weights that computed its last token
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

    @property
    def text(self) -> str:
        """The text generated so far (stop sequence included)."""
        return self.output.text

    @property
    def visible_text(self) -> str:
        """The text generated so far, cut before a stop sequence (as OpenAI returns it)."""
        return self.output.visible_text

    @property
    def seed(self) -> int | None:
        return self.handle.params.seed if self.handle.params.samples else None

    async def events(self) -> AsyncIterator[TokenOutput]:
        """The request's outputs until the last (``finish`` set); frees the sequence if abandoned."""
        scheduler = self.state.scheduler
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, ErrorEvent):
                    self.state.metrics.failures.labels("engine").inc()
                    raise GenerationError(event.message)
                out = self.output.process(event)
                self.num_tokens += 1
                self.weights_version = event.weights_version or None
                if out.finish == "stop_sequence":
                    scheduler.finish(self.handle)
                yield out
                if out.finish is not None:
                    self.finish_reason = out.finish
                    self.finished_at = time.monotonic()
                    return
        finally:
            if self.finish_reason is None and not self.handle.done:
                self.state.metrics.failures.labels("cancelled").inc()
                scheduler.cancel(self.handle)  # the client went away: freed on its rank next step

    def timing_headers(self, validation_s: float) -> dict[str, str]:
        """text-generation-inference's per-request timing headers (milliseconds)."""
        h = self.handle
        end = self.finished_at or time.monotonic()
        started = h.started_at or end
        inference = end - started
        tokens = max(1, self.num_tokens)
        return {
            "x-compute-type": "hsdp",
            "x-total-time": str(round((end - self.arrived_at + validation_s) * 1000)),
            "x-validation-time": str(round(validation_s * 1000)),
            "x-queue-time": str(round((started - h.submitted_at) * 1000)),
            "x-inference-time": str(round(inference * 1000)),
            "x-time-per-token": str(round(inference * 1000 / tokens)),
            "x-prompt-tokens": str(len(h.prompt_ids)),
            "x-generated-tokens": str(self.num_tokens),
            **({"x-weights-version": self.weights_version} if self.weights_version else {}),
        }


async def collect_all(streams: list[RequestStream], request) -> list[list[TokenOutput]]:
    """Every stream's events (a request's choices, or best_of sequences); a client that disconnects first cancels them all."""
    collected: list[list[TokenOutput]] = [[] for _ in streams]

    async def consume(i: int) -> None:
        async for event in streams[i].events():
            collected[i].append(event)

    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    consumers = [asyncio.ensure_future(consume(i)) for i in range(len(streams))]
    watcher = asyncio.ensure_future(watch_disconnect())
    try:
        done = asyncio.ensure_future(asyncio.gather(*consumers))
        await asyncio.wait({done, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise asyncio.CancelledError("client disconnected")
        done.result()  # re-raise a generation error
    finally:
        watcher.cancel()
        for consumer in consumers:
            if not consumer.done():
                consumer.cancel()  # its events() finally cancels the sequence
    return collected


def check_sendable(params: SamplingParams) -> None:
    """Every value of a request's settings must cross the control channel (msgpack: integers of
    at most 64 bits): one that cannot is this request's 4xx here, where in a plan it would stop
    the group."""
    from server.engine.plan_wire import to_wire
    from shard_engine.wire import WireError, encode

    try:
        encode(to_wire(params))
    except (WireError, OverflowError, ValueError) as e:
        raise InputValidationError(f"a sampling parameter is out of range: {e}") from e


def cache_root(salt: str | None) -> bytes:
    """The prefix-cache key a request's block chain starts from: its ``cache_salt``'s digest, so
    that only requests with the same salt share cached blocks (and can time each other's hits)."""
    if not salt:
        return b""
    import hashlib

    return hashlib.blake2b(b"cache_salt:" + salt.encode(), digest_size=16).digest()


def open_streams(state: ServerState, prompts: list[list[int]], params: SamplingParams, copies: int,
                 stop: list[str], cache_salt: str | None = None, images: list | None = None) -> list[RequestStream]:
    """``copies`` streams per prompt (OpenAI's ``n``, TGI's ``best_of``), stream ``i * copies + j``;
    where seeded, copy j samples with seed + j, so that copies differ and each replays. All or none
    are submitted (a 429 part way cancels those already in). ``images``: the one prompt's
    (``server.api.media.ImagePrompts.prompt``); a prompt without images may hold no image token."""
    from dataclasses import replace

    check_sendable(params)
    if state.images is not None and not images:
        for ids in prompts:
            state.images.check_text_only(ids, "inputs")
    streams: list[RequestStream] = []
    try:
        for ids in prompts:
            for j in range(copies):
                seeded = params if j == 0 or params.seed is None else replace(params, seed=params.seed + j)
                streams.append(RequestStream(state, ids, seeded, stop, cache_salt, images))
    except BaseException:
        for stream in streams:
            state.scheduler.cancel(stream.handle)
        raise
    return streams
