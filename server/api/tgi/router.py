"""text-generation-inference routes: ``/generate``, ``/generate_stream`` and the compat ``/``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.errors import GenerationError, error_body
from server.generation import RequestStream, check_admission, compile_grammar
from server.api.tgi.protocol import (
    CompatGenerateRequest,
    Details,
    GenerateRequest,
    GenerateResponse,
    StreamDetails,
    StreamResponse,
    Token,
)
from server.engine.sampling import SamplingParams
from server.engine.scheduler import TokenEvent
from server.state import ServerState


def _token(event: TokenEvent) -> Token:
    return Token(id=event.id, text=event.token_text, logprob=event.logprob, special=event.special)


def _top_tokens(state: ServerState, event: TokenEvent) -> list[Token]:
    """``top_n_tokens``: the step's most likely tokens, each with its own text."""
    special = state.special_ids or frozenset()
    return [Token(id=t, text=state.tokenizer.decode([t]), logprob=lp, special=t in special) for t, lp in event.top]


def _start(state: ServerState, body: GenerateRequest) -> tuple[RequestStream, float]:
    start = time.monotonic()
    p = body.parameters
    prompt_ids = state.tokenizer(body.inputs).input_ids
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate:]  # TGI's truncate: the input's last tokens
    check_admission(state, prompt_ids, p.max_new_tokens)
    grammar = None
    if p.grammar is not None:  # TGI's {"type": "json" | "regex", "value": ...}
        kind = {"json": "json_schema", "json_object": "json_object", "regex": "regex"}[p.grammar["type"]]
        grammar = compile_grammar(state, kind, p.grammar.get("value"), "grammar")
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens, do_sample=p.do_sample, temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or None, seed=p.seed, top_logprobs=p.top_n_tokens or 0,
        grammar=grammar,
    )
    return RequestStream(state, prompt_ids, params, p.stop), time.monotonic() - start


def _full_text(body: GenerateRequest, text: str) -> str:
    return body.inputs + text if body.parameters.return_full_text else text


def build_tgi_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        stream, validation_s = _start(state, body)
        tokens: list[Token] = []
        top_tokens: list[list[Token]] = []
        for event in await stream.collect(request):
            tokens.append(_token(event))
            top_tokens.append(_top_tokens(state, event))
            if event.finish is not None:
                details = None
                if body.parameters.details:
                    details = Details(finish_reason=event.finish, generated_tokens=stream.num_tokens,
                                      seed=stream.seed, tokens=tokens,
                                      top_tokens=top_tokens if body.parameters.top_n_tokens else None)
                response = GenerateResponse(generated_text=_full_text(body, stream.text), details=details)
                return JSONResponse(response.model_dump(), headers=stream.timing_headers(validation_s))
        raise GenerationError("generation ended without a result")

    async def generate_stream(body: GenerateRequest) -> StreamingResponse:
        stream, _ = _start(state, body)

        async def sse() -> AsyncIterator[str]:
            index = 0
            try:
                async for event in stream.events():
                    index += 1
                    text = details = None
                    if event.finish is not None:
                        # The last event also carries the whole text and the details.
                        text = _full_text(body, stream.text)
                        details = StreamDetails(finish_reason=event.finish, generated_tokens=stream.num_tokens,
                                                seed=stream.seed)
                    top = _top_tokens(state, event) if body.parameters.top_n_tokens else None
                    event_out = StreamResponse(index=index, token=_token(event), top_tokens=top, generated_text=text,
                                               details=details)
                    yield f"data: {event_out.model_dump_json()}\n\n"
            except GenerationError as e:
                yield f"data: {json.dumps(error_body(e, '/generate_stream'))}\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    router.add_api_route("/generate", generate, methods=["POST"], response_model=GenerateResponse)
    router.add_api_route("/generate_stream", generate_stream, methods=["POST"])

    @router.post("/")
    async def compat_generate(body: CompatGenerateRequest, request: Request):
        """TGI's compat route: ``/generate``, answered as a list of one response as TGI answers it
        (its ``text-generation`` client reads ``[0]``), or with ``"stream": true`` ``/generate_stream``."""
        plain = GenerateRequest(inputs=body.inputs, parameters=body.parameters)
        if body.stream:
            return await generate_stream(plain)
        response = await generate(plain, request)
        return JSONResponse([json.loads(response.body)], headers={
            k: v for k, v in response.headers.items() if k.lower().startswith("x-")})

    return router
