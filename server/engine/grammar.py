"""Constrained decoding: token masks from llguidance for the rows that ask for a grammar.

Why llguidance (vLLM, SGLang and TGI use it or xgrammar): a 3 MB wheel with no dependencies
(xgrammar pulls in Triton, hundreds of MB on a CPU machine), grammars built lazily as tokens come
(no compile step to hide off the engine's step: a schema costs microseconds to set up), and JSON
schema, regex and Lark in one library.

A request's grammar travels as llguidance's grammar string (:func:`grammar_for`, built and checked
on rank 0 at request time, so a schema it cannot take is the API's 4xx); the rank that owns the
sequence keeps its matcher (:class:`GrammarRows`), masks that row's scores before the token is
chosen, and feeds it the chosen token. When the grammar is complete the rank reports the token as
the sequence's last (``TokenResult.stop``). A sequence preempted and recomputed rebuilds its matcher
from the tokens it had generated.
"""

from __future__ import annotations

import json

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")


class GrammarError(ValueError):
    """A grammar llguidance cannot take (the API answers 4xx with this message)."""


def grammar_for(kind: str, spec) -> str:
    """llguidance's grammar string for ``kind``: ``json_schema`` (a schema, dict or JSON text),
    ``json_object`` (any JSON object), ``regex`` (a pattern) or ``choice`` (a list of strings)."""
    from llguidance import LLMatcher

    # compact JSON: a random or weak model could otherwise pad with whitespace until max_tokens
    defaults = {"whitespace_flexible": False}
    if kind == "json_schema":
        schema = spec if isinstance(spec, str) else json.dumps(spec)
        return LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=defaults)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        import re

        return LLMatcher.grammar_from_regex("|".join(re.escape(str(c)) for c in spec))
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {GRAMMAR_KINDS}")


class Grammars:
    """One tokenizer's llguidance view, and matchers for it (built once per process)."""

    def __init__(self, tokenizer, vocab_size: int | None = None):
        import llguidance.hf

        self.vocab_size = vocab_size or len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` where the grammar cannot be matched against this vocabulary."""
        self.matcher(grammar)


_GRAMMARS: dict[int, tuple[object, Grammars]] = {}


def grammars_of(tokenizer) -> Grammars:
    """The process's one :class:`Grammars` for ``tokenizer`` (rank 0 checks requests with the same
    one its engine masks with): llguidance's view of a vocabulary is built once."""
    entry = _GRAMMARS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _GRAMMARS[id(tokenizer)] = (tokenizer, Grammars(tokenizer))
    return entry[1]


class GrammarRows:
    """A rank's matchers, one per constrained sequence, and the masks they give."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._matchers: dict[int, object] = {}

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def mask(self, seq_id: int, grammar: str, generated: list[int], vocab: int, device) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (built, and fed ``generated``, the first
        time this sequence is seen here)."""
        import llguidance.torch

        matcher = self._matchers.get(seq_id)
        if matcher is None:
            matcher = self._matchers[seq_id] = self.grammars.matcher(grammar)
            for token in generated:  # a recomputed sequence: its grammar state again
                matcher.consume_token(token)
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.grammars.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[0][:, None] >> bits) & 1).bool().flatten()[:vocab]
        if allowed.numel() < vocab:  # tokens past the tokenizer's vocabulary: never allowed
            allowed = torch.cat([allowed, torch.zeros(vocab - allowed.numel(), dtype=torch.bool)])
        return allowed.to(device)

    def accept(self, seq_id: int, token: int) -> bool:
        """Feed the chosen token; True when the grammar is complete (the sequence ends here)."""
        matcher = self._matchers[seq_id]
        matcher.consume_token(token)
        done = matcher.is_stopped()
        if done:
            self.forget(seq_id)
        return done
