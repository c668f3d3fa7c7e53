"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Responses are the pydantic models of ``protocol``; ``finish_reason`` is ``stop``, ``length`` or,
for a chat answer whose calls were asked for (``tool_choice`` auto or required), ``tool_calls``
(a named function ends with ``stop``, as OpenAI's does). Tool calls are read from the model's text
by the format of ``--tool-call-parser`` (``tools``), in the whole answer and in the stream alike.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server.api.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from server.api.openai.serving import (
    TextDeltas,
    check_model,
    cut_at_stop,
    finish_reason,
    merged,
    sampling_params,
    usage,
)
from server.api.openai.tools import StreamingToolParser
from server.engine.scheduler import TokenEvent
from server.http.errors import GenerationError, InputValidationError, UnavailableError, error_body
from server.api.generation import (RequestStream, check_admission, check_request_bounds, check_token_ids, collect_all,
                               off_loop, open_streams, require_ready, tokenize)
from server.http.state import ServerState


def chat_renderer(state: ServerState):
    if state.chat is None:
        raise UnavailableError(f"not ready: {state.phase}")
    return state.chat


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def build_openai_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = int(time.time())

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=created) for name in state.model_names])

    async def stream_or_collect(streams: list[RequestStream], req, request: Request, chunks, respond):
        """A streamed request: the SSE frames ``chunks`` makes of the merged events (an engine error
        becomes an error frame), ``[DONE]`` last. Else ``respond(events per choice)``."""
        path = request.url.path
        if not req.stream:
            return respond(await collect_all(streams, request))

        async def frames() -> AsyncIterator[str]:
            try:
                async for frame in chunks():
                    yield frame
            except GenerationError as e:
                import json

                yield f"data: {json.dumps(error_body(e, path))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    def include_usage(req) -> bool:
        return req.stream_options is not None and req.stream_options.include_usage

    @router.post("/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest, request: Request):
        check_model(state, req.model)
        require_ready(state)
        check_request_bounds(state, sequences=len(req.prompts) * req.n, sequences_param="n", stops=req.stop_list,
                             top_logprobs=req.logprobs or 0, top_param="logprobs")
        prompts = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                prompts.append(await tokenize(state, prompt))
            else:
                check_token_ids(prompt, state.vocab_size, "prompt")
                prompts.append(list(prompt))
        max_new = min(check_admission(state, ids, req.max_tokens or 16) for ids in prompts)
        scored = req.echo and req.logprobs is not None  # echo + logprobs: the prompt's too, as harnesses ask
        params = await sampling_params(state, req, max_new, req.logprobs or 0)
        if scored:
            params = replace(params, prompt_logprobs=req.logprobs)
        streams = open_streams(state, prompts, params, req.n, req.stop_list, req.cache_salt)
        texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in req.prompts]
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        decode = state.tokenizer.decode
        offsets = [0] * len(streams)  # text_offset: characters of each choice's text so far

        def logprobs_of(i: int, events: list[TokenEvent], echoed: bool = False) -> CompletionLogprobs | None:
            """Choice ``i``'s logprobs of ``events``' tokens, or with ``echoed`` of its prompt's
            tokens (the first has none; the others from the first event, where they were asked for)."""
            if req.logprobs is None:
                return None
            if echoed:
                ids = prompts[i // req.n]
                scores = (events[0].prompt_logprobs if scored and events else None) or [(None, None)] * (len(ids) - 1)
                tokens = [decode([t]) for t in ids]
                chosen = [None] + [lp for lp, _ in scores]
                tops = [None] + [None if top is None else {decode([t]): v for t, v in top} for _, top in scores]
            else:
                tokens = [e.token_text for e in events]
                chosen = [e.logprob for e in events]
                tops = [{decode([t]): lp for t, lp in e.top} for e in events]
            text_offset = []
            for token in tokens:
                text_offset.append(offsets[i])
                offsets[i] += len(token)
            return CompletionLogprobs(tokens=tokens, token_logprobs=chosen, top_logprobs=tops,
                                      text_offset=text_offset)

        def joined(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
            if a is None or b is None:
                return a or b
            return CompletionLogprobs(**{k: getattr(a, k) + getattr(b, k) for k in CompletionLogprobs.model_fields})

        def response(choices, usage_=None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=now, model=state.model_name, choices=choices, usage=usage_)

        async def chunks() -> AsyncIterator[str]:
            deltas = [TextDeltas(req.stop_list) for _ in streams]
            started = [False] * len(streams)
            async for i, event in merged(streams):
                if req.echo and not started[i]:  # the prompt first, with its scores where asked
                    started[i] = True
                    yield _sse(response([CompletionChoice(index=i, text=texts[i // req.n],
                                                          logprobs=logprobs_of(i, [event], echoed=True))]))
                finish = finish_reason(event) if event.finish is not None else None
                text = deltas[i].next(event)
                if text or finish:
                    yield _sse(response([CompletionChoice(index=i, text=text, finish_reason=finish,
                                                          logprobs=logprobs_of(i, [event]))]))
            if include_usage(req):
                yield _sse(response([], usage(streams, req.n)))

        def respond(events: list[list[TokenEvent]]) -> CompletionResponse:
            choices = []
            for i, stream in enumerate(streams):
                text = cut_at_stop(stream.text, req.stop_list)
                choices.append(CompletionChoice(
                    index=i, text=texts[i // req.n] + text if req.echo else text,
                    finish_reason=finish_reason(events[i][-1]),
                    logprobs=joined(logprobs_of(i, events[i], echoed=True) if req.echo else None,
                                    logprobs_of(i, events[i]))))
            return response(choices, usage(streams, req.n))

        return await stream_or_collect(streams, req, request, chunks, respond)

    @router.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(state, req.model)
        try:
            req.check_tool_choice()
        except ValueError as e:
            raise InputValidationError(str(e), param="tool_choice") from e
        renderer = chat_renderer(state)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        check_request_bounds(state, sequences=req.n, sequences_param="n", stops=req.stop_list, top_logprobs=top,
                             top_param="top_logprobs")
        prompt_ids = await off_loop(renderer.prompt_ids, req)  # a template over long messages: milliseconds
        max_new = check_admission(state, prompt_ids, req.max_completion_tokens or req.max_tokens)
        kind, offered = req.tool_choice_kind, req.offered_tools()
        tool_grammar = None
        if kind in ("required", "named"):
            tool_grammar = await _tool_grammar(state, renderer, offered,
                                               several=kind == "required" and req.parallel_tool_calls)
        params = await sampling_params(state, req, max_new, top, tool_grammar)
        streams = open_streams(state, [prompt_ids], params, req.n, req.stop_list, req.cache_salt)
        declared = {t.function.name for t in offered}
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def finish_of(event: TokenEvent, called: bool) -> str:
            reason = finish_reason(event)
            return "tool_calls" if called and reason == "stop" and kind != "named" else reason

        def logprobs_of(events: list[TokenEvent]) -> ChatLogprobs | None:
            if not req.logprobs:
                return None
            decode = state.tokenizer.decode
            return ChatLogprobs(content=[
                TokenLogprob(token=e.token_text, logprob=e.logprob, bytes=list(e.token_text.encode()),
                             top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                           for t, lp in ((decode([i]), lp) for i, lp in e.top)])
                for e in events
            ])

        def chunk(i: int, delta: DeltaMessage, finish=None, logprobs=None) -> str:
            return _sse(ChatCompletionChunk(id=rid, created=now, model=state.model_name, choices=[
                ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)]))

        async def chunks() -> AsyncIterator[str]:
            deltas = [TextDeltas(req.stop_list) for _ in streams]
            parsers = [StreamingToolParser(renderer.format, declared) if declared else None for _ in streams]
            for i in range(len(streams)):
                yield chunk(i, DeltaMessage(role="assistant", content=""))
            async for i, event in merged(streams):
                text, last = deltas[i].next(event), event.finish is not None
                logprobs = logprobs_of([event])
                if parsers[i] is None:
                    if text or last or logprobs:
                        yield chunk(i, DeltaMessage(content=text or None), finish_of(event, False) if last else None,
                                    logprobs)
                    continue
                pieces = parsers[i].feed(text, final=last)
                for n, piece in enumerate(pieces):
                    if piece.content is not None:
                        delta = DeltaMessage(content=piece.content)
                    else:
                        delta = DeltaMessage(tool_calls=[DeltaToolCall(
                            index=piece.index, id=piece.id, type="function" if piece.id else None,
                            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))])
                    yield chunk(i, delta, logprobs=logprobs if n == 0 else None)
                if last or (logprobs and not pieces):
                    yield chunk(i, DeltaMessage(), finish_of(event, bool(parsers[i].calls)) if last else None,
                                None if pieces else logprobs)
            if include_usage(req):
                yield _sse(ChatCompletionChunk(id=rid, created=now, model=state.model_name, choices=[],
                                               usage=usage(streams, req.n)))

        def respond(events: list[list[TokenEvent]]) -> ChatCompletionResponse:
            choices = []
            for i, stream in enumerate(streams):
                text = cut_at_stop(stream.text, req.stop_list)
                content, calls = renderer.format.parse(text, declared) if declared else (text, [])
                message = ResponseMessage(content=content, tool_calls=[
                    ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
                ] or None)
                choices.append(ChatChoice(index=i, message=message, finish_reason=finish_of(events[i][-1], bool(calls)),
                                          logprobs=logprobs_of(events[i])))
            return ChatCompletionResponse(id=rid, created=now, model=state.model_name, choices=choices,
                                          usage=usage(streams, req.n))

        return await stream_or_collect(streams, req, request, chunks, respond)

    return router


async def _tool_grammar(state: ServerState, renderer, offered, several: bool) -> str:
    """The grammar that makes the answer calls of the offered tools, arguments valid against
    their schemas, built and checked off the event loop (128 tools of 50 properties take 0.4 s);
    a schema llguidance cannot take is a 400 naming ``tools``."""
    from server.engine.grammar import grammars_of
    from server.api.generation import run_grammar_work

    functions = [t.function.model_dump(exclude_none=True) for t in offered]

    def build() -> str:
        grammar = renderer.format.grammar(functions, several=several)
        grammars_of(state.tokenizer).check(grammar)
        return grammar

    try:
        return await run_grammar_work(build)
    except Exception as e:  # noqa: BLE001 - llguidance's errors carry the message
        raise InputValidationError(f"tools: a function's parameters cannot be enforced: {e}", param="tools") from e
