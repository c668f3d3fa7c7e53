"""``POST /tokenize`` in TGI's shape and vLLM's, and vLLM's ``POST /detokenize``.

One path serves both tokenize shapes, told apart by the body: TGI's ``{"inputs": text}`` answers a
list of ``{id, text, start, stop}`` (the token's characters in the input); vLLM's
``{"prompt": text}`` or ``{"messages": [...]}`` (rendered with the chat template, as a chat
request would be) answers ``{count, max_model_len, tokens}``. Bad bodies get each API's error.
"""

from __future__ import annotations

from fastapi import APIRouter

from server.errors import InputValidationError, UnavailableError
from server.generation import check_token_ids
from server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenSpan,
    VLLMTokenizeResponse,
)
from server.state import ServerState


def build_tokenize_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    def tokenizer():
        if state.tokenizer is None:
            raise UnavailableError("the model is still loading")
        return state.tokenizer

    @router.post("/tokenize", response_model=list[TokenSpan] | VLLMTokenizeResponse)
    async def tokenize(body: TokenizeRequest):
        given = [name for name in ("inputs", "prompt", "messages") if getattr(body, name) is not None]
        if len(given) != 1:
            raise InputValidationError("give exactly one of inputs (TGI), prompt or messages (vLLM)", param="inputs")
        tok = tokenizer()
        if body.inputs is not None:
            encoded = tok(body.inputs, return_offsets_mapping=True)
            return [TokenSpan(id=i, text=body.inputs[a:b], start=a, stop=b)
                    for i, (a, b) in zip(encoded.input_ids, encoded.offset_mapping)]
        if body.prompt is not None:
            ids = tok(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        else:
            from server.openai_api import chat_prompt_ids
            from server.openai_protocol import ChatCompletionRequest

            try:
                request = ChatCompletionRequest.model_validate({"messages": body.messages})
            except ValueError as e:
                raise InputValidationError(f"messages: {e}", param="messages") from e
            ids = chat_prompt_ids(state, request, add_generation_prompt=body.add_generation_prompt)
        limit = state.limits.max_total_tokens if state.limits else None
        return VLLMTokenizeResponse(count=len(ids), max_model_len=limit or 0, tokens=ids)

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest):
        check_token_ids(body.tokens, len(tokenizer()), "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

    return router
