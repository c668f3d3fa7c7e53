"""Attention kernels behind ``torch.library`` custom ops: one opaque call per layer.

``torch.ops.hsdp.paged_decode`` is the decode attention of :mod:`server.engine.attention` (every
decoding sequence's one query against its own keys in the paged pool). It is an op, not inline
tensor code, for two reasons:

* ``torch.compile`` does not trace into it. A compiled decode forward then sees one dynamic
  size, the number of sequences; each sequence's context length (which changes every step) is
  only a size of the op's inputs, never of anything the graph computes. Traced inline, the
  contexts' symbolic sizes through gathers, matmuls, masks and softmax cost torch's symbolic-shape
  machinery minutes per deep model at startup (``ShapeEnv.simplify``).
* A device's own kernel (a paged FlashAttention, FlexAttention) can stand behind the same
  signature without the model code or the compiled graph changing.

The implementation here is the engine's reference, in torch ops on any device: gather the
sequences' keys and values by slot ([kv heads, sequences, longest context, dim]), two batched
matmuls, a float32 softmax, with the layer's variant: a sliding window, logit soft-capping, sinks,
ALiBi (a per-head slope times the key's position added to the scores), its own scale, values of
another head dim than keys. Eager and compiled forwards call the same op,
so they compute attention with the same code.

On CPU the sequences are taken in groups of similar context (:func:`context_groups`), each
gathered to its own longest: one long sequence among short ones (a 1,000-token stream among 63 of
60) otherwise made every sequence of the step gather, copy and attend over 1,000 slots, 16x the
work, and a soak's throughput fell to a third for as long as such a stream ran. What a group
gathers is at most :data:`GROUP_SPREAD` times its sequences' own contexts (or
:data:`GROUP_FLOOR` slots each). On other devices the contexts stay on the device (reading them
would sync a step, and a captured graph cannot): one group, until a paged kernel stands here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.engine.cores import follow_threads
from shard_engine.ops import define_op

NO_WINDOW = 0
NO_SOFTCAP = 0.0
"""How "the layer has none" is spelled in the op's arguments (a schema has no optional scalars
that compile keeps constant as cheaply)."""


def probabilities(scores, valid, softcap: float | None, sinks_H, sinks_shape: tuple[int, ...]) -> torch.Tensor:
    """Softmax over float32 ``scores`` (keys last) where ``valid``, after soft-capping, with the
    sinks' extra logit per head (viewed as ``sinks_shape``, broadcast over the keys) taking its
    share, as the models' eager attention does."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid, float("-inf"))
    if sinks_H is None:
        return torch.softmax(scores, dim=-1)
    sinks = sinks_H.float().view(sinks_shape).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return torch.softmax(combined, dim=-1)[..., :-1]


GROUP_SPREAD = 2
"""A decode group's longest context is at most this times its shortest (above the floor)."""
GROUP_FLOOR = 256
"""Contexts up to this many slots count as this many when grouping: short sequences stay in one group."""


