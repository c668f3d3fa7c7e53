"""text-generation-inference routes: ``/generate``, ``/generate_stream`` and the compat ``/``.

TGI's semantics: the generated text keeps its stop sequence (``finish_reason`` ``stop_sequence``);
``best_of`` sequences answer with the likeliest (the sum of its tokens' log-probabilities), the
others in ``details.best_of_sequences``; ``details`` carries each token with its text, its
log-probability and whether it is special, ``top_n_tokens`` its likeliest alternatives,
``decoder_input_details`` the prompt's tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.api.generation import RequestStream, check_admission, check_request_bounds, collect_all, compile_grammar, \
    off_loop, open_streams, require_ready, tokenize
from server.api.media import IMAGE_MARKDOWN, read_images
from server.api.outputs import Alternative, OutputProcessor, TokenOutput
from server.http.errors import GenerationError, InputValidationError
from server.http.responses import FiniteJSONResponse, sse, sse_error
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
from server.http.state import ServerState, server_state

router = APIRouter()


def _token(a: Alternative) -> Token:
    return Token(id=a.token_id, text=a.text, logprob=a.logprob, special=a.special)


def _tokens(output: OutputProcessor, out: TokenOutput) -> Token:
    return _token(output.token(out.event.token_id, out.event.logprob))


def _top_tokens(output: OutputProcessor, out: TokenOutput) -> list[Token]:
    """``top_n_tokens``: the step's most likely tokens, each with its own text."""
    return [_token(a) for a in output.alternatives(out.event.top)]


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
    images = None
    if state.images is not None and IMAGE_MARKDOWN.search(body.inputs):  # TGI's ![](url): an image-text model's
        if p.truncate is not None:
            raise InputValidationError("truncate cannot cut a prompt with images", param="truncate")
        urls = IMAGE_MARKDOWN.findall(body.inputs)
        pictures = await read_images(urls, state.media)
        text = IMAGE_MARKDOWN.sub(lambda _: state.images.markdown_image, body.inputs)
        prompt_ids, images = await off_loop(state.images.prompt, text, pictures, special_tokens=True)
    else:
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
    return open_streams(state, [prompt_ids], params, best_of, p.stop, images=images), prompt_ids, \
        time.monotonic() - start


def _prefill(output: OutputProcessor, prompt_ids: list[int], first: TokenOutput) -> list[InputToken]:
    """``decoder_input_details``: the prompt's tokens, each but the first with its log-probability."""
    return [InputToken(id=a.token_id, text=a.text, logprob=a.logprob)
            for a, _ in output.prompt_tokens(prompt_ids, first.event)]


def _full_text(body: GenerateRequest, text: str) -> str:
    return body.inputs + text if body.parameters.return_full_text else text


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request, state: ServerState = Depends(server_state)) -> JSONResponse:
    streams, prompt_ids, validation_s = await _start(state, body)
    p = body.parameters
    collected = await collect_all(streams, request)
    if any(not outputs or not outputs[-1].last for outputs in collected):
        raise GenerationError("generation ended without a result")
    answers = [_sequence(body, stream, outputs, prompt_ids) for stream, outputs in zip(streams, collected)]
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


def _sequence(body: GenerateRequest, stream: RequestStream, outputs: list[TokenOutput], prompt_ids) -> BestOfSequence:
    p, output = body.parameters, stream.output
    return BestOfSequence(
        generated_text=_full_text(body, stream.text), finish_reason=outputs[-1].finish,
        generated_tokens=stream.num_tokens, seed=stream.seed, weights_version=stream.weights_version,
        prefill=_prefill(output, prompt_ids, outputs[0]) if p.decoder_input_details else [],
        tokens=[_tokens(output, o) for o in outputs],
        top_tokens=[_top_tokens(output, o) for o in outputs] if p.top_n_tokens else None)


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, state: ServerState = Depends(server_state)) -> StreamingResponse:
    p = body.parameters
    if p.decoder_input_details:
        raise InputValidationError("decoder_input_details == true is not supported when streaming tokens",
                                   param="decoder_input_details")
    if (p.best_of or 1) > 1:
        raise InputValidationError("best_of > 1 is not supported when streaming tokens", param="best_of")
    (stream,), _, _ = await _start(state, body)

    async def frames() -> AsyncIterator[str]:
        index = 0
        try:
            async for out in stream.events():
                index += 1
                text = details = None
                if out.last:  # the last frame also carries the whole text and the details
                    text = _full_text(body, stream.text)
                    details = StreamDetails(finish_reason=out.finish, generated_tokens=stream.num_tokens,
                                            seed=stream.seed, weights_version=stream.weights_version)
                top = _top_tokens(stream.output, out) if p.top_n_tokens else None
                yield sse(StreamResponse(index=index, token=_tokens(stream.output, out), top_tokens=top,
                                         generated_text=text, details=details))
        except GenerationError as e:
            yield sse_error(e, "/generate_stream")

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/")
async def compat_generate(body: CompatGenerateRequest, request: Request, state: ServerState = Depends(server_state)):
    """TGI's compat route: ``/generate``, answered as a list of one response as TGI answers it
    (its ``text-generation`` client reads ``[0]``), or with ``"stream": true`` ``/generate_stream``."""
    plain = GenerateRequest(inputs=body.inputs, parameters=body.parameters)
    if body.stream:
        return await generate_stream(plain, state)
    response = await generate(plain, request, state)
    return FiniteJSONResponse([json.loads(response.body)], headers={
        k: v for k, v in response.headers.items() if k.lower().startswith("x-")})
