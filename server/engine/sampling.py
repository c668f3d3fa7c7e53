"""Next tokens for a batch of sequences, each with its own sampling parameters, in one pass.

:class:`BatchSampler` applies what transformers' logits processors do (repetition penalty,
temperature, top-k, top-p, min-p, in ``generate``'s order) to every row at once with per-row
parameters; :func:`build_logits_processors` builds transformers' own for one request, the
reference the tests compare with. A sampled token is drawn by inverse CDF from one uniform number
that depends only on the request's seed and the token's index, so a seeded request replays the
same tokens whatever it is batched with, and after a preemption. The chosen token's logprob (under
the model, before the processors) costs one logsumexp per row; the full log-softmax and the top
alternatives are computed only for rows that asked for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class SamplingParams:
    """What one request asks of the decoder; validated at the HTTP layer."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    top_logprobs: int = 0
    """Also return the log-probabilities of this many most likely tokens at each step."""
    presence_penalty: float | None = None
    """OpenAI's: subtracted once from the logit of every token generated so far."""
    frequency_penalty: float | None = None
    """OpenAI's: subtracted from a token's logit once per time it was generated so far."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before anything else samples (OpenAI's ``logit_bias``)."""
    typical_p: float | None = None
    """Locally typical sampling's mass (transformers' TypicalLogitsWarper), a warper."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the sequence as its end-of-sequence token does (vLLM's ``stop_token_ids``)."""
    ignore_eos: bool = False
    """Go on past the end-of-sequence token, to ``max_new_tokens`` (vLLM's ``ignore_eos``)."""
    grammar: str | None = None
    """llguidance's grammar string (``server.engine.grammar.grammar_for``): only tokens it allows."""
    prompt_logprobs: int | None = None
    """Also return each prompt token's log-probability under the model's raw scores, with this many
    most likely alternatives; None: not computed. Such a request takes no cached prefix (a cached
    block's positions are not computed again, and their scores were never kept)."""

    @property
    def samples(self) -> bool:
        # As in text-generation-inference: sampling when asked, or when any warper is active.
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or (self.top_k is not None and self.top_k > 0)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.min_p is not None and self.min_p > 0.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
        )


