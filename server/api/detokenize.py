"""Text from token ids, one token at a time, on the API side (the engine deals in ids only).

:class:`IncrementalDetokenizer` turns each new token into the text it adds, at a cost that does
not grow with the length of the text so far: ``tokenizers``' ``DecodeStream`` for fast
tokenizers (it holds back a token that ends inside a UTF-8 character until the next completes
it), else the ids since the last piece decoded again with the piece before them as context (the
prefix/read offsets of TGI and vLLM).
The pieces, and :meth:`IncrementalDetokenizer.flush` at the end (bytes of an unfinished
character, as the replacement characters a whole decode gives), concatenate to what
``tokenizer.decode(all ids, skip_special_tokens=True)`` returns.

:class:`StopText` is the one place stop sequences are handled: it cuts the text as it grows
before the first stop sequence, holding back the end that may still become one and looking only
at that end and the new piece; :func:`held_back` says how much of a text's end may still become
one of some strings (a stop sequence, a tool-call tag), for streams that hold it back.
"""

from __future__ import annotations

class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        try:
            from tokenizers import Tokenizer
            from tokenizers.decoders import DecodeStream
        except ImportError:  # an old tokenizers
            DecodeStream = None  # noqa: N806
        if DecodeStream is not None and isinstance(self._backend, Tokenizer):
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0
        self._held: list[int] = []  # ids whose text is not out yet (DecodeStream)

    def step(self, token_id: int) -> str:
        """The text ``token_id`` adds ("" while it ends inside a character)."""
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id) or ""
            if piece:
                self._held.clear()
            else:
                self._held.append(token_id)
            return piece
        ids = self._ids
        ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
        text = decode(ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        # the ids just read become the context for the next ones; older ids are never read again
        del ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """The text still held back at the end (an unfinished character: replacement characters)."""
        held = self._held if self._stream is not None else self._ids[self._read_offset:]
        if not held:
            return ""
        decode = self.tokenizer.decode
        if self._stream is not None:
            text = decode(held, skip_special_tokens=self.skip_special_tokens)
        else:
            prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
            text = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)[len(prefix):]
        self._held, self._ids, self._prefix_offset, self._read_offset = [], [], 0, 0
        return text


class StopText:
    """A request's text as a client may see it, a piece at a time: cut before the first stop
    sequence, and never showing the end that may still become one. :meth:`feed` looks only at what
    it holds back and the new piece, so the cost per token does not grow with the text; the pieces
    it returns join to the whole text cut before its first stop sequence (with ``final`` on the last)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False  # a stop sequence completed: nothing more is shown
        self._held = ""

    def feed(self, piece: str, final: bool = False) -> str:
        """Add ``piece``; the text that may be shown now (all that is left with ``final``)."""
        if self.stopped:
            return ""
        held = self._held + piece
        cuts = [held.find(s) for s in self.stops if s in held]
        if cuts:
            self.stopped, self._held = True, ""
            return held[: min(cuts)]
        keep = 0 if final else held_back(held, self.stops)
        self._held = held[len(held) - keep:] if keep else ""
        return held[: len(held) - keep]


def held_back(text: str, targets) -> int:
    """Characters at the end of ``text`` that may still become one of ``targets`` (the longest
    proper prefix of one of them that ``text`` ends with)."""
    keep = 0
    for target in targets:
        if not target:
            continue
        # only the places where the target's first character stands can begin it: the longest first
        longest = min(len(target) - 1, len(text))
        i = text.find(target[0], len(text) - longest)
        while i != -1 and len(text) - i > keep:
            if target.startswith(text[i:]):
                keep = len(text) - i
                break
            i = text.find(target[0], i + 1)
    return keep
