"""Constrained decoding: token masks from llguidance for the rows that ask for a grammar.

Why llguidance (vLLM, SGLang and TGI use it or xgrammar): a 3 MB wheel with no dependencies
(xgrammar pulls in Triton, hundreds of MB on a CPU machine), and JSON schema, regex and Lark in
one library. Building a matcher is not free: a small schema takes a millisecond, the call grammar
of 128 tools of 50 properties 0.4 s (llguidance drops the GIL while it builds); a copy of a built
one (``deep_copy``) takes 30 us.

A request's grammar travels as llguidance's grammar string (:func:`grammar_for`, built and checked
on rank 0 at request time, off the event loop, so a schema it cannot take is the API's 4xx). Each
process keeps its compiled grammars (:class:`Grammars`, bounded, least recently used out): rank 0's
check compiles what its own engine then copies, and a sequence's matcher is a copy. The rank that
owns a sequence (:class:`GrammarRows`) starts its matcher on a thread of its own as soon as the
sequence arrives, so that a compile overlaps the step's forward; a sequence preempted and recomputed
gets a copy fed its generated tokens in one call. The masks of all of a step's constrained rows are
filled in one call (llguidance's executor, its rows in parallel) and applied in one operation
(:class:`server.engine.sampling.RowMasks`). The chosen tokens are fed back; when the grammar is
complete the rank reports the token as the sequence's last (``TokenResult.stop``). A matcher in an
error state (a resource limit of llguidance's, or a token it cannot take) fails its sequence with
llguidance's message: never a ``stop`` on output that may not match.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
MAX_COMPILED_GRAMMARS = 32
"""Compiled grammars a process keeps (least recently used out; a large one holds its lexer and
parser tables, so the bound is on their number)."""
BUILD_TIMEOUT_S = 120.0
"""A sequence whose matcher is not built within this (from the step that needs it) fails alone."""
LIMITS_ENV = "HSDP_INJECT_GRAMMAR_LIMITS"


class GrammarError(ValueError):
    """A grammar llguidance cannot take (the API answers 4xx with this message), or a matcher that
    entered an error state while decoding (its sequence fails with this message)."""


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


def matcher_error(matcher) -> str:
    """The first line of an errored matcher's message (the line that names the limit or the token;
    the rest is llguidance's dump of its state and the grammar, for logs, not for clients)."""
    return (matcher.get_error() or "the grammar matcher is in an error state").strip().splitlines()[0]


class _Compiled:
    __slots__ = ("lock", "matcher")

    def __init__(self):
        self.lock = threading.Lock()
        self.matcher = None  # the compiled grammar, never fed: only copied


