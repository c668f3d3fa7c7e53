"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Semantics follow OpenAI's: ``temperature`` defaults to 1 (sampling) and 0 means greedy; the
text returned stops before a stop sequence; ``finish_reason`` is ``stop`` or ``length``. As in
vLLM, sampling settings a request leaves unset (``temperature``, ``top_p`` and the extra
``top_k``, ``min_p``, ``repetition_penalty``) take the checkpoint's generation_config.json
values first. A request's ``model`` must be a served name (or absent): else 404
``model_not_found``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server.errors import GenerationError, InputValidationError, ModelNotFoundError, error_body
from server.generation import RequestStream, check_admission, check_token_ids, compile_grammar
from server.engine.sampling import SamplingParams
from server.engine.scheduler import TokenEvent
from server.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, Usage
from server.state import ServerState

# Used when the tokenizer has no chat template of its own (documented in the README).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _grammar(state: ServerState, req) -> str | None:
    try:
        asked = req.structured_output()
    except ValueError as e:
        raise InputValidationError(str(e), param="response_format") from e
    return compile_grammar(state, *asked) if asked else None


def _sampling(state: ServerState, req, max_new_tokens: int, top_logprobs: int) -> SamplingParams:
    """The request's sampling settings; those it leaves unset come from the checkpoint's generation
    config (``state.sampling_defaults``), then OpenAI's (temperature 1, nothing else). Token ids
    (``logit_bias``, ``stop_token_ids``) must lie in the vocabulary; structured output becomes a grammar."""
    vocab = len(state.tokenizer)
    check_token_ids([int(k) for k in req.logit_bias or {}], vocab, "logit_bias")
    check_token_ids(req.stop_token_ids or (), vocab, "stop_token_ids")

    def setting(name: str):
        value = getattr(req, name)
        return state.sampling_defaults.get(name) if value is None else value

    temperature = setting("temperature")
    temperature = 1.0 if temperature is None else temperature
    greedy = temperature == 0.0
    top_p, top_k, min_p = setting("top_p"), setting("top_k"), setting("min_p")
    penalty = setting("repetition_penalty")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy or top_p is None or top_p >= 1.0 else top_p,
        top_k=None if greedy or not top_k or top_k < 1 else top_k,
        min_p=None if greedy or not min_p else min_p,
        repetition_penalty=None if penalty is None or penalty == 1.0 else penalty,
        seed=req.seed,
        top_logprobs=top_logprobs,
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        grammar=_grammar(state, req),
    )


def check_model(state: ServerState, model: str | None) -> None:
    """A request naming a model this server does not serve is answered 404, as OpenAI does."""
    if model is not None and model not in state.model_names:
        raise ModelNotFoundError(f"The model `{model}` does not exist. Served: {', '.join(state.model_names)}",
                                 param="model")


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may still become a stop sequence."""
    keep = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), keep, -1):
            if stop.startswith(text[-n:]):
                keep = n
                break
    return keep


class _TextDeltas:
    """Streamed text never shows a stop sequence, nor the part of one that may still complete.
    Only what is held back is looked at again: the cost per token does not grow with the text."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def next(self, event: TokenEvent) -> str:
        held = self.held + event.text
        visible = _cut_at_stop(held, self.stops)
        if len(visible) < len(held):  # a stop sequence: nothing after it is shown
            self.held = ""
            return visible
        keep = 0 if event.finish is not None else _held_back(held, self.stops)
        self.held = held[len(held) - keep:] if keep else ""
        return held[: len(held) - keep]


def _finish_reason(event: TokenEvent) -> str:
    return "length" if event.finish == "length" else "stop"


def _usage(streams: list[RequestStream], n: int) -> dict:
    """Prompt tokens once per prompt (its ``n`` choices share it), completion tokens of every choice."""
    prompt = sum(len(s.handle.prompt_ids) for s in streams[::n])
    completion = sum(s.num_tokens for s in streams)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion).model_dump()


def _open_streams(state: ServerState, prompts: list[list[int]], params: SamplingParams, req) -> list[RequestStream]:
    """``req.n`` streams per prompt, choice ``i * n + j``; a seeded request's choice j samples with
    seed + j, so its choices differ and each replays. All or none are submitted."""
    streams: list[RequestStream] = []
    try:
        for ids in prompts:
            for j in range(req.n):
                choice_params = params if j == 0 or params.seed is None else replace(params, seed=params.seed + j)
                streams.append(RequestStream(state, ids, choice_params, req.stop_list))
    except BaseException:
        for stream in streams:
            state.scheduler.cancel(stream.handle)
        raise
    return streams


