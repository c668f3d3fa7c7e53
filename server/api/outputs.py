"""A request's output, built once on the API side from the engine's token events.

The engine delivers one frozen :class:`~server.engine.scheduler.TokenEvent` per generated token
(its id, log-probabilities, the engine's finish). Per request, :class:`OutputProcessor` turns each
into one frozen :class:`TokenOutput` (vLLM's ``EngineCoreOutput`` -> ``OutputProcessor`` split):

* ``text``: what the token adds to the whole text (incremental detokenization); joined, the
  generated text with its stop sequence, as TGI returns it;
* ``visible``: what a client may be shown now: cut before the first stop sequence and never the
  end that may still become one (``server.api.detokenize.StopText``), as OpenAI streams it; joined,
  the text OpenAI returns whole;
* ``finish``: the engine's (``length``, ``eos_token``), or ``stop_sequence`` where a stop sequence
  completed first (the processor's caller then frees the sequence).

A token's own text and its alternatives' are decoded only where an API shows them
(:meth:`OutputProcessor.token_text`, :meth:`OutputProcessor.alternatives`): the one place both
APIs' logprobs and TGI's tokens are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.api.detokenize import IncrementalDetokenizer, StopText
from server.engine.scheduler import TokenEvent


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One generated token as the APIs see it (the module says what each field is)."""

    event: TokenEvent
    text: str
    visible: str
    finish: str | None

    @property
    def last(self) -> bool:
        return self.finish is not None


@dataclass(frozen=True, slots=True)
class Alternative:
    """A token in the text the APIs show: its id, text, log-probability, whether it is special."""

    token_id: int
    text: str
    logprob: float | None
    special: bool


class OutputProcessor:
    """One request's text and finish from its token events, in order; owned by one asyncio task."""

    def __init__(self, tokenizer, stops: list[str], special_ids=frozenset()):
        self.tokenizer = tokenizer
        self.special_ids = special_ids or frozenset()
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopText(stops)
        self._pieces: list[str] = []
        self._visible: list[str] = []

    def process(self, event: TokenEvent) -> TokenOutput:
        """``event``'s output; after the last (``finish`` set) there is no more."""
        text = self._detokenizer.step(event.token_id)
        if event.finish is not None:
            text += self._detokenizer.flush()
        finish = event.finish
        visible = self._stops.feed(text, final=finish is not None)
        if self._stops.stopped and finish is None:
            finish = "stop_sequence"
            text += self._detokenizer.flush()
        self._pieces.append(text)
        self._visible.append(visible)
        return TokenOutput(event, text, visible, finish)

    @property
    def text(self) -> str:
        """The text generated so far, stop sequence included."""
        return _joined(self._pieces)

    @property
    def visible_text(self) -> str:
        """The text generated so far as a client may be shown it (cut before a stop sequence)."""
        return _joined(self._visible)

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (its bytes may be half a character: replacement characters)."""
        return self.tokenizer.decode([token_id])

    def token(self, token_id: int, logprob: float | None) -> Alternative:
        return Alternative(token_id, self.token_text(token_id), logprob, token_id in self.special_ids)

    def alternatives(self, top) -> list[Alternative]:
        """``(id, logprob)`` pairs (a token's likeliest alternatives) with their texts."""
        return [self.token(t, lp) for t, lp in top]

    def prompt_tokens(self, prompt_ids: list[int], first: TokenEvent | None) -> list[tuple[Alternative, list | None]]:
        """The prompt's tokens with their log-probabilities and alternatives, where the request
        asked for them (on its first event); the first token has none."""
        scores = (first.prompt_logprobs if first is not None else None) or [(None, None)] * (len(prompt_ids) - 1)
        out = [(self.token(prompt_ids[0], None), None)] if prompt_ids else []
        for t, (lp, top) in zip(prompt_ids[1:], scores):
            out.append((self.token(t, lp), None if top is None else self.alternatives(top)))
        return out


def _joined(pieces: list[str]) -> str:
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""