def build_logits_processors(params: SamplingParams):
    """transformers' processors for ``params``, in the order ``generate`` applies them (the test
    reference; OpenAI's presence and frequency penalties, which transformers lacks, are left out)."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()}))
    if params.samples:
        if params.temperature is not None and params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None and params.top_k > 0:
            processors.append(TopKLogitsWarper(top_k=params.top_k))
        if params.top_p is not None and params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p))
        if params.min_p is not None and params.min_p > 0.0:
            processors.append(MinPLogitsWarper(min_p=params.min_p))
        if params.typical_p is not None and params.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(mass=params.typical_p))
    return processors


_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed of token ``index`` of a request seeded ``seed`` (splitmix64 of both)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & (_MASK64 >> 1)


class Row:
    """One sequence to sample for: its parameters, its tokens so far, and how many of them it generated."""

    __slots__ = ("params", "tokens", "num_generated")

    def __init__(self, params: SamplingParams, tokens: list[int], num_generated: int):
        self.params, self.tokens, self.num_generated = params, tokens, num_generated

    def generated(self) -> list[int]:
        """The tokens this sequence generated (its prompt's not among them)."""
        return self.tokens[len(self.tokens) - self.num_generated:] if self.num_generated else []


@dataclass(frozen=True)
class RowMasks:
    """The tokens a step's constrained rows allow, all rows in one tensor
    (``server.engine.grammar.GrammarRows.masks``)."""

    rows_M: torch.Tensor
    """long: the batch rows (of ``logits_NV``) these masks are for."""
    allowed_MV: torch.Tensor
    """bool, one row per entry of ``rows_M``: the tokens its grammar allows."""

    def row(self, i: int) -> RowMasks | None:
        """Batch row ``i``'s mask, as the mask of a batch of that row alone (None: it has none)."""
        at = (self.rows_M == i).nonzero().flatten()
        if at.numel() == 0:
            return None
        return RowMasks(torch.zeros(1, dtype=torch.long, device=self.rows_M.device),
                        self.allowed_MV.index_select(0, at[:1]))


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list, a tuple, or a CPU tensor) on ``device``. Built on the host; on a GPU
    copied from pinned memory without the host waiting. A tensor made from a Python list straight
    on a GPU is a copy from pageable memory, which CUDA makes the host wait for (the stream's work
    so far included): a sync per call, several per step with sampled rows, where the step's one
    copy of its tokens back should be its only one (``benchmarks/gpu_check.py`` counts them)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class BatchSampler:
    """A rank's sampler: the next token of every row of a step at once, transformers' processors
    applied row-wise in ``generate``'s order. A seeded row draws from ``token_seed(seed, n)`` for its
    n-th token, so that its output replays whatever the batch around it; greedy rows are argmax.
    Not thread-safe (one per rank, used by its engine thread)."""

    def __init__(self):
        self._generator = torch.Generator()
        # token ids no row ever chooses, whatever its biases and grammar (an image model's placeholders:
        # server.engine.multimodal.placeholder_ids); their log-probabilities are still the model's
        self.never: list[int] = []
        self._never_index: tuple[tuple[int, ...], torch.device, torch.Tensor] | None = None

    def sample(self, logits_NV: torch.Tensor, rows: list[Row],
               allowed: RowMasks | None = None) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """Per row: the next token, its log-probability under the model, and the ``top_logprobs``
        most likely tokens with theirs. ``allowed``: the constrained rows' masks of the tokens
        their grammars allow (the others are never chosen). Those rows of ``logits_NV`` are masked
        in place, in one operation, once the model's own log-probabilities are taken from them: a
        copy of the whole batch's logits per step would cost every row for a few constrained ones."""
        logits_NV = logits_NV.float()
        # the model's distribution, before any mask (one fused pass: half logsumexp's time on CPU)
        logprobs_NV = torch.log_softmax(logits_NV, dim=-1)
        tops = {i: torch.topk(logprobs_NV[i], row.params.top_logprobs)
                for i, row in enumerate(rows) if row.params.top_logprobs}
        never = self._never_on(logits_NV.device)
        if never is not None:
            logits_NV.index_fill_(1, never, float("-inf"))
        if allowed is not None:
            choosable = allowed.allowed_MV
            if never is not None:
                choosable = choosable.index_fill(1, never, False)
            if not bool(choosable.any(dim=-1).all()):
                raise ValueError("the grammar allows no token here")
            masked_MV = torch.where(allowed.allowed_MV, logits_NV.index_select(0, allowed.rows_M), float("-inf"))
            logits_NV.index_copy_(0, allowed.rows_M, masked_MV)
        scores_NV = self._process(logits_NV, rows)
        tokens_N = torch.argmax(scores_NV, dim=-1)
        sampled = [i for i, row in enumerate(rows) if row.params.samples]
        if sampled:
            index = to_device(sampled, logits_NV.device)
            probs_MV = torch.softmax(scores_NV.index_select(0, index), dim=-1)
            uniform_M = to_device([self._uniform(rows[i]) for i in sampled], logits_NV.device)
            cdf_MV = torch.cumsum(probs_MV, dim=-1)
            drawn_M = torch.searchsorted(cdf_MV, (uniform_M * cdf_MV[:, -1]).unsqueeze(1), right=True).squeeze(1)
            drawn_M = drawn_M.clamp_(max=probs_MV.shape[1] - 1)
            # A distribution degenerate past float range (temperature -> 0 and the like) has greedy
            # as its limit: the most likely token under the model (within its grammar).
            finite_M = torch.isfinite(probs_MV).all(dim=-1)
            greedy_M = torch.argmax(logits_NV.index_select(0, index), dim=-1)
            tokens_N.index_copy_(0, index, torch.where(finite_M, drawn_M, greedy_M))
        logprob_N = logprobs_NV.gather(1, tokens_N.unsqueeze(1)).squeeze(1)
        # The step's one device-to-host copy (on a GPU its only sync): the tokens, their
        # log-probabilities and every asked-for alternative in one float64 row, exact for both
        # (token ids are integers far below 2**53; a float32 widens exactly).
        parts = [tokens_N.double(), logprob_N.double()]
        for top in tops.values():
            parts += [top.indices.double(), top.values.double()]
        host = torch.cat(parts).tolist()
        n = len(rows)
        out, at = [], 2 * n
        for i in range(n):
            top = []
            if i in tops:
                k = tops[i].indices.numel()
                top = [(int(t), v) for t, v in zip(host[at:at + k], host[at + k:at + 2 * k])]
                at += 2 * k
            out.append((int(host[i]), host[n + i], top))
        return out

    def _never_on(self, device: torch.device) -> torch.Tensor | None:
        """:attr:`never` as an index on ``device``, made once (a Python list as an index is a copy
        from pageable memory each time: on a GPU a host sync a step)."""
        if not self.never:
            return None
        key = (tuple(self.never), device)
        if self._never_index is None or self._never_index[:2] != key:
            self._never_index = (*key, to_device(self.never, device, torch.long))
        return self._never_index[2]

    def _uniform(self, row: Row) -> float:
        seed = row.params.seed if row.params.seed is not None else 0
        self._generator.manual_seed(token_seed(seed, row.num_generated))
        return float(torch.rand((), generator=self._generator))

    @staticmethod
    def _process(logits_NV: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """transformers' processors, row-wise parameters, in generate's order, never in place (the
        logits are the model's). A grammar's mask is already in the logits, so top-k, top-p and
        min-p choose among what it allows (penalties and biases keep -inf at -inf)."""
        scores = logits_NV
        vocab = scores.shape[1]
        device = scores.device

        def column(values, fill):
            return to_device([fill if v is None else v for v in values], device, scores.dtype)

        penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty not in (None, 1.0)]
        if penalised:
            width = max(len(rows[i].tokens) for i in penalised)
            ids = torch.full((len(penalised), width), vocab, dtype=torch.long)  # vocab: a padding column
            for j, i in enumerate(penalised):
                ids[j, : len(rows[i].tokens)] = torch.tensor(rows[i].tokens).clamp_(max=vocab)
            ids = to_device(ids, device)
            index = to_device(penalised, device)
            sub = torch.nn.functional.pad(scores.index_select(0, index), (0, 1))
            penalty = column([rows[i].params.repetition_penalty for i in penalised], 1.0)[:, None]
            picked = sub.gather(1, ids)
            sub = sub.scatter(1, ids, torch.where(picked < 0, picked * penalty, picked / penalty))
            scores = scores.index_copy(0, index, sub[:, :vocab])
        scores = _penalize_generated(scores, rows)
        biased = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items() if t < vocab]
        if biased:  # each (row, token) once (a row's biases are a dict): one add at each's flat position,
            # not index_put(accumulate=True), whose CUDA kernel checks its indices' bounds on the host (4 syncs)
            flat = to_device([i * vocab + t for i, t, _ in biased], device)
            bias = to_device([b for _, _, b in biased], device, scores.dtype)
            scores = scores.reshape(-1).index_add(0, flat, bias).view(scores.shape)
        warped = [i for i, r in enumerate(rows) if r.params.samples]
        if not warped:
            return scores
        index = to_device(warped, device)
        params = [rows[i].params for i in warped]
        sub = scores.index_select(0, index)
        temperature = column([p.temperature if p.temperature not in (None, 1.0) else None for p in params], 1.0)
        sub = sub / temperature[:, None]
        inf = float("-inf")
        top_k = [p.top_k if p.top_k and p.top_k > 0 else None for p in params]
        if any(k is not None for k in top_k):
            k = to_device([min(k or vocab, vocab) for k in top_k], device)
            kth = torch.sort(sub, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            sub = sub.masked_fill(sub < kth, inf)
        top_p = [p.top_p if p.top_p is not None and p.top_p < 1.0 else None for p in params]
        if any(p is not None for p in top_p):
            threshold = 1 - column(top_p, 1.0)[:, None]
            sorted_logits, sorted_index = torch.sort(sub, descending=False)
            remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= threshold
            remove[:, -1] = False
            sub = sub.masked_fill(remove.scatter(1, sorted_index, remove), inf)
        min_p = [p.min_p if p.min_p else None for p in params]
        if any(p is not None for p in min_p):
            probs = torch.softmax(sub, dim=-1)
            remove = probs < column(min_p, 0.0)[:, None] * probs.amax(dim=-1, keepdim=True)
            remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
            sub = sub.masked_fill(remove, inf)
        typical = [p.typical_p if p.typical_p is not None and p.typical_p < 1.0 else None for p in params]
        if any(t is not None for t in typical):
            # transformers' TypicalLogitsWarper, per row (a row without it keeps everything)
            log_probs = torch.log_softmax(sub, dim=-1)
            entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)
            shifted = (-log_probs - entropy).abs()
            sorted_shift, sorted_index = torch.sort(shifted, descending=False)
            cumulative = sub.gather(-1, sorted_index).softmax(dim=-1).cumsum(dim=-1)
            last = (cumulative < column(typical, 2.0)[:, None]).sum(dim=1).clamp_(max=vocab - 1)
            remove = sorted_shift > sorted_shift.gather(1, last.view(-1, 1))
            remove[:, :1] = False
            sub = sub.masked_fill(remove.scatter(1, sorted_index, remove), inf)
        return scores.index_copy(0, index, sub)


def _penalize_generated(scores: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over each row's generated tokens (not its prompt):
    logit[t] -= frequency * count[t] + presence * (count[t] > 0)."""
    penalised = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if not penalised:
        return scores
    vocab, device = scores.shape[1], scores.device
    counts = torch.zeros(len(penalised), vocab + 1, dtype=scores.dtype)  # vocab: a column for out-of-range ids
    for j, i in enumerate(penalised):
        generated = rows[i].generated()
        if generated:
            ids = torch.tensor(generated).clamp_(max=vocab)
            counts[j].index_add_(0, ids, torch.ones(len(generated), dtype=scores.dtype))
    counts = to_device(counts[:, :vocab], device)
    frequency = to_device([rows[i].params.frequency_penalty or 0.0 for i in penalised], device, scores.dtype)[:, None]
    presence = to_device([rows[i].params.presence_penalty or 0.0 for i in penalised], device, scores.dtype)[:, None]
    index = to_device(penalised, device)
    sub = scores.index_select(0, index) - frequency * counts - presence * (counts > 0).to(scores.dtype)
    return scores.index_copy(0, index, sub)
