"""Seeded sampling's independent reference: transformers' own model and logits processors, and
the draw that server/engine/sampling.py documents: token n of a request seeded s is the inverse
CDF of the processed distribution at one uniform number, ``torch.rand`` of a generator seeded
``token_seed(s, n)``. A seeded answer that equals this is right, not merely repeatable."""

from __future__ import annotations

import torch

from server.engine.sampling import token_seed


class _OpenAIPenalties:
    """OpenAI's presence and frequency penalties (transformers has neither), over the generated
    tokens only: ``logit[t] - frequency * count[t] - presence * (count[t] > 0)``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores[0])
        counts.index_add_(0, input_ids[0, self.prompt_len:], torch.ones(input_ids.shape[1] - self.prompt_len))
        return scores - (self.frequency * counts + self.presence * (counts > 0))[None]


def _draw(scores_V: torch.Tensor, seed: int, index: int) -> int:
    """The documented draw: the inverse CDF of softmax(scores) at the uniform number of a generator
    seeded ``token_seed(seed, index)``."""
    uniform = torch.rand((), generator=torch.Generator().manual_seed(token_seed(seed, index)))
    cdf_V = torch.softmax(scores_V.float(), dim=-1).cumsum(dim=-1)
    return min(int((cdf_V <= uniform * cdf_V[-1]).sum()), cdf_V.shape[0] - 1)


@torch.no_grad()
def sample_reference(model, prompt_ids: list[int], max_new_tokens: int, *, seed: int, eos_token_id: int | None = 0,
                     temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None, typical_p: float | None = None,
                     repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0) -> list[int]:
    """The tokens a request with these settings, seeded ``seed``, must get: the model's last logits
    through transformers' processors in ``generate``'s order, then the draw, ending at
    ``eos_token_id`` (None: never). The whole sequence is run again for each token (no cache, so no
    code of ours or generate's between the model and the processors), and nothing of the
    checkpoint's generation defaults applies: pass them."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    processors = LogitsProcessorList()
    if repetition_penalty not in (None, 1.0):
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if presence_penalty or frequency_penalty:
        processors.append(_OpenAIPenalties(len(prompt_ids), presence_penalty, frequency_penalty))
    if temperature not in (None, 1.0):
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if min_p:
        processors.append(MinPLogitsWarper(min_p))
    if typical_p is not None and typical_p < 1.0:
        processors.append(TypicalLogitsWarper(typical_p))
    ids = list(prompt_ids)
    for index in range(max_new_tokens):
        ids_1T = torch.tensor([ids])
        logits_1V = model(input_ids=ids_1T, use_cache=False).logits[:, -1].float()
        ids.append(_draw(processors(ids_1T, logits_1V)[0], seed, index))
        if ids[-1] == eos_token_id:
            break
    return ids[len(prompt_ids):]
