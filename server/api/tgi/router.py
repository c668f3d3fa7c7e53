"""text-generation-inference routes: ``/generate``, ``/generate_stream`` and the compat ``/``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.http.errors import GenerationError, InputValidationError, error_body
from server.http.responses import FiniteJSONResponse
from server.api.generation import (RequestStream, check_admission, check_request_bounds, collect_all, compile_grammar,
                               open_streams, require_ready, tokenize)
from server.api.tgi.protocol import (
    BestOfSequence,
    CompatGenerateRequest,
    Details,
    InputToken,
    GenerateRequest,
    GenerateResponse,
    StreamDetails,
    StreamResponse,
    Token,
)
from server.engine.sampling import SamplingParams
from server.engine.scheduler import TokenEvent
from server.http.state import ServerState


def _token(event: TokenEvent) -> Token:
    return Token(id=event.id, text=event.token_text, logprob=event.logprob, special=event.special)


def _top_tokens(state: ServerState, event: TokenEvent) -> list[Token]:
    """``top_n_tokens``: the step's most likely tokens, each with its own text."""
    special = state.special_ids or frozenset()
    return [Token(id=t, text=state.tokenizer.decode([t]), logprob=lp, special=t in special) for t, lp in event.top]


async def _start(state: ServerState, body: GenerateRequest) -> tuple[list[RequestStream], list[int], float]:
    """The request's streams (``best_of`` of them, seeds seed + j where a seed is given), its
    prompt ids, and the validation time."""
    start = time.monotonic()
    p = body.parameters
    best_of = p.best_of or 1
    if best_of > 1 and not p.samples:
        raise InputValidationError("you must use sampling when best_of is > 1", param="best_of")
    require_ready(state)
    check_request_bounds(state, sequences=best_of, sequences_param="best_of", stops=p.stop,
                         top_logprobs=p.top_n_tokens or 0, top_param="top_n_tokens")
    prompt_ids = await tokenize(state, body.inputs)
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate:]  # TGI's truncate: the input's last tokens
    check_admission(state, prompt_ids, p.max_new_tokens)
    grammar = None
    if p.grammar is not None:  # TGI's {"type": "json" | "regex", "value": ...}
        kind = {"json": "json_schema", "json_object": "json_object", "regex": "regex"}[p.grammar["type"]]
        grammar = await compile_grammar(state, kind, p.grammar.get("value"), "grammar")  # off the event loop
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens, do_sample=p.do_sample or best_of > 1, temperature=p.temperature,
        top_k=min(p.top_k, state.vocab_size) if p.top_k else None,  # more: all of them
        top_p=p.top_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or None, seed=p.seed, top_logprobs=p.top_n_tokens or 0,
        grammar=grammar, prompt_logprobs=0 if p.decoder_input_details else None,
    )
    return open_streams(state, [prompt_ids], params, best_of, p.stop), prompt_ids, time.monotonic() - start


def _prefill(state: ServerState, prompt_ids: list[int], event: TokenEvent) -> list[InputToken]:
    """``decoder_input_details``: the prompt's tokens, each but the first with its log-probability."""
    scores = [None] + [lp for lp, _ in event.prompt_logprobs or ()]
    return [InputToken(id=t, text=state.tokenizer.decode([t]), logprob=lp) for t, lp in zip(prompt_ids, scores)]


def _full_text(body: GenerateRequest, text: str) -> str:
    return body.inputs + text if body.parameters.return_full_text else text


def build_tgi_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        streams, prompt_ids, validation_s = await _start(state, body)
        p = body.parameters
        collected = await collect_all(streams, request)
        if any(not events or events[-1].finish is None for events in collected):
            raise GenerationError("generation ended without a result")
        answers = []
        for stream, events in zip(streams, collected):
            answers.append(BestOfSequence(
                generated_text=_full_text(body, stream.text), finish_reason=events[-1].finish,
                generated_tokens=stream.num_tokens, seed=stream.seed,
                prefill=_prefill(state, prompt_ids, events[0]) if p.decoder_input_details else [],
                tokens=[_token(e) for e in events],
                top_tokens=[_top_tokens(state, e) for e in events] if p.top_n_tokens else None))
        # best_of: the likeliest sequence answers (the sum of its tokens' log-probabilities), the others follow
        order = sorted(range(len(answers)), key=lambda i: -sum(t.logprob for t in answers[i].tokens))
        best = answers[order[0]]
        details = None
        if p.details:
            details = Details(**best.model_dump(exclude={"generated_text"}),
                              best_of_sequences=[answers[i] for i in order[1:]] if len(answers) > 1 else None)
        response = GenerateResponse(generated_text=best.generated_text, details=details)
        # a NaN or infinite log-probability is null, as in every streamed frame
        return FiniteJSONResponse(response.model_dump(), headers=streams[order[0]].timing_headers(validation_s))

    async def generate_stream(body: GenerateRequest) -> StreamingResponse:
        p = body.parameters
        if p.decoder_input_details:
            raise InputValidationError("decoder_input_details == true is not supported when streaming tokens",
                                       param="decoder_input_details")
        if (p.best_of or 1) > 1:
            raise InputValidationError("best_of > 1 is not supported when streaming tokens", param="best_of")
        (stream,), _, _ = await _start(state, body)

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
        return FiniteJSONResponse([json.loads(response.body)], headers={
            k: v for k, v in response.headers.items() if k.lower().startswith("x-")})

    return router
