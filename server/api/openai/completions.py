"""``POST /v1/completions``: one request's prompts, choices, logprobs and answer (``router`` routes it here).

``prompt`` is a string, a list of strings, token ids or a list of them; ``n`` choices per prompt,
choice ``i`` of prompt ``i // n``. ``echo`` puts the prompt before each choice's text, with
``logprobs`` also the prompt's log-probabilities (what evaluation harnesses ask for). The text
stops before a stop sequence (``server.api.outputs``); ``finish_reason`` is ``length`` or ``stop``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from server.api.generation import RequestStream, check_admission, check_request_bounds, check_token_ids, open_streams, \
    require_ready, tokenize
from server.api.openai.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.api.openai.serving import check_model, finish_reason, include_usage, merged, sampling_params, usage
from server.api.outputs import TokenOutput
from server.http.responses import sse
from server.http.state import ServerState


class CompletionServing:
    """One completion request, its streams open (:meth:`start`): its SSE frames (:meth:`chunks`) or
    its whole answer (:meth:`respond`). Lives on the request's asyncio task only."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[list[int]],
                 streams: list[RequestStream]):
        self.state, self.req, self.prompts, self.streams = state, req, prompts, streams
        self.scored = req.echo and req.logprobs is not None  # echo + logprobs: the prompt's too
        self.texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in req.prompts]
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self._offsets = [0] * len(streams)  # text_offset: characters of each choice's text so far

    @classmethod
    async def start(cls, state: ServerState, req: CompletionRequest) -> CompletionServing:
        """Check the request, tokenize its prompts (off the event loop) and open its streams."""
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
        params = await sampling_params(state, req, max_new, req.logprobs or 0)
        if req.echo and req.logprobs is not None:
            params = replace(params, prompt_logprobs=req.logprobs)
        return cls(state, req, prompts, open_streams(state, prompts, params, req.n, req.stop_list, req.cache_salt))

    def _logprobs(self, i: int, outputs: list[TokenOutput]) -> CompletionLogprobs | None:
        """Choice ``i``'s logprobs of ``outputs``' tokens."""
        if self.req.logprobs is None:
            return None
        output = self.streams[i].output
        tokens = [output.token_text(o.event.token_id) for o in outputs]
        tops = [{a.text: a.logprob for a in output.alternatives(o.event.top)} for o in outputs]
        return self._with_offsets(i, tokens, [o.event.logprob for o in outputs], tops)

    def _prompt_logprobs(self, i: int, first: TokenOutput | None) -> CompletionLogprobs | None:
        """With ``echo``: choice ``i``'s prompt tokens, their logprobs where they were asked for (on
        its first output; the first token has none)."""
        if self.req.logprobs is None:
            return None
        scored = first.event if self.scored and first is not None else None
        tokens = self.streams[i].output.prompt_tokens(self.prompts[i // self.req.n], scored)
        tops = [None if top is None else {a.text: a.logprob for a in top} for _, top in tokens]
        return self._with_offsets(i, [t.text for t, _ in tokens], [t.logprob for t, _ in tokens], tops)

    def _with_offsets(self, i: int, tokens: list[str], chosen: list, tops: list) -> CompletionLogprobs:
        text_offset = []
        for token in tokens:
            text_offset.append(self._offsets[i])
            self._offsets[i] += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=chosen, top_logprobs=tops, text_offset=text_offset)

    def _response(self, choices: list[CompletionChoice], usage_=None, i: int = 0) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.state.model_name, choices=choices,
                                  usage=usage_, system_fingerprint=self.streams[i].weights_version)

    async def chunks(self) -> AsyncIterator[str]:
        """The streamed answer: per choice the prompt first where echoed, then a chunk per token
        that shows text or ends the choice; the usage last where asked."""
        req, started = self.req, [False] * len(self.streams)
        async for i, out in merged(self.streams):
            if req.echo and not started[i]:  # the prompt first, with its scores where asked
                started[i] = True
                yield sse(self._response([CompletionChoice(index=i, text=self.texts[i // req.n],
                                                           logprobs=self._prompt_logprobs(i, out))], i=i))
            finish = finish_reason(out) if out.last else None
            if out.visible or finish:
                yield sse(self._response([CompletionChoice(index=i, text=out.visible, finish_reason=finish,
                                                           logprobs=self._logprobs(i, [out]))], i=i))
        if include_usage(req):
            yield sse(self._response([], usage(self.streams, req.n)))

    def respond(self, outputs: list[list[TokenOutput]]) -> CompletionResponse:
        """The whole answer, from every choice's outputs."""
        req, choices = self.req, []
        for i, stream in enumerate(self.streams):
            text, echoed = stream.visible_text, None
            if req.echo:  # the prompt's logprobs first: the text offsets count from the prompt's start
                text = self.texts[i // req.n] + text
                echoed = self._prompt_logprobs(i, outputs[i][0] if outputs[i] else None)
            logprobs = _joined(echoed, self._logprobs(i, outputs[i]))
            choices.append(CompletionChoice(index=i, text=text, finish_reason=finish_reason(outputs[i][-1]),
                                            logprobs=logprobs))
        return self._response(choices, usage(self.streams, req.n))


def _joined(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    return CompletionLogprobs(**{k: getattr(a, k) + getattr(b, k) for k in CompletionLogprobs.model_fields})