def context_groups(contexts: list[int]) -> list[list[int]] | None:
    """The rows of a decode step in groups of similar context, shortest first, each group's
    longest context at most :data:`GROUP_SPREAD` x its shortest's (contexts below
    :data:`GROUP_FLOOR` counted as it); None where they make one group."""
    floor = max(min(contexts), GROUP_FLOOR)
    if max(contexts) <= GROUP_SPREAD * floor:
        return None
    groups: list[list[int]] = []
    for row in sorted(range(len(contexts)), key=contexts.__getitem__):
        if not groups or contexts[row] > GROUP_SPREAD * floor:
            groups.append([])
            floor = max(contexts[row], GROUP_FLOOR)
        groups[-1].append(row)
    return groups


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         enable_gqa: bool = False, expand_heads: bool | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, with values narrower than the keys (multi-head latent
    attention: keys of kv_lora_rank + rope, values of kv_lora_rank; expanded, keys of nope + rope and
    values of v) widened to the keys' head dim with zeros on CPU, and the output cut back: torch's
    CPU flash kernel takes one head dim for all three and otherwise falls back to the unfused math
    path, 2-3x slower at MLA's dims (measured on 2 cores: a 512-query chunk over 2048 latents of 160,
    52 -> 19 ms; a decode of 16 sequences over 512, 0.82 -> 0.25 ms). The zero columns add nothing
    to the cut output.

    ``expand_heads`` (None: :func:`expands_heads` decides): grouped keys and values repeated to the
    query heads before the call instead of ``enable_gqa``. On CUDA no fused kernel takes a mask
    with ``enable_gqa`` (flash takes no mask, the memory-efficient kernel no grouped heads), so a
    masked prompt chunk would run in the math backend, its float32 scores [heads, queries, keys]
    whole (8.6 GB for an 8192-token chunk of 32 heads): expanded, the memory-efficient kernel takes
    it. Unmeasured: no GPU was lent when this was written (``benchmarks/gpu_check.py`` runs it)."""
    if expand_heads is None:
        expand_heads = expands_heads(q, k, mask, enable_gqa)
    if expand_heads:
        groups = q.shape[-3] // k.shape[-3]
        k, v, enable_gqa = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3), False
    width, value_dim = k.shape[-1], v.shape[-1]
    if q.device.type != "cpu" or value_dim >= width:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, width - value_dim)), attn_mask=mask, scale=scale,
                                         enable_gqa=enable_gqa)
    return out[..., :value_dim]


def expands_heads(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, enable_gqa: bool) -> bool:
    """Whether :func:`sdpa` repeats grouped keys and values to the query heads: on CUDA, for a masked
    call of more than one query a sequence (a prompt chunk's; a decode's scores are one row a head,
    cheaper in the math backend than the keys and values copied)."""
    return (q.device.type == "cuda" and enable_gqa and mask is not None and q.shape[-2] > 1
            and q.shape[-3] != k.shape[-3])


def alibi_bias(slopes_H: torch.Tensor, positions_L: torch.Tensor, valid, shape: tuple[int, ...],
               dtype: torch.dtype, scale: float) -> torch.Tensor:
    """ALiBi as an additive mask on the scaled scores: each head's slope (viewed as ``shape``,
    broadcast over the keys) times each key's position in its sequence, ``-inf`` where ``valid``
    (broadcastable; None: every key) is False. float32 slopes (Bloom, MPT): slope x position, added
    as it is; Bloom's and MPT's biases differ from this by a constant per query row (the query's or
    the context's last position), which the softmax cancels. bfloat16 slopes (Falcon-RW): the
    position and the product rounded to bfloat16 as that model computes them, and the bias scaled
    with the scores (x ``scale``)."""
    if slopes_H.dtype == torch.bfloat16:
        bias = (slopes_H.view(shape) * positions_L.to(torch.bfloat16)).float() * scale
    else:
        bias = slopes_H.float().view(shape) * positions_L.float()
    if valid is not None:
        bias = bias.masked_fill(~valid, float("-inf"))
    return bias.to(dtype)


def _paged_decode(query_HSd: torch.Tensor, key_HNd: torch.Tensor, value_HNd: torch.Tensor, slots_SL: torch.Tensor,
                  valid_SL: torch.Tensor, positions_L: torch.Tensor, contexts_S: torch.Tensor, scale: float,
                  window: int, softcap: float, sinks_H: torch.Tensor | None,
                  alibi_H: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: ``query_HSd`` [heads, sequences, d], one query per sequence at position
    context - 1; ``key_HNd``/``value_HNd`` a layer's whole pool [kv heads, slots, d / dv];
    ``slots_SL`` [S, L] the slots of each sequence's positions 0..L-1 (L its longest context),
    ``valid_SL`` which of them it has, ``positions_L`` = arange(L), ``contexts_S`` each one's
    context; ``window`` / ``softcap`` :data:`NO_WINDOW` / :data:`NO_SOFTCAP` where the layer has
    none; ``sinks_H`` one logit per head or None; ``alibi_H`` one ALiBi slope per head or None.
    Returns [S, heads, dv]; on CPU computed in :func:`context_groups`' groups."""
    follow_threads()  # inside a compiled step: the plan's threads (server.engine.cores)
    on_cpu = contexts_S.device.type == "cpu"
    contexts = contexts_S.tolist() if on_cpu and len(contexts_S) > 1 else None
    groups = context_groups(contexts) if contexts is not None else None
    if groups is None:
        # one sequence, or all of one context, has every slot valid: no mask to build or apply
        full = on_cpu and (contexts is None or min(contexts) == max(contexts))
        return _attend(query_HSd, key_HNd, value_HNd, slots_SL, None if full else valid_SL, positions_L, contexts_S,
                       scale, window, softcap, sinks_H, alibi_H)
    out = query_HSd.new_empty(query_HSd.shape[1], query_HSd.shape[0], value_HNd.shape[-1])
    for rows in groups:
        longest = contexts[rows[-1]]
        index = torch.tensor(rows, device=query_HSd.device)
        valid = None if contexts[rows[0]] == longest else valid_SL.index_select(0, index)[:, :longest]
        out[index] = _attend(query_HSd.index_select(1, index), key_HNd, value_HNd,
                             slots_SL.index_select(0, index)[:, :longest], valid,
                             positions_L[:longest], contexts_S.index_select(0, index), scale, window, softcap, sinks_H,
                             alibi_H)
    return out


def _attend(query_HSd, key_HNd, value_HNd, slots_SL, valid_SL, positions_L, contexts_S, scale: float, window: int,
            softcap: float, sinks_H, alibi_H=None) -> torch.Tensor:
    """:func:`_paged_decode` over one group: every sequence gathered to the group's longest context;
    ``valid_SL`` None where every sequence has all of it."""
    heads, num_seqs, dim = query_HSd.shape
    kv_heads, value_dim = key_HNd.shape[0], value_HNd.shape[-1]
    groups = heads // kv_heads
    q = query_HSd.view(kv_heads, groups, num_seqs, dim).transpose(1, 2)  # [Hkv, S, G, d]; head = kv_head * G + g
    slots = slots_SL.reshape(-1)  # index_select: 3.6 us a call where advanced indexing took 5.8
    k = key_HNd.index_select(1, slots).view(kv_heads, num_seqs, -1, dim)  # [Hkv, S, L, d]
    v = value_HNd.index_select(1, slots).view(kv_heads, num_seqs, -1, value_dim)
    valid = valid_SL
    if window != NO_WINDOW:
        in_window = positions_L[None, :] >= (contexts_S - window)[:, None]
        valid = in_window if valid is None else valid & in_window
    if softcap == NO_SOFTCAP and sinks_H is None:
        # one fused kernel (the prompt chunks' too) in place of seven ops: the host time of a decode step
        mask = None if valid is None else valid[None, :, None, :]
        if alibi_H is not None:  # the slopes' bias in the mask (SDPA adds a float mask to the scaled scores)
            mask = alibi_bias(alibi_H, positions_L, mask, (kv_heads, 1, groups, 1), q.dtype, scale)
        out = sdpa(q, k, v, mask, scale)
    else:  # soft-capping or sinks, which SDPA lacks: the models' eager arithmetic
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [Hkv, S, G, L]
        if alibi_H is not None:
            scores = scores + alibi_bias(alibi_H, positions_L, None, (kv_heads, 1, groups, 1), torch.float32,
                                        scale)
        if valid is None:
            valid = torch.ones_like(slots_SL, dtype=torch.bool)
        probs = probabilities(scores, valid[None, :, None, :], softcap if softcap != NO_SOFTCAP else None, sinks_H,
                              (kv_heads, 1, groups, 1))
        out = torch.matmul(probs.to(v.dtype), v)  # [Hkv, S, G, dv]
    # contiguous: the strides the fake implementation promises (a reshape may return a view)
    return out.permute(1, 0, 2, 3).reshape(num_seqs, heads, value_dim).contiguous()


def decode_one(query_HSd, key_HNd, value_HNd, slots_SL, positions_L, contexts_S, scale: float, window: int,
               softcap: float, sinks_H, alibi_H=None) -> torch.Tensor:
    """:func:`_paged_decode` of one sequence (``slots_SL`` [1, its context]: every slot valid) in
    plain torch ops, for a compiled graph of one sequence to trace (``server.engine.attention``:
    its gather and attention then run in the graph's code, not through the op's Python)."""
    return _attend(query_HSd, key_HNd, value_HNd, slots_SL, None, positions_L, contexts_S, scale, window, softcap,
                   sinks_H, alibi_H)


def _paged_decode_fake(query_HSd, key_HNd, value_HNd, slots_SL, valid_SL, positions_L, contexts_S, scale, window,
                       softcap, sinks_H, alibi_H=None):
    heads, num_seqs, _ = query_HSd.shape
    return query_HSd.new_empty(num_seqs, heads, value_HNd.shape[-1])


paged_decode = define_op(
    "paged_decode(Tensor query_HSd, Tensor key_HNd, Tensor value_HNd, Tensor slots_SL, Tensor valid_SL, "
    "Tensor positions_L, Tensor contexts_S, float scale, int window, float softcap, Tensor? sinks_H, "
    "Tensor? alibi_H=None) -> Tensor",
    _paged_decode, _paged_decode_fake)