async def _collect_all(streams: list[RequestStream], request: Request) -> list[list[TokenEvent]]:
    """Every choice's events; a client that disconnects first cancels them all."""
    collected: list[list[TokenEvent]] = [[] for _ in streams]

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


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) of every stream as they come; stopping early cancels the rest."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int) -> None:
        try:
            async for event in streams[i].events():
                await queue.put((i, event))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
        await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> list[int]:
    """The chat request's messages rendered with the tokenizer's chat template (or the fallback), as ids."""
    tok = state.tokenizer
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=None if getattr(tok, "chat_template", None) else FALLBACK_CHAT_TEMPLATE,
        )
    except ValueError as e:
        raise InputValidationError(str(e), param="messages") from e
    return tok(text, add_special_tokens=False).input_ids


def build_openai_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = int(time.time())

    def frame(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def stream_chunks(streams: list[RequestStream], req, make_chunk, path: str) -> AsyncIterator[str]:
        deltas = [_TextDeltas(req.stop_list) for _ in streams]
        try:
            async for i, event in _merged(streams):
                finish = _finish_reason(event) if event.finish is not None else None
                text = deltas[i].next(event)
                if text or finish:
                    yield frame(make_chunk(i, text, event, finish))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield frame({**make_chunk(0, None, None, None), "choices": [], "usage": _usage(streams, req.n)})
        except GenerationError as e:
            yield frame(error_body(e, path))
        yield "data: [DONE]\n\n"

    async def respond(streams: list[RequestStream], req, request: Request, rid: str, now: int, obj: str,
                      chunk, make_choice):
        """The stream of chunks, or the whole response with ``make_choice(i, text, events)`` per choice."""
        path = request.url.path
        if req.stream:
            return StreamingResponse(stream_chunks(streams, req, chunk, path), media_type="text/event-stream")
        events = await _collect_all(streams, request)
        choices = [make_choice(i, _cut_at_stop(stream.text, req.stop_list), events[i])
                   for i, stream in enumerate(streams)]
        return {"id": rid, "object": obj, "created": now, "model": state.model_name,
                "choices": choices, "usage": _usage(streams, req.n)}

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=created) for name in state.model_names])

    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(state, req.model)
        prompts = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                prompts.append(state.tokenizer(prompt).input_ids)
            else:
                check_token_ids(prompt, len(state.tokenizer), "prompt")
                prompts.append(list(prompt))
        max_new = min(check_admission(state, ids, req.max_tokens or 16) for ids in prompts)
        params = _sampling(state, req, max_new, req.logprobs or 0)
        streams = _open_streams(state, prompts, params, req)
        texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in req.prompts]
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(events: list[TokenEvent]) -> dict | None:
            if req.logprobs is None:
                return None
            decode = state.tokenizer.decode
            return {
                "tokens": [e.token_text for e in events],
                "token_logprobs": [e.logprob for e in events],
                "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in events],
                "text_offset": [],
            }

        def chunk(i, text, event, finish) -> dict:
            choice = {"index": i, "text": text, "finish_reason": finish,
                      "logprobs": logprobs_of([event]) if event is not None else None}
            return {"id": rid, "object": "text_completion", "created": now, "model": state.model_name,
                    "choices": [choice]}

        def choice(i, text, events) -> dict:
            return {"index": i, "text": (texts[i // req.n] + text) if req.echo else text,
                    "finish_reason": _finish_reason(events[-1]), "logprobs": logprobs_of(events)}

        return await respond(streams, req, request, rid, now, "text_completion", chunk, choice)

    @router.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(state, req.model)
        prompt_ids = chat_prompt_ids(state, req)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        max_new = check_admission(state, prompt_ids, req.max_completion_tokens or req.max_tokens)
        params = _sampling(state, req, max_new, top)
        streams = _open_streams(state, [prompt_ids], params, req)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(events: list[TokenEvent]) -> dict | None:
            if not req.logprobs:
                return None
            decode = state.tokenizer.decode
            return {"content": [
                {"token": e.token_text, "logprob": e.logprob, "bytes": list(e.token_text.encode()),
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                  for t, lp in ((decode([i]), lp) for i, lp in e.top)]}
                for e in events
            ]}

        first = [True] * len(streams)

        def chunk(i, text, event, finish) -> dict:
            delta = {}
            if first[i] and event is not None:
                delta["role"] = "assistant"
                first[i] = False
            if text:
                delta["content"] = text
            choice = {"index": i, "delta": delta, "finish_reason": finish,
                      "logprobs": logprobs_of([event]) if event is not None else None}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": state.model_name,
                    "choices": [choice]}

        def choice(i, text, events) -> dict:
            return {"index": i, "message": {"role": "assistant", "content": text},
                    "finish_reason": _finish_reason(events[-1]), "logprobs": logprobs_of(events)}

        return await respond(streams, req, request, rid, now, "chat.completion", chunk, choice)

    return router
