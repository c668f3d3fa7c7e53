"""Attention over a paged KV cache, per sequence; no mask over the whole row.

A rank packs the tokens it computes this step (prompt chunks and decoding tokens of all its
sequences) into one row. :class:`PagedKVCache` is the cache object the model's attention layers
call: ``update`` writes the row's keys and values into their slots of the pool, then the
attention function (registered with transformers as ``hsdp_paged``) reads each sequence's keys
from its own blocks:

* decoding sequences (one query each) together: their keys gathered with ``index_select`` into
  [kv heads, sequences, longest context, dim], two batched matmuls and a float32 softmax;
* each prefill chunk alone, with SDPA over its own context and a [chunk, context] causal mask.

Memory per layer is O(the tokens attended), never O(row x all keys): the chunk cap
(``--max-batch-prefill-tokens``) bounds the largest mask.

A forward without the ``hsdp_paged`` keyword (an idle rank's one-token forward) gets SDPA.
Layers that need what this does not implement (sliding windows, logit soft-capping, attention
sinks) raise :class:`UnsupportedAttention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "hsdp_paged"
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux")


class UnsupportedAttention(NotImplementedError):
    """The model's attention asks for a variant the paged engine does not compute."""


class PagedLayout:
    """Where this step's queries sit in the row, and which cache slots each sequence attends to.

    A plain object, not a pytree, so FSDP2 passes it through its forward hooks untouched.
    """

    __slots__ = ("slots_T", "decode", "prefill")

    def __init__(self, slots_T: torch.Tensor, decode: _DecodeGroup | None, prefill: list[_Chunk]):
        self.slots_T = slots_T  # the cache slot each query token's key and value go to
        self.decode = decode
        self.prefill = prefill

    @classmethod
    def build(cls, items: list[tuple[int, int, list[int]]], block_size: int, device) -> PagedLayout:
        """``items``: per sequence in row order, (first position computed, tokens computed, its
        block table)."""
        slots, decode_rows, decode_ctx, decode_tables, prefill = [], [], [], [], []
        row = 0
        for start, count, blocks in items:
            table = torch.tensor(blocks, dtype=torch.long)
            slots.append(_slots_at(table, torch.arange(start, start + count), block_size))
            context = start + count
            if count == 1:
                decode_rows.append(row)
                decode_ctx.append(context)
                decode_tables.append(table)
            else:
                read_slots = _slots_at(table, torch.arange(context), block_size)
                prefill.append(_Chunk(row, start, count, read_slots.to(device), device))
            row += count
        decode = None
        if decode_rows:
            decode = _DecodeGroup(decode_rows, decode_ctx, decode_tables, block_size, device)
        return cls(torch.cat(slots).to(device), decode, prefill)


