"""``POST /tokenize`` in TGI's shape and vLLM's, and vLLM's ``POST /detokenize``.

One path serves both tokenize shapes, told apart by the body: TGI's ``{"inputs": text}`` answers a
list of ``{id, text, start, stop}`` (the token's characters in the input); vLLM's
``{"prompt": text}`` or ``{"messages": [...]}`` (rendered with the chat template, as a chat
request would be) answers ``{count, max_model_len, tokens}``. Bad bodies get each API's error.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from server.http.errors import InputValidationError
from server.api.generation import check_token_ids, off_loop, require_ready
from server.http.state import ServerState, server_state


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` as TGI takes it (``inputs``) or as vLLM does (``prompt``, or ``messages``
    with the chat template)."""

    model_config = ConfigDict(extra="forbid")

    inputs: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # vLLM's: rendered with the messages, as a chat request's are
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    model: str | None = None


class TokenSpan(BaseModel):
    """TGI's ``/tokenize`` answer, one per token: its id, its text and where it lies in the input."""

    id: int
    text: str
    start: int
    stop: int


class VLLMTokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


router = APIRouter()


def _tokenizer(state: ServerState):
    require_ready(state)
    return state.tokenizer


def _bounded(state: ServerState, ids, param: str):
    limit = state.limits.max_tokenize_tokens
    if len(ids) > limit:
        raise InputValidationError(f"{param}: the text is {len(ids)} tokens; a /tokenize answer carries at most "
                                   f"{limit} (--max-tokenize-tokens)", param=param)
    return ids


def _spans(state: ServerState, text: str) -> list[TokenSpan]:
    """TGI's answer, built on a worker thread: a long text's spans take a while."""
    encoded = state.tokenizer(text, return_offsets_mapping=True)
    _bounded(state, encoded.input_ids, "inputs")
    return [TokenSpan(id=i, text=text[a:b], start=a, stop=b)
            for i, (a, b) in zip(encoded.input_ids, encoded.offset_mapping)]


@router.post("/tokenize", response_model=list[TokenSpan] | VLLMTokenizeResponse)
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)):
    given = [name for name in ("inputs", "prompt", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InputValidationError("give exactly one of inputs (TGI), prompt or messages (vLLM)", param="inputs")
    tok = _tokenizer(state)
    if body.inputs is not None:
        return await off_loop(_spans, state, body.inputs)
    if body.prompt is not None:
        ids = (await off_loop(tok, body.prompt, add_special_tokens=body.add_special_tokens)).input_ids
        ids = _bounded(state, ids, "prompt")
    else:
        from server.api.openai.chat_completions import chat_renderer
        from server.api.openai.protocol import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.model_validate({"messages": body.messages, "tools": body.tools})
        except ValueError as e:
            raise InputValidationError(f"messages: {e}", param="messages") from e
        ids = _bounded(state, await off_loop(chat_renderer(state).prompt_ids, request,
                                             add_generation_prompt=body.add_generation_prompt), "messages")
    limit = state.limits.max_total_tokens if state.limits else None
    return VLLMTokenizeResponse(count=len(ids), max_model_len=limit or 0, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)):
    check_token_ids(body.tokens, len(_tokenizer(state)), "tokens")
    return DetokenizeResponse(prompt=await off_loop(state.tokenizer.decode, body.tokens))
