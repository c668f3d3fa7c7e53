"""Turn one sequence's logits into its next token, with transformers' logits processors."""

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

    @property
    def samples(self) -> bool:
        # As in text-generation-inference: sampling when asked, or when any warper is active.
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or (self.top_k is not None and self.top_k > 0)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.min_p is not None and self.min_p > 0.0)
        )


def build_logits_processors(params: SamplingParams):
    """transformers' processors for ``params``, in the order ``generate`` applies them."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.samples:
        if params.temperature is not None and params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None and params.top_k > 0:
            processors.append(TopKLogitsWarper(top_k=params.top_k))
        if params.top_p is not None and params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p))
        if params.min_p is not None and params.min_p > 0.0:
            processors.append(MinPLogitsWarper(min_p=params.min_p))
    return processors


class TokenSelector:
    """Per-sequence next-token choice: greedy, or seeded sampling that replays exactly."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.processors = build_logits_processors(params)
        self.generator = None
        if params.samples:
            self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)

    def select(self, logits_V: torch.Tensor, ids: list[int]) -> tuple[int, float, list[tuple[int, float]]]:
        """The next token, its log-probability under the model (before processors), and the
        ``top_logprobs`` most likely tokens with theirs."""
        logits_1V = logits_V.float().unsqueeze(0)
        scores_1V = logits_1V
        if self.processors:  # only they read the sequence so far (the repetition penalty)
            scores_1V = self.processors(torch.tensor([ids], device=logits_V.device), logits_1V)
        probs_1V = torch.softmax(scores_1V, dim=-1) if self.generator is not None else None
        if probs_1V is not None and torch.isfinite(probs_1V).all():
            token = int(torch.multinomial(probs_1V.cpu(), 1, generator=self.generator))
        else:
            # Greedy, or a distribution degenerate past float range (temperature -> 0 and the like,
            # whose limit is greedy): the most likely token under the model.
            token = int(torch.argmax(logits_1V if probs_1V is not None else scores_1V, dim=-1))
        logprobs_V = torch.log_softmax(logits_1V[0], dim=-1)
        top: list[tuple[int, float]] = []
        if self.params.top_logprobs:
            values, indices = torch.topk(logprobs_V, self.params.top_logprobs)
            top = list(zip(indices.tolist(), values.tolist()))
        return token, float(logprobs_V[token]), top
