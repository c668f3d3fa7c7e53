"""The per-rank decoding engine: the sequences this rank owns and one forward per step.

Every rank runs exactly one forward per step that has work anywhere in the group, because the
FSDP all-gathers inside forward are collectives. A rank computes only its own sequences: all of
them packed into one row (no padding), each token attending to its own sequence's past through
a block-causal mask, so prompts being prefilled and sequences decoding share one forward. A rank
with nothing to do runs a one-token forward to keep the all-gathers matched.
The engine knows nothing of HTTP or of the control channel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from server.attention import PackedLayout, use_packed_attention
from server.sampling import SamplingParams, TokenSelector


@dataclass
class NewSequence:
    seq_id: int
    rank: int  # the rank that owns and computes it
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class StepPlan:
    """What rank 0 decided for one step; every rank receives the same plan."""

    add: list[NewSequence] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    forward: bool = False  # some rank owns a sequence: every rank enters forward
    shutdown: bool = False


@dataclass
class TokenResult:
    seq_id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None  # choosing this sequence's token failed; the sequence is dropped


@dataclass
class StepResult:
    rank: int
    tokens: list[TokenResult]
    active: int  # sequences this rank holds after the step
    sequences_started: int  # cumulative, for the per-rank spread
    tokens_computed: int  # cumulative tokens this rank ran through the model
    pid: int  # the rank's process, for operators


class _Sequence:
    def __init__(self, new: NewSequence):
        self.seq_id = new.seq_id
        self.ids = list(new.prompt_ids)
        self.pending = list(new.prompt_ids)  # tokens not yet in the KV cache
        self.selector = TokenSelector(new.params)


class RankEngine:
    def __init__(self, model: nn.Module, device: torch.device, rank: int):
        self.model, self.device, self.rank = model, device, rank
        self.sequences: dict[int, _Sequence] = {}
        self.cache = None
        # Per KV-cache column: the sequence it belongs to and its position in that sequence.
        self.col_seq_C = torch.empty(0, dtype=torch.long, device=device)
        self.col_pos_C = torch.empty(0, dtype=torch.long, device=device)
        self.sequences_started = 0
        self.tokens_computed = 0
        param = next(model.parameters())
        self.mask_dtype = param.dtype if param.is_floating_point() else torch.float32
        self.forwards = 0
        self.fault_at = _injected_fault(rank)
        self.packed_attention = use_packed_attention(model)

    def step(self, plan: StepPlan) -> StepResult:
        self._remove(plan.remove)
        for new in plan.add:
            if new.rank == self.rank:
                self.sequences[new.seq_id] = _Sequence(new)
                self.sequences_started += 1
        tokens: list[TokenResult] = []
        if plan.forward:
            self.forwards += 1
            if self.fault_at is not None and self.forwards >= self.fault_at:
                raise RuntimeError(f"injected fault in forward {self.forwards} on rank {self.rank}")
            tokens = self._forward() if self.sequences else self._idle_forward()
        return StepResult(
            self.rank, tokens, len(self.sequences), self.sequences_started, self.tokens_computed, os.getpid()
        )

    def _remove(self, seq_ids: list[int]) -> None:
        gone = [s for s in seq_ids if self.sequences.pop(s, None) is not None]
        if not gone:
            return
        if not self.sequences:
            self.cache = None
            self.col_seq_C = self.col_seq_C[:0]
            self.col_pos_C = self.col_pos_C[:0]
            return
        keep_C = ~torch.isin(self.col_seq_C, torch.tensor(gone, device=self.device))
        if self.cache is not None:
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys = layer.keys[:, :, keep_C]
                    layer.values = layer.values[:, :, keep_C]
        self.col_seq_C, self.col_pos_C = self.col_seq_C[keep_C], self.col_pos_C[keep_C]

    @torch.no_grad()
    def _idle_forward(self) -> list[TokenResult]:
        # Matches the other ranks' all-gathers; the result is discarded.
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return []

    @torch.no_grad()
    def _forward(self) -> list[TokenResult]:
        seqs = list(self.sequences.values())
        ids, seq_of, pos, last = [], [], [], []
        for s in seqs:
            start = len(s.ids) - len(s.pending)
            ids += s.pending
            seq_of += [s.seq_id] * len(s.pending)
            pos += range(start, len(s.ids))
            last.append(len(ids) - 1)
        ids_1T = torch.tensor([ids], device=self.device)
        q_seq_T = torch.tensor(seq_of, device=self.device)
        q_pos_T = torch.tensor(pos, device=self.device)
        k_seq_K = torch.cat([self.col_seq_C, q_seq_T])
        k_pos_K = torch.cat([self.col_pos_C, q_pos_T])
        allowed_TK = (q_seq_T[:, None] == k_seq_K[None, :]) & (k_pos_K[None, :] <= q_pos_T[:, None])
        mask_11TK = torch.zeros(allowed_TK.shape, dtype=self.mask_dtype, device=self.device)
        mask_11TK.masked_fill_(~allowed_TK, torch.finfo(self.mask_dtype).min)
        extra = {}
        if self.packed_attention:
            # the same structure by sequence index (0..S-1) rather than sequence id
            ids_sorted, order = torch.sort(torch.tensor([s.seq_id for s in seqs], device=self.device))
            q_index_T = order[torch.searchsorted(ids_sorted, q_seq_T)]
            k_index_K = order[torch.searchsorted(ids_sorted, k_seq_K)]
            extra["hsdp_packed"] = PackedLayout(q_index_T, q_pos_T, k_index_K, k_pos_K)
        out = self.model(
            input_ids=ids_1T,
            position_ids=q_pos_T.unsqueeze(0),
            attention_mask=mask_11TK[None, None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=torch.tensor(last, device=self.device),
            **extra,
        )
        self.cache = out.cache
        self.col_seq_C, self.col_pos_C = k_seq_K, k_pos_K
        self.tokens_computed += len(ids)
        logits_SV = out.logits[0]
        results, failed = [], []
        for s, logits_V in zip(seqs, logits_SV):
            try:
                token, logprob, top = s.selector.select(logits_V, s.ids)
            except Exception as e:  # noqa: BLE001 - one sequence's bad parameters must not stop the group
                results.append(TokenResult(s.seq_id, -1, 0.0, error=f"{type(e).__name__}: {e}"))
                failed.append(s.seq_id)
                continue
            s.ids.append(token)
            s.pending = [token]
            results.append(TokenResult(s.seq_id, token, logprob, top))
        self._remove(failed)
        return results


FAULT_ENV = "HSDP_INJECT_FORWARD_FAULT"


def _injected_fault(rank: int) -> int | None:
    """Fault injection for failure tests: ``HSDP_INJECT_FORWARD_FAULT=RANK:N`` makes that rank's
    N-th forward (counting one-token idle forwards) raise, as an out-of-memory error would."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    target, _, count = spec.partition(":")
    return int(count or 1) if int(target) == rank else None
