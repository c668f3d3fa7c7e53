"""Attention over a packed row, computed per sequence.

The engine packs every sequence of a rank into one row, so the model sees one "sequence" of T
queries and K cached keys with a block-causal mask. Plain SDPA over that row costs T x K: with
S sequences decoding, S queries each score all K keys of all S sequences, only to mask most
of them away, and that grows with the square of the batch. ``hsdp_packed`` regroups the row
per sequence instead (S x max queries x max keys of one sequence, decoding and prefilling
sequences apart), computes each group with two batched matmuls, and puts the outputs back in
row order. Same result, a fraction of the work.

The engine passes the layout as the ``hsdp_packed`` keyword of the model's forward; models
whose attention layers do not forward keyword arguments to the attention function never see
it, and get SDPA over the dense mask, as before.
"""

from __future__ import annotations

import torch

ATTN_IMPLEMENTATION = "hsdp_packed"
# Attention variants this function does not implement: those layers take transformers' SDPA.
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux")


class PackedLayout:
    """Where each sequence's queries and keys sit in a packed row (a plain object, not a pytree,
    so FSDP2 passes it through untouched).

    Sequences are grouped by what they do this step: those decoding (one query each) in one
    group, those prefilling (several) in another, so that a long prompt joining the batch does
    not pad every decoding sequence's queries to its length.
    """

    __slots__ = ("groups",)

    def __init__(self, q_seq_T, q_pos_T, k_seq_K, k_pos_K):
        """``*_seq``: each position's sequence index (0..S-1); ``*_pos``: its position in that
        sequence. Keys include the queries' own (the cache is updated before attention)."""
        num_seqs = int(torch.maximum(q_seq_T.max(), k_seq_K.max()).item()) + 1
        q_count_S = torch.bincount(q_seq_T, minlength=num_seqs)
        self.groups = []
        for members in (q_count_S == 1, q_count_S > 1):
            if not bool(members.any()):
                continue
            q_keep, k_keep = members[q_seq_T], members[k_seq_K]
            renumber = torch.cumsum(members, 0) - 1  # sequence index within the group
            self.groups.append(_Group(
                q_keep.nonzero().squeeze(1), renumber[q_seq_T[q_keep]], q_pos_T[q_keep],
                k_keep.nonzero().squeeze(1), renumber[k_seq_K[k_keep]], k_pos_K[k_keep],
                int(members.sum().item()),
            ))


class _Group:
    __slots__ = ("q_index_SQ", "q_valid_SQ", "k_index_SL", "allowed_S1QL")

    def __init__(self, q_rows, q_seq, q_pos, k_cols, k_seq, k_pos, num_seqs: int):
        q_slot_SQ, self.q_valid_SQ = _group(q_seq, q_pos, num_seqs)
        k_slot_SL, k_valid_SL = _group(k_seq, k_pos, num_seqs)
        q_pos_SQ, k_pos_SL = q_pos[q_slot_SQ], k_pos[k_slot_SL]
        allowed = k_valid_SL[:, None, :] & (k_pos_SL[:, None, :] <= q_pos_SQ[:, :, None])
        # padding queries attend to some key of their sequence, so that no row is all masked (NaN)
        allowed[:, :, 0] |= ~self.q_valid_SQ
        self.allowed_S1QL = allowed[:, None]
        self.q_index_SQ, self.k_index_SL = q_rows[q_slot_SQ], k_cols[k_slot_SL]


def _group(seq_N: torch.Tensor, pos_N: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, L] indices into N, each row one sequence's entries in position order (padded with 0),
    and which are real."""
    n = seq_N.numel()
    order = torch.argsort(seq_N * (int(pos_N.max().item()) + 1) + pos_N, stable=True)
    counts = torch.bincount(seq_N, minlength=num_seqs)
    starts = torch.cumsum(counts, 0) - counts
    seq_sorted = seq_N[order]
    slot = torch.arange(n, device=seq_N.device) - starts[seq_sorted]
    width = max(int(counts.max().item()), 1)
    index = torch.zeros(num_seqs, width, dtype=torch.long, device=seq_N.device)
    valid = torch.zeros(num_seqs, width, dtype=torch.bool, device=seq_N.device)
    index[seq_sorted, slot] = order
    valid[seq_sorted, slot] = True
    return index, valid


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     hsdp_packed: PackedLayout | None = None, **kwargs):
    """An attention function for transformers' AttentionInterface: query [1, H, T, d], key and
    value [1, Hkv, K, d]; returns ([1, T, H, d], None) like transformers' SDPA.

    Written out (two batched matmuls and a float32 softmax) rather than through
    ``F.scaled_dot_product_attention``, and gathered with ``index_select``: on the CPU, SDPA's
    kernel takes ~5 ms for a batch of one-token queries that this does in under 1 ms, and
    advanced indexing is 20x slower than ``index_select`` for the gather (measured with torch
    2.13, bf16, 32 sequences of 100 keys).
    """
    if hsdp_packed is None or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _, heads, _, dim = query.shape
    scale = dim ** -0.5 if scaling is None else scaling
    out_THd = query.new_empty(query.shape[2], heads, dim)
    for group in hsdp_packed.groups:
        _attend(group, query[0], key[0], value[0], scale, out_THd)
    return out_THd.unsqueeze(0), None


def _attend(group: _Group, query_HTd, key_HKd, value_HKd, scale: float, out_THd) -> None:
    heads, _, dim = query_HTd.shape
    kv_heads = key_HKd.shape[0]
    groups = heads // kv_heads
    num_seqs, q_len = group.q_index_SQ.shape
    k_len = group.k_index_SL.shape[1]
    # Heads-major, as index_select leaves them: keys [Hkv, S, L, d]; queries [Hkv, S, G*Q, d],
    # the G query heads that share a key head stacked on the query axis, so both matmuls are
    # plain batched matmuls over (Hkv, S) of contiguous operands
    q = query_HTd.index_select(1, group.q_index_SQ.flatten()).view(kv_heads, groups, num_seqs, q_len, dim)
    q = q.transpose(1, 2).reshape(kv_heads, num_seqs, groups * q_len, dim)
    k = key_HKd.index_select(1, group.k_index_SL.flatten()).view(kv_heads, num_seqs, k_len, dim)
    v = value_HKd.index_select(1, group.k_index_SL.flatten()).view(kv_heads, num_seqs, k_len, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [Hkv, S, G*Q, L]
    allowed = group.allowed_S1QL.expand(num_seqs, groups, q_len, k_len).reshape(num_seqs, groups * q_len, k_len)
    scores.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v).view(kv_heads, num_seqs, groups, q_len, dim)  # head = kv_head * G + g
    out_SQHd = out.permute(1, 3, 0, 2, 4).reshape(num_seqs * q_len, heads, dim)
    rows = group.q_valid_SQ.flatten().nonzero().squeeze(1)
    out_THd.index_copy_(0, group.q_index_SQ.flatten().index_select(0, rows), out_SQHd.index_select(0, rows))


def use_packed_attention(model) -> bool:
    """Switch ``model`` to ``hsdp_packed`` where it computes with SDPA or eager attention; returns
    whether it did. Collective-free; every rank should call it the same way."""
    from transformers import AttentionInterface

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return True