class Grammars:
    """One tokenizer's llguidance view, and its compiled grammars (built once per process).
    Thread-safe: rank 0's request threads and its engine share one."""

    def __init__(self, tokenizer, vocab_size: int | None = None, limits=None):
        import llguidance.hf

        self.vocab_size = vocab_size or len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
        self.limits = limits if limits is not None else _injected_limits()
        self._compiled: OrderedDict[str, _Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def _entry(self, grammar: str) -> _Compiled:
        with self._lock:
            entry = self._compiled.get(grammar)
            if entry is None:
                entry = self._compiled[grammar] = _Compiled()
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > MAX_COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)  # whoever holds it still may use it
            return entry

    def matcher(self, grammar: str):
        """A fresh matcher for ``grammar``: a copy of its compiled form, compiled here the first time
        (once: concurrent callers of one grammar wait for the one compile). Raises
        :class:`GrammarError` where llguidance cannot take it."""
        from llguidance import LLMatcher

        entry = self._entry(grammar)
        with entry.lock:
            if entry.matcher is None:
                matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
                if matcher.is_error():
                    with self._lock:
                        if self._compiled.get(grammar) is entry:
                            del self._compiled[grammar]
                    raise GrammarError(matcher.get_error())
                entry.matcher = matcher
            return entry.matcher.deep_copy()

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` where the grammar cannot be matched against this vocabulary
        (compiling it: the engine of this process then copies it)."""
        self.matcher(grammar)


def _injected_limits():
    """llguidance's parser limits for tests: ``HSDP_INJECT_GRAMMAR_LIMITS=max_lexer_states=20,...``
    (``LLParserLimits``' fields), so that a matcher reaches a resource limit while decoding."""
    spec = os.environ.get(LIMITS_ENV)
    if not spec:
        return None
    from llguidance import LLParserLimits

    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    return LLParserLimits(**{k.strip(): int(v) for k, v in fields.items()})


_GRAMMARS: dict[int, tuple[object, Grammars]] = {}


def grammars_of(tokenizer) -> Grammars:
    """The process's one :class:`Grammars` for ``tokenizer`` (rank 0 checks requests with the same
    one its engine masks with): llguidance's view of a vocabulary is built once."""
    entry = _GRAMMARS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _GRAMMARS[id(tokenizer)] = (tokenizer, Grammars(tokenizer))
    return entry[1]


def _mask_threads() -> int:
    """llguidance executor threads per rank: its share of the node's cores, at most 8."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // ranks))


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte value, lowest first, on ``device``."""
    table = _BYTE_BITS.get(device)
    if table is None:
        table = _BYTE_BITS[device] = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool().to(device)
    return table


class GrammarRows:
    """A rank's matchers, one per constrained sequence, and the masks they give."""

    def __init__(self, grammars: Grammars):
        from llguidance import LLExecutor

        self.grammars = grammars
        self._matchers: dict[int, Future] = {}
        # one thread: a compile overlaps the forward; compiles of a burst queue behind each other
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="hsdp-grammar")
        self._executor = LLExecutor(num_threads=_mask_threads())
        self._bitmask_MW: torch.Tensor | None = None  # reused across steps (pinned where CUDA is)

    def start(self, seq_id: int, grammar: str, generated: list[int]) -> None:
        """Build the sequence's matcher off the step (fed ``generated``: a recomputed sequence)."""
        self.forget(seq_id)
        self._matchers[seq_id] = self._builder.submit(self._build, grammar, list(generated))

    def _build(self, grammar: str, generated: list[int]):
        matcher = self.grammars.matcher(grammar)
        if generated and not matcher.consume_tokens(generated):  # its grammar state again
            raise GrammarError(f"the grammar cannot follow the generated tokens: {matcher_error(matcher)}")
        return matcher

    def forget(self, seq_id: int) -> None:
        future = self._matchers.pop(seq_id, None)
        if future is not None:
            future.cancel()

    def _matcher(self, seq_id: int, grammar: str, generated: list[int]):
        if seq_id not in self._matchers:  # (a caller that did not start it)
            self.start(seq_id, grammar, generated)
        return self._matchers[seq_id].result(timeout=BUILD_TIMEOUT_S)

    def masks(self, rows: list[tuple[int, int, str, list[int]]], vocab: int, device):
        """The allowed tokens of every ``(row, seq_id, grammar, generated)``, as one
        :class:`~server.engine.sampling.RowMasks` over ``vocab`` columns on ``device`` (None when no
        row has one), and ``{row: why}`` for the rows that cannot go on (their sequences fail)."""
        from server.engine.sampling import RowMasks

        failed: dict[int, str] = {}
        live = []  # (row, matcher)
        for row, seq_id, grammar, generated in rows:
            try:
                matcher = self._matcher(seq_id, grammar, generated)
            except Exception as e:  # noqa: BLE001 - its sequence fails alone
                failed[row] = f"{type(e).__name__}: {e}"
                continue
            if matcher.is_error():
                failed[row] = f"GrammarError: {matcher_error(matcher)}"
            else:
                live.append((row, matcher))
        if not live:
            return None, failed
        words = (self.grammars.vocab_size + 31) // 32
        if self._bitmask_MW is None or self._bitmask_MW.shape[0] < len(live):
            self._bitmask_MW = torch.full((max(len(live), 8), words), -1, dtype=torch.int32)  # [M, W], on the host
        bitmask_MW = self._bitmask_MW[:len(live)]
        # llguidance.torch's fill_next_token_bitmask_par, called directly: importing that module
        # runs a torch.compile decorator, which imports inductor (seconds, holding the GIL) on the
        # engine thread at the first grammar step, and /health waited for it (up to 1.1 s in CI).
        # Each matcher's mask goes to row j of the contiguous int32 buffer; the GIL is dropped.
        self._executor.unsafe_compute_mask_ptr([(m, j) for j, (_, m) in enumerate(live)], bitmask_MW.data_ptr(),
                                               words * 4, len(live))
        keep = []
        nonempty = bitmask_MW.ne(0).any(dim=1).tolist()
        for j, (row, matcher) in enumerate(live):
            if matcher.is_error():  # a limit reached computing the mask
                failed[row] = f"GrammarError: {matcher_error(matcher)}"
            elif not nonempty[j]:
                failed[row] = "ValueError: the grammar allows no token here"
            else:
                keep.append(j)
        if not keep:
            return None, failed
        index = torch.tensor(keep)
        # the bits as bytes (little-endian: byte k of a word holds tokens 8k..8k+7), each byte
        # looked up as its 8 bools: one gather, a third of shifting every bit out of every word
        bytes_MB = bitmask_MW.index_select(0, index).view(torch.uint8).to(device, non_blocking=True)
        allowed_MV = _byte_bits(device).index_select(0, bytes_MB.flatten().int()).view(len(keep), 32 * words)
        if allowed_MV.shape[1] >= vocab:
            allowed_MV = allowed_MV[:, :vocab]
        else:  # tokens past the tokenizer's vocabulary: never allowed
            allowed_MV = torch.nn.functional.pad(allowed_MV, (0, vocab - allowed_MV.shape[1]), value=False)
        rows_M = torch.tensor([live[j][0] for j in keep], dtype=torch.long, device=device)
        return RowMasks(rows_M, allowed_MV), failed

    def accept(self, chosen: list[tuple[int, int]]) -> list[tuple[bool, str | None]]:
        """Feed each ``(seq_id, token)`` its chosen token (all in one call); per pair ``(done,
        error)``: done when the grammar is complete (the sequence ends here), error when the matcher
        entered an error state (its sequence fails with llguidance's message, which names the limit)."""
        if not chosen:
            return []
        matchers = [self._matchers[seq_id].result(timeout=BUILD_TIMEOUT_S) for seq_id, _ in chosen]
        self._executor.consume_token_par([(m, token) for m, (_, token) in zip(matchers, chosen)])
        out = []
        for (seq_id, _), matcher in zip(chosen, matchers):
            if matcher.is_error():
                out.append((False, f"GrammarError: {matcher_error(matcher)}"))
                self.forget(seq_id)
            elif matcher.is_stopped():
                out.append((True, None))
                self.forget(seq_id)
            else:
                out.append((False, None))
        return out
