"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Each route checks nothing itself: it hands the validated body to its serving class
(``completions``, ``chat_completions``), which opens the request's streams, and answers streamed
or whole (``serving.stream_or_collect``). Responses are the pydantic models of ``protocol``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request, Response

from server.api.openai.chat_completions import ChatCompletionServing
from server.api.openai.completions import CompletionServing
from server.api.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, \
    CompletionResponse, ModelCard, ModelList
from server.api.openai.serving import stream_or_collect
from server.http.state import ServerState, server_state

router = APIRouter(prefix="/v1")
_STARTED = int(time.time())


@router.get("/models")
async def models(state: ServerState = Depends(server_state)) -> ModelList:
    return ModelList(data=[ModelCard(id=name, created=_STARTED) for name in state.model_names])


@router.post("/completions", response_model=CompletionResponse)
async def completions(req: CompletionRequest, request: Request, response: Response,
                      state: ServerState = Depends(server_state)):
    return await stream_or_collect(await CompletionServing.start(state, req), req, request, response)


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(req: ChatCompletionRequest, request: Request, response: Response,
                           state: ServerState = Depends(server_state)):
    return await stream_or_collect(await ChatCompletionServing.start(state, req), req, request, response)
