"""``POST /v1/chat/completions``: one chat request's prompt, tools, choices and answer (``router``
routes it here).

The messages are rendered with the chat template (``chat``); tool calls are read from the model's
text by the format of ``--tool-call-parser`` (``tools``), in the whole answer and in the stream
alike. ``finish_reason`` is ``stop``, ``length`` or, for an answer whose calls were asked for
(``tool_choice`` auto or required), ``tool_calls`` (a named function ends with ``stop``, as
OpenAI's does). ``tool_choice`` required or named constrains the answer with a grammar of the
offered tools, built off the event loop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from server.api.generation import RequestStream, check_admission, check_request_bounds, checked_grammar, \
    off_loop, open_streams
from server.api.media import read_images
from server.api.openai.protocol import ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, \
    ChatCompletionResponse, ChatLogprobs, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, \
    ResponseMessage, TokenLogprob, ToolCall, TopLogprob
from server.api.openai.serving import check_model, finish_reason, include_usage, merged, sampling_params, usage
from server.api.openai.tools import StreamingToolParser
from server.api.outputs import OutputProcessor, TokenOutput
from server.http.errors import InputValidationError, UnavailableError
from server.http.responses import sse
from server.http.state import ServerState


def chat_renderer(state: ServerState):
    """The chat template's renderer; 503 until the model is loaded."""
    if state.chat is None:
        raise UnavailableError(f"not ready: {state.phase}")
    return state.chat


class ChatCompletionServing:
    """One chat request, its streams open (:meth:`start`): its SSE frames (:meth:`chunks`) or its
    whole answer (:meth:`respond`). Lives on the request's asyncio task only."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, renderer, streams: list[RequestStream]):
        self.state, self.req, self.renderer, self.streams = state, req, renderer, streams
        self.kind = req.tool_choice_kind
        self.declared = {t.function.name for t in req.offered_tools()}
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    @classmethod
    async def start(cls, state: ServerState, req: ChatCompletionRequest) -> ChatCompletionServing:
        """Check the request, render its prompt and build its tools' grammar (off the event loop),
        and open its streams."""
        check_model(state, req.model)
        try:
            req.check_tool_choice()
        except ValueError as e:
            raise InputValidationError(str(e), param="tool_choice") from e
        renderer = chat_renderer(state)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        check_request_bounds(state, sequences=req.n, sequences_param="n", stops=req.stop_list, top_logprobs=top,
                             top_param="top_logprobs")
        images = None
        if renderer.images is None:
            prompt_ids = await off_loop(renderer.prompt_ids, req)  # a template over long messages: milliseconds
        else:  # an image-text model: the images read, then the processor expands their placeholders
            text, urls = await off_loop(renderer.render, req)
            pictures = await read_images(urls, state.media)
            prompt_ids, images = await off_loop(renderer.images.prompt, text, pictures)
        max_new = check_admission(state, prompt_ids, req.max_completion_tokens or req.max_tokens)
        kind, tool_grammar = req.tool_choice_kind, None
        if kind in ("required", "named"):
            tool_grammar = await _tool_grammar(state, renderer, req.offered_tools(),
                                               several=kind == "required" and req.parallel_tool_calls)
        params = await sampling_params(state, req, max_new, top, tool_grammar)
        return cls(state, req, renderer, open_streams(state, [prompt_ids], params, req.n, req.stop_list,
                                                      req.cache_salt, images))

    def _finish(self, out: TokenOutput, called: bool) -> str:
        reason = finish_reason(out)
        return "tool_calls" if called and reason == "stop" and self.kind != "named" else reason

    def _logprobs(self, output: OutputProcessor, outputs: list[TokenOutput]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        content = []
        for o in outputs:
            token = output.token_text(o.event.token_id)
            content.append(TokenLogprob(token=token, logprob=o.event.logprob, bytes=list(token.encode()),
                                        top_logprobs=[TopLogprob(token=a.text, logprob=a.logprob,
                                                                 bytes=list(a.text.encode()))
                                                      for a in output.alternatives(o.event.top)]))
        return ChatLogprobs(content=content)

    def _chunk(self, i: int, delta: DeltaMessage, finish=None, logprobs=None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.state.model_name, choices=[
            ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)],
            system_fingerprint=self.streams[i].weights_version))

    async def chunks(self) -> AsyncIterator[str]:
        """The streamed answer: the role first, then content or tool-call deltas as they are
        read, each choice's finish last; the usage at the end where asked."""
        parsers = [StreamingToolParser(self.renderer.format, self.declared) if self.declared else None
                   for _ in self.streams]
        for i in range(len(self.streams)):
            yield self._chunk(i, DeltaMessage(role="assistant", content=""))
        async for i, out in merged(self.streams):
            logprobs = self._logprobs(self.streams[i].output, [out])
            if parsers[i] is None:
                if out.visible or out.last or logprobs:
                    yield self._chunk(i, DeltaMessage(content=out.visible or None),
                                      self._finish(out, False) if out.last else None, logprobs)
                continue
            for frame in self._tool_frames(i, parsers[i], out, logprobs):
                yield frame
        if include_usage(self.req):
            yield sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.state.model_name, choices=[],
                                          usage=usage(self.streams, self.req.n),
                                          system_fingerprint=self.streams[0].weights_version))

    def _tool_frames(self, i: int, parser: StreamingToolParser, out: TokenOutput, logprobs) -> list[str]:
        """The frames of one output of a choice whose text may carry tool calls."""
        frames, pieces = [], parser.feed(out.visible, final=out.last)
        for n, piece in enumerate(pieces):
            if piece.content is not None:
                delta = DeltaMessage(content=piece.content)
            else:
                delta = DeltaMessage(tool_calls=[DeltaToolCall(
                    index=piece.index, id=piece.id, type="function" if piece.id else None,
                    function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))])
            frames.append(self._chunk(i, delta, logprobs=logprobs if n == 0 else None))
        if out.last or (logprobs and not pieces):
            frames.append(self._chunk(i, DeltaMessage(), self._finish(out, bool(parser.calls)) if out.last else None,
                                      None if pieces else logprobs))
        return frames

    def respond(self, outputs: list[list[TokenOutput]]) -> ChatCompletionResponse:
        """The whole answer, from every choice's outputs."""
        choices = []
        for i, stream in enumerate(self.streams):
            text = stream.visible_text
            content, calls = self.renderer.format.parse(text, self.declared) if self.declared else (text, [])
            message = ResponseMessage(content=content, tool_calls=[
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
            ] or None)
            choices.append(ChatChoice(index=i, message=message, finish_reason=self._finish(outputs[i][-1], bool(calls)),
                                      logprobs=self._logprobs(stream.output, outputs[i])))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.state.model_name, choices=choices,
                                      usage=usage(self.streams, self.req.n),
                                      system_fingerprint=self.streams[0].weights_version)


async def _tool_grammar(state: ServerState, renderer, offered, several: bool) -> str:
    """The grammar that makes the answer calls of the offered tools, arguments valid against
    their schemas, built and checked off the event loop (128 tools of 50 properties take 0.4 s);
    a schema llguidance cannot take is a 400 naming ``tools``."""
    functions = [t.function.model_dump(exclude_none=True) for t in offered]
    return await checked_grammar(state, lambda: renderer.format.grammar(functions, several=several), "tools",
                                 "tools: a function's parameters cannot be enforced")
