"""Incremental detokenization and stop sequences against a whole decode."""

import pytest
import torch

from server.api.detokenize import IncrementalDetokenizer, StopText
from tests.checkpoints import tokenizer


@pytest.mark.parametrize("fast", [True, False])
def test_pieces_concatenate_to_the_whole_decode(fast):
    tok = tokenizer()  # byte-level BPE: tokens end inside UTF-8 characters
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        ids = torch.randint(0, len(tok), (60,), generator=gen).tolist()
        detok = IncrementalDetokenizer(tok)
        if not fast:
            detok._stream = None  # the offsets fallback, as for a tokenizer without a tokenizers backend
        text = "".join(detok.step(i) for i in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=True), trial


def test_text_with_special_tokens_and_multibyte_characters():
    tok = tokenizer()
    ids = tok("héllo wörld 日本 🙂<|endoftext|>done", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) + detok.flush() == "héllo wörld 日本 🙂done"
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_stop_sequences_across_pieces():
    stops = StopText(["wörld", "END"])
    # held back while it may still become a stop sequence; cut before the one that completes
    assert [stops.feed(p) for p in ["hé", "llo w", "ör", "ld and"]] == ["hé", "llo ", "", ""] and stops.stopped
    assert stops.feed("more") == ""  # nothing after a stop sequence
    stops = StopText(["END"])
    assert stops.feed("no stop here") == "no stop here" and stops.feed("E") == "" and stops.feed("ND!") == ""
    assert stops.stopped
    held = StopText(["END"])
    assert held.feed("abcE") == "abc" and held.feed("N", final=True) == "EN" and not held.stopped
    free = StopText([])
    assert free.feed("anything") == "anything" and not free.stopped