def _slots_at(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of ``positions`` of a sequence whose block table is ``table``."""
    return table[positions // block_size] * block_size + positions % block_size


class _DecodeGroup:
    __slots__ = ("rows_S", "slots_SL", "valid_SL")

    def __init__(self, rows, contexts, tables, block_size: int, device):
        longest = max(contexts)
        width = -(-longest // block_size)
        tables_SB = torch.zeros(len(tables), width, dtype=torch.long)
        for i, table in enumerate(tables):
            tables_SB[i, : min(len(table), width)] = table[:width]
        slots_SL = (tables_SB[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :longest]
        self.rows_S = torch.tensor(rows, dtype=torch.long, device=device)
        self.slots_SL = slots_SL.to(device)
        self.valid_SL = (torch.arange(longest)[None, :] < torch.tensor(contexts)[:, None]).to(device)


class _Chunk:
    __slots__ = ("row", "count", "slots_L", "mask_QL")

    def __init__(self, row: int, start: int, count: int, slots_L: torch.Tensor, device):
        self.row, self.count, self.slots_L = row, count, slots_L
        q_pos = torch.arange(start, start + count, device=device)
        self.mask_QL = torch.arange(slots_L.numel(), device=device)[None, :] <= q_pos[:, None]


class PagedKVCache:
    """Every layer's keys and values for one rank: [kv heads, num_blocks * block_size, head dim],
    allocated (and touched) once, so a budget that does not fit fails at startup, not mid-request.
    Duck-types the part of transformers' Cache that attention layers call."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (kv_heads, num_blocks * block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.layout: PagedLayout | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # [1, kv heads, T, d] -> this step's slots of the layer's pool; attention reads the pool
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if key_states.shape[1] != keys.shape[0] or key_states.shape[-1] != keys.shape[-1]:
            raise UnsupportedAttention(f"layer {layer_idx} has keys of shape {tuple(key_states.shape)}, the pool "
                                       f"[{keys.shape[0]} heads, dim {keys.shape[-1]}]")
        keys.index_copy_(1, self.layout.slots_T, key_states[0])
        values.index_copy_(1, self.layout.slots_T, value_states[0])
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions always come with the input


def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    hsdp_paged: PagedLayout | None = None, **kwargs):
    """An attention function for transformers' AttentionInterface: query [1, H, T, d]; key and
    value the layer's whole pool [Hkv, slots, d] (from :meth:`PagedKVCache.update`); returns
    ([1, T, H, d], None) like transformers' SDPA."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"{type(module).__name__} asks for {name}={kwargs[name]!r}, which the paged "
                                       "engine does not implement")
    if hsdp_paged is None:  # no cache: an idle rank's forward, or a plain call
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    heads, dim = query.shape[1], query.shape[3]
    scale = dim ** -0.5 if scaling is None else scaling
    query_HTd = query[0]
    out_THd = query.new_empty(query.shape[2], heads, dim)
    if hsdp_paged.decode is not None:
        _attend_decode(hsdp_paged.decode, query_HTd, key, value, scale, out_THd)
    for chunk in hsdp_paged.prefill:
        _attend_chunk(chunk, query_HTd, key, value, scale, out_THd)
    return out_THd.unsqueeze(0), None


def _attend_decode(group: _DecodeGroup, query_HTd, key_HNd, value_HNd, scale: float, out_THd) -> None:
    heads, _, dim = query_HTd.shape
    kv_heads = key_HNd.shape[0]
    groups = heads // kv_heads
    num_seqs, length = group.slots_SL.shape
    # queries [Hkv, S, G, d]: the G query heads sharing a key head, per sequence
    q = query_HTd.index_select(1, group.rows_S).view(kv_heads, groups, num_seqs, dim).transpose(1, 2)
    k = key_HNd.index_select(1, group.slots_SL.flatten()).view(kv_heads, num_seqs, length, dim)
    v = value_HNd.index_select(1, group.slots_SL.flatten()).view(kv_heads, num_seqs, length, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [Hkv, S, G, L]
    scores.masked_fill_(~group.valid_SL[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hkv, S, G, d]; head = kv_head * G + g
    out_THd.index_copy_(0, group.rows_S, out.permute(1, 0, 2, 3).reshape(num_seqs, heads, dim))


def _attend_chunk(chunk: _Chunk, query_HTd, key_HNd, value_HNd, scale: float, out_THd) -> None:
    q = query_HTd[:, chunk.row:chunk.row + chunk.count].unsqueeze(0)  # [1, H, Q, d]
    k = key_HNd.index_select(1, chunk.slots_L).unsqueeze(0)  # [1, Hkv, L, d]
    v = value_HNd.index_select(1, chunk.slots_L).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask_QL, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out_THd[chunk.row:chunk.row + chunk.count] = out[0].transpose(0, 1)


def use_paged_attention(model) -> None:
    """Register ``hsdp_paged`` and switch ``model`` (and its sub-configs) to it. Collective-free;
    every rank calls it the same way."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    text = model.config.get_text_config()
    if text is not model.config:
        text._attn_implementation = ATTN_IMPLEMENTATION
