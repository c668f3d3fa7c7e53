"""What the OpenAI routes share: sampling settings from a request, model names, the choices' merged
outputs, and answering streamed or whole.

Semantics follow OpenAI's: ``temperature`` defaults to 1 (sampling) and 0 means greedy; the text
returned stops before a stop sequence. As in vLLM, sampling settings a request leaves unset
(``temperature``, ``top_p`` and the extra ``top_k``, ``min_p``, ``repetition_penalty``) take the
checkpoint's generation_config.json values first. A request's ``model`` must be a served name (or
absent): else 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from server.api.generation import RequestStream, check_token_ids, collect_all, compile_grammar
from server.api.openai.protocol import Usage
from server.api.outputs import TokenOutput
from server.engine.sampling import SamplingParams
from server.http.errors import GenerationError, InputValidationError, ModelNotFoundError
from server.http.responses import SSE_DONE, sse_error
from server.http.state import ServerState


async def _grammar(state: ServerState, req, tool_grammar: str | None) -> str | None:
    try:
        asked = req.structured_output()
    except ValueError as e:
        raise InputValidationError(str(e), param="response_format") from e
    if asked and tool_grammar is not None:
        raise InputValidationError(f"{asked[2]} and tool_choice required or named both constrain the output: "
                                   f"give one", param=asked[2])
    return await compile_grammar(state, *asked) if asked else tool_grammar


async def sampling_params(state: ServerState, req, max_new_tokens: int, top_logprobs: int,
                          tool_grammar: str | None = None) -> SamplingParams:
    """The request's sampling settings; those it leaves unset come from the checkpoint's generation
    config (``state.sampling_defaults``), then OpenAI's (temperature 1, nothing else). Token ids
    (``logit_bias``, ``stop_token_ids``) must lie in the vocabulary; structured output (or the
    ``tool_grammar`` of ``tool_choice`` required or named) becomes a grammar, compiled off the
    event loop."""
    vocab = state.vocab_size
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
        top_k=None if greedy or not top_k or top_k < 1 else min(top_k, state.vocab_size),  # more: all of them
        min_p=None if greedy or not min_p else min_p,
        repetition_penalty=None if penalty is None or penalty == 1.0 else penalty,
        seed=req.seed,
        top_logprobs=top_logprobs,
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        grammar=await _grammar(state, req, tool_grammar),
    )


def check_model(state: ServerState, model: str | None) -> None:
    """A request naming a model this server does not serve is answered 404, as OpenAI does."""
    if model is not None and model not in state.model_names:
        raise ModelNotFoundError(f"The model `{model}` does not exist. Served: {', '.join(state.model_names)}",
                                 param="model")


def finish_reason(out: TokenOutput) -> str:
    return "length" if out.finish == "length" else "stop"


def include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def usage(streams: list[RequestStream], n: int) -> Usage:
    """Prompt tokens once per prompt (its ``n`` choices share it), completion tokens of every choice."""
    prompt = sum(len(s.handle.prompt_ids) for s in streams[::n])
    completion = sum(s.num_tokens for s in streams)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenOutput]]:
    """(choice index, output) of every stream as they come; stopping early cancels the rest. One
    stream (``n`` = 1, the common case) is read directly, without a queue and a task."""
    if len(streams) == 1:
        async for out in streams[0].events():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int) -> None:
        try:
            async for out in streams[i].events():
                await queue.put((i, out))
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


async def stream_or_collect(serving, req, request: Request, response: Response | None = None):
    """A streamed request: the SSE frames of ``serving.chunks()`` (an engine error becomes the error
    frame), ``[DONE]`` last. Else ``serving.respond(outputs per choice)``, with the
    ``x-weights-version`` header (the weights that computed its first choice's last token) on
    ``response``."""
    if not req.stream:
        answer = serving.respond(await collect_all(serving.streams, request))
        if response is not None and serving.streams[0].weights_version:
            response.headers["x-weights-version"] = serving.streams[0].weights_version
        return answer
    path = request.url.path

    async def frames() -> AsyncIterator[str]:
        try:
            async for frame in serving.chunks():
                yield frame
        except GenerationError as e:
            yield sse_error(e, path)
        yield SSE_DONE

    return StreamingResponse(frames(), media_type="text/event-stream")
