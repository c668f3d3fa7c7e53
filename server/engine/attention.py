"""Attention over a paged KV cache, per sequence; no mask over the whole row.

A rank packs the tokens it computes this step (prompt chunks and decoding tokens of all its
sequences) into one row. :class:`PagedKVCache` is the cache object the model's attention layers
call: ``update`` writes the row's keys and values into their slots of the pool, then the
attention function (registered with transformers as ``hsdp_paged``) reads each sequence's keys
from its own blocks:

* decoding sequences (one query each) together, in one op (``torch.ops.hsdp.paged_decode``,
  :mod:`server.engine.kernels`, which a compiled forward does not trace into): their keys
  gathered by slot into [kv heads, sequences, longest context, dim] (on CPU in groups of similar
  context), two batched matmuls and a float32 softmax;
* each prefill chunk alone, with SDPA over its own context and a [chunk, context] causal mask.

Memory per layer is O(the tokens attended), never O(row x all keys): the chunk cap
(``--max-batch-prefill-tokens``) bounds the largest mask.

Each layer's own variant, read from what the model's attention module passes (as its eager
attention reads it): a sliding window (``sliding_window``: a query at position q sees keys at
positions above q - window), logit soft-capping (``softcap``: scores become
softcap * tanh(scores / softcap)), attention sinks (``s_aux``: one extra logit per head that takes
probability mass and contributes no value), ALiBi (``alibi_slopes``: one slope per head, times the
key's position, added to the scores, in the slopes' dtype: ``server.engine.kernels.alibi_bias``;
passed by the adapters of :mod:`server.engine.adapters`), the
module's own ``scaling``, and keys and values of different head dims (multi-head latent attention). Chunks that need soft-capping or sinks are
computed without SDPA, which has neither.

Under a compiled layer's open graph (:func:`whole_step_op`) the whole of it is one opaque op,
``torch.ops.hsdp.paged_step``, which reads the step's layout (:func:`step_layout`) when it runs.

A forward without the ``hsdp_paged`` keyword (an idle rank's one-token forward) gets SDPA.
A layer asking for anything else raises :class:`UnsupportedAttention`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from server.engine.cores import follow_threads
from server.engine.kernels import (NO_SOFTCAP, NO_WINDOW, alibi_bias, decode_one, paged_decode, probabilities,
                                   sdpa)
from shard_engine.ops import define_op

ATTN_IMPLEMENTATION = "hsdp_paged"
EXPLICIT_SCORES_BYTES = 64 << 20
"""Chunks computed without SDPA (soft-capping, sinks) take their queries in blocks whose float32
scores stay under this, so a long prompt of a many-headed model does not hold heads x chunk x
context floats several times over."""
LAYER_POOLS = "hsdp_layer_pools"
"""The keyword a decoder layer's forward may carry its own (keys, values) pools in, down to the
attention function, which then writes the step's keys and values itself (the cache's
``pools_in_kwargs``): how a compiled layer (:mod:`server.engine.compiled`, ``--compile-region
layer``) reaches its pools as inputs of its graph, one graph for every layer, rather than by its
``layer_idx``, a constant that would make a graph of each."""
LAYER_STATES = "hsdp_layer_states"
"""The keyword a compiled layer of a stateful model gets its states by (:class:`LayerPools`)."""
_UNSUPPORTED_KWARGS = ()  # every keyword an attention module passes is implemented or ignored
_one_decode_inline = False  # within one_decode_inline()
_whole_step_op = False  # within whole_step_op()
_step_layout: PagedLayout | None = None  # within step_layout(): what torch.ops.hsdp.paged_step attends by


@contextlib.contextmanager
def one_decode_inline() -> Iterator[None]:
    """Within, a forward that dynamo traces and whose step decodes one sequence (a static batch of
    one) computes that sequence's attention in torch ops the graph holds (``kernels.decode_one``)
    instead of calling ``torch.ops.hsdp.paged_decode``: its gather and attention then run as the
    graph's generated code, not as the op's Python (~10 aten calls, ~40 us a layer on these cores).
    For the layers' graphs (``server.engine.compiled``, ``--compile-region layer``), which trace
    one layer: the context is a symbolic size of one layer's graph there, not of a whole model's
    (what made symbolic contexts cost minutes), and a sequence alone needs no context groups."""
    global _one_decode_inline
    _one_decode_inline = True
    try:
        yield
    finally:
        _one_decode_inline = False


@contextlib.contextmanager
def whole_step_op() -> Iterator[None]:
    """Within, a forward that dynamo traces computes each layer's attention as one opaque op over
    the whole step, ``torch.ops.hsdp.paged_step``, which takes its layout (decoding sequences and
    prompt chunks alike) from :func:`step_layout` when it runs: the graph then holds nothing of a
    step's make-up but its rows, and serves decode steps and steps that carry prompt chunks alike.
    For the layers' open graph (``server.engine.compiled``: its rows are symbolic)."""
    global _whole_step_op
    _whole_step_op = True
    try:
        yield
    finally:
        _whole_step_op = False


@contextlib.contextmanager
def step_layout(layout: PagedLayout | None) -> Iterator[None]:
    """Within, ``torch.ops.hsdp.paged_step`` attends by ``layout`` (the step's)."""
    global _step_layout
    previous, _step_layout = _step_layout, layout
    try:
        yield
    finally:
        _step_layout = previous


class UnsupportedAttention(NotImplementedError):
    """The model's attention asks for a variant the paged engine does not compute."""


class PagedLayout:
    """Where this step's queries sit in the row, and which cache slots each sequence attends to.

    A plain object, not a pytree, so FSDP2 passes it through its forward hooks untouched.
    """

    __slots__ = ("slots_T", "decode", "prefill", "state_slots_S", "state_previous_S", "state_slots_chunks")

    def __init__(self, slots_T: torch.Tensor, decode: _DecodeGroup | None, prefill: list[_Chunk]):
        self.slots_T = slots_T  # the cache slot each query token's key and value go to
        self.decode = decode
        self.prefill = prefill
        # a stateful model's (server.engine.state): each decoding sequence's state slot and whether it has a
        # state yet (its token is not its first), each prompt chunk's slot ([1])
        self.state_slots_S: torch.Tensor | None = None
        self.state_previous_S: torch.Tensor | None = None
        self.state_slots_chunks: list[torch.Tensor] = []

    @classmethod
    def build(cls, items: list[tuple[int, int, list[int]]], block_size: int, device,
              state_slots: list[int] | None = None, image_spans: list[list[tuple[int, int]]] | None = None
              ) -> PagedLayout:
        """``items``: per sequence in row order, (first position computed, tokens computed, its
        block table); ``state_slots``: each one's state slot, for a stateful model; ``image_spans``:
        each one's images [start, end) among its computed tokens whose tokens attend to one another
        both ways (Gemma 3; ``server.engine.multimodal``), each wholly within its context."""
        slots, decode_rows, decode_ctx, decode_tables, prefill = [], [], [], [], []
        decode_state, decode_previous, chunk_state = [], [], []
        row = 0
        for i, (start, count, blocks) in enumerate(items):
            table = torch.tensor(blocks, dtype=torch.long)
            slots.append(_slots_at(table, torch.arange(start, start + count), block_size))
            context = start + count
            if count == 1:
                decode_rows.append(row)
                decode_ctx.append(context)
                decode_tables.append(table)
                if state_slots is not None:
                    decode_state.append(state_slots[i])
                    decode_previous.append(start > 0)
            else:
                read_slots = _slots_at(table, torch.arange(context), block_size)
                prefill.append(_Chunk(row, start, count, read_slots.to(device), device,
                                      image_spans[i] if image_spans else None))
                if state_slots is not None:
                    chunk_state.append(torch.tensor([state_slots[i]], device=device))
            row += count
        decode = None
        if decode_rows:
            decode = _DecodeGroup(decode_rows, decode_ctx, decode_tables, block_size, device)
        layout = cls(torch.cat(slots).to(device), decode, prefill)
        if state_slots is not None:
            layout.state_slots_S = torch.tensor(decode_state, dtype=torch.long, device=device)
            layout.state_previous_S = torch.tensor(decode_previous, dtype=torch.bool, device=device)
            layout.state_slots_chunks = chunk_state
        return layout


def _slots_at(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of ``positions`` of a sequence whose block table is ``table``."""
    return table[positions // block_size] * block_size + positions % block_size


class _DecodeGroup:
    __slots__ = ("rows_S", "slots_SL", "valid_SL", "positions_L", "contexts_S")

    def __init__(self, rows, contexts, tables, block_size: int, device):
        longest = max(contexts)
        width = -(-longest // block_size)
        tables_SB = torch.zeros(len(tables), width, dtype=torch.long)
        for i, table in enumerate(tables):
            tables_SB[i, : min(len(table), width)] = table[:width]
        positions = torch.arange(longest)  # a fresh [S, L] tensor: the same strides at every S (compiled guards)
        slots_SL = tables_SB[:, positions // block_size] * block_size + positions % block_size
        self.rows_S = torch.tensor(rows, dtype=torch.long, device=device)
        self.slots_SL = slots_SL.to(device)
        self.valid_SL = (torch.arange(longest)[None, :] < torch.tensor(contexts)[:, None]).to(device)
        self.positions_L = torch.arange(longest, device=device)
        self.contexts_S = torch.tensor(contexts, device=device)


class _Chunk:
    __slots__ = ("row", "count", "slots_L", "mask_QL", "q_pos", "k_pos")

    def __init__(self, row: int, start: int, count: int, slots_L: torch.Tensor, device,
                 image_spans: list[tuple[int, int]] | None = None):
        self.row, self.count, self.slots_L = row, count, slots_L
        self.q_pos = torch.arange(start, start + count, device=device)
        self.k_pos = torch.arange(slots_L.numel(), device=device)
        self.mask_QL = self.k_pos[None, :] <= self.q_pos[:, None]
        for first, end in image_spans or ():  # an image's tokens see the whole image
            if end > slots_L.numel():
                raise ValueError(f"an image's tokens {first}..{end - 1} reach past the chunk's context")
            inside_Q = (self.q_pos >= first) & (self.q_pos < end)
            inside_L = (self.k_pos >= first) & (self.k_pos < end)
            self.mask_QL = self.mask_QL | (inside_Q[:, None] & inside_L[None, :])

    def mask(self, window: int | None) -> torch.Tensor:
        """[Q, L]: causal (and both ways within an image whose tokens do so), and within ``window``
        positions where the layer has one."""
        if window is None:
            return self.mask_QL
        return self.mask_QL & (self.k_pos[None, :] > (self.q_pos - window)[:, None])


class PagedKVCache:
    """Every layer's keys and values for one rank: [kv heads, (num_blocks + 1) * block_size, head
    dim], allocated (and touched) once, so a budget that does not fit fails at startup, not
    mid-request. Blocks 0..num_blocks-1 are the scheduler's; the one after them,
    ``scratch_block``, is nobody's: the padding rows of a compiled step write their keys there
    (:mod:`server.engine.compiled`). Duck-types the part of transformers' Cache that attention
    layers call."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_head_dim: int | None = None,
                 values_in_keys: bool = False, kv_layers: tuple[int, ...] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        value_dim = value_head_dim or head_dim

        def pool(layer: int, dim: int) -> torch.Tensor:  # a hybrid's stateful layers cache nothing
            cached = kv_layers is None or layer in kv_layers
            return torch.zeros((kv_heads, slots if cached else 0, dim), dtype=dtype, device=device)

        self.keys = [pool(layer, head_dim) for layer in range(num_layers)]
        # multi-head latent attention (server.engine.mla): the values are the keys' first value_dim, no copy
        self.values_in_keys = values_in_keys
        self.values = ([k[..., :value_dim] for k in self.keys] if values_in_keys else
                       [pool(layer, value_dim) for layer in range(num_layers)])
        self.layout: PagedLayout | None = None
        self.states = None  # a stateful model's server.engine.state.StatePool
        self.pools_in_kwargs = False  # set by a forward whose layers pass their pools as LAYER_POOLS

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + ([] if self.values_in_keys else self.values))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # [1, kv heads, T, d] -> this step's slots of the layer's pool; attention reads the pool.
        # Where the pools come with the attention's keywords (compiled layers: LAYER_POOLS), the
        # attention function writes them, and the states pass through untouched. An MLA layer
        # passes its latents and rope keys: the pool's keys are the two side by side
        if self.pools_in_kwargs:
            return key_states, value_states
        if self.values_in_keys:
            return _write_latent_step(layer_idx, self.layout, torch.cat((key_states, value_states), dim=-1),
                                      self.keys[layer_idx], self.values[layer_idx].shape[-1])
        return _write_step(layer_idx, self.layout, key_states, value_states, self.keys[layer_idx],
                           self.values[layer_idx])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions always come with the input

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0  # (a model that sizes a bias by it: its attention adapter ignores the bias)


class LayerPools:
    """One layer's pools (and states) with the step's layout, in place of the cache, inside a
    compiled layer's graph, which gets them as its inputs (:data:`LAYER_POOLS`, :data:`LAYER_STATES`)
    rather than finding them by the layer's index (a constant: a graph for each layer): for a
    decoder layer that does not pass its keywords down to its attention (the adapted families'
    blocks: :mod:`server.engine.adapters`), whose attention writes the pools through :meth:`update`;
    and for a stateful model's layers, whose stateful modules read and write ``states`` (a
    :class:`server.engine.state.LayerStates`)."""

    def __init__(self, layout: PagedLayout, pools: tuple[torch.Tensor, ...], states=None):
        self.layout, self.pools, self.states = layout, pools, states

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if len(self.pools) == 1:  # an MLA layer's latents and rope keys, as PagedKVCache.update writes them
            return _write_latent_step(layer_idx, self.layout, torch.cat((key_states, value_states), dim=-1),
                                      self.pools[0], key_states.shape[-1])
        return _write_step(layer_idx, self.layout, key_states, value_states, *self.pools)


def is_paged(cache) -> bool:
    """Whether ``cache`` is the engine's (a rank's :class:`PagedKVCache`, or a compiled layer's
    :class:`LayerPools`) with a step's layout: a forward inside an engine step, not a plain call."""
    return isinstance(cache, (PagedKVCache, LayerPools)) and cache.layout is not None


def _write_latent_step(layer, layout: PagedLayout, key_states, keys, value_dim: int):
    """An MLA layer's step ([1, 1, T, d]: latents and rope keys side by side) into its one pool;
    returns the pool and its values (its first ``value_dim``: the latents), a view."""
    if key_states.shape[1] != keys.shape[0] or key_states.shape[-1] != keys.shape[-1]:
        raise UnsupportedAttention(f"layer {layer} has latent keys of shape {tuple(key_states.shape)}, the pool "
                                   f"[{keys.shape[0]} heads, dim {keys.shape[-1]}]")
    keys.index_copy_(1, layout.slots_T, key_states[0])
    return keys, keys[..., :value_dim]


def _write_step(layer, layout: PagedLayout, key_states, value_states, keys, values):
    """This step's keys and values ([1, kv heads, T, d]) into their slots of a layer's pools; returns
    the pools."""
    if (key_states.shape[1] != keys.shape[0] or key_states.shape[-1] != keys.shape[-1]
            or value_states.shape[-1] != values.shape[-1]):
        raise UnsupportedAttention(
            f"layer {layer} has keys of shape {tuple(key_states.shape)} and values of "
            f"{tuple(value_states.shape)}, the pool [{keys.shape[0]} heads, key dim {keys.shape[-1]}, value dim "
            f"{values.shape[-1]}]")
    keys.index_copy_(1, layout.slots_T, key_states[0])
    values.index_copy_(1, layout.slots_T, value_states[0])
    return keys, values


def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    hsdp_paged: PagedLayout | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, s_aux: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None, **kwargs):
    """An attention function for transformers' AttentionInterface: query [1, H, T, d]; key and
    value the layer's whole pool [Hkv, slots, d] (from :meth:`PagedKVCache.update`); returns
    ([1, T, H, dv], None) like transformers' SDPA. A multi-head latent attention module's query is
    absorbed into its latents' space first and its output projected back after
    (:mod:`server.engine.mla`)."""
    mla = getattr(module, "hsdp_mla", None)
    if alibi_slopes is not None:
        if hsdp_paged is None or mla is not None:
            raise UnsupportedAttention(f"{type(module).__name__}: ALiBi is computed over the paged cache only")
        kwargs["alibi_slopes"] = alibi_slopes
    if mla is None:
        return _paged_attention(module, query, key, value, attention_mask, dropout, scaling, hsdp_paged,
                                sliding_window, softcap, s_aux, **kwargs)
    if hsdp_paged is not None and hsdp_paged.prefill and key.dim() == 3 and not torch.compiler.is_compiling() \
            and sliding_window is None and softcap is None and s_aux is None:
        # an eager step with prompt chunks (the cache wrote them and passed its pool)
        _refuse_unsupported(module, kwargs)
        return _mla_step(mla, hsdp_paged, query[0], key, query.shape[-1] ** -0.5 if scaling is None else scaling), None
    query, weight = mla.query(query)
    if hsdp_paged is None and key.dim() == 4:  # unpaged: the one latent head for every query head
        key, value = key.expand(-1, query.shape[1], -1, -1), value.expand(-1, query.shape[1], -1, -1)
    out, weights = _paged_attention(module, query, key, value, attention_mask, dropout, scaling, hsdp_paged,
                                    sliding_window, softcap, s_aux, **kwargs)
    return mla.output(out, weight), weights


def _refuse_unsupported(module, kwargs) -> None:
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"{type(module).__name__} asks for {name}={kwargs[name]!r}, which the paged "
                                       "engine does not implement")


def _mla_step(mla, layout: PagedLayout, query_HTd, latents_1Nc, scale: float) -> torch.Tensor:
    """A multi-head latent attention layer's step that carries prompt chunks, [1, T, H, v], over
    its pool of latents ``latents_1Nc`` [1, slots, kv_lora_rank + rope]: the decode rows absorbed,
    each chunk expanded where that costs it less (:meth:`server.engine.mla.Absorbed.expands`)."""
    heads, tokens = query_HTd.shape[:2]
    out_THv = query_HTd.new_empty(tokens, heads, mla.v)
    weight = mla.up_weight(query_HTd.dtype)
    plain = _Variant(None, None, None)

    def absorbed(q_HSd, k_1Lc, attend) -> torch.Tensor:  # [S, H, v]
        q, _ = mla.query(q_HSd.unsqueeze(0), weight)
        return mla.output(attend(q[0], k_1Lc, k_1Lc[..., :mla.rank]).unsqueeze(0), weight)[0]

    if layout.decode is not None:
        group = layout.decode
        out_THv.index_copy_(0, group.rows_S, absorbed(
            query_HTd.index_select(1, group.rows_S), latents_1Nc,
            lambda q, k, v: _decode_out(group, q, k, v, scale, plain)))
    for chunk in layout.prefill:
        q_HQd = query_HTd[:, chunk.row:chunk.row + chunk.count]
        latents_1Lc = latents_1Nc.index_select(1, chunk.slots_L)
        if mla.expands(chunk.count, latents_1Lc.shape[1]):
            keys, values = mla.expand(latents_1Lc)
            out = _chunk_out(chunk, q_HQd.unsqueeze(0), keys, values, scale, plain)
        else:
            out = absorbed(q_HQd, latents_1Lc, lambda q, k, v: _chunk_out(chunk, q.unsqueeze(0), k, v, scale, plain))
        out_THv[chunk.row:chunk.row + chunk.count] = out
    return out_THv.unsqueeze(0)


def _paged_attention(module, query, key, value, attention_mask, dropout, scaling, hsdp_paged, sliding_window,
                     softcap, s_aux, alibi_slopes=None, **kwargs):
    _refuse_unsupported(module, kwargs)
    pools = kwargs.pop(LAYER_POOLS, None)
    if pools is not None:  # the cache passed this step's keys and values through: they go to these pools
        layer = getattr(module, "layer_idx", type(module).__name__)
        if len(pools) == 1:  # an MLA layer's one pool (its values a view of it, made here, not an input)
            key, value = _write_latent_step(layer, hsdp_paged, key, pools[0], value.shape[-1])
        else:
            key, value = _write_step(layer, hsdp_paged, key, value, *pools)
    if hsdp_paged is None:  # no cache: an idle rank's forward, or a plain call
        return _unpaged(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, **kwargs)
    if key.dim() != 3:  # [1, kv heads, T, d]: the cache passed them through, and no pools came
        raise UnsupportedAttention(f"{type(module).__name__} got this step's keys without its pools: its layer does "
                                   f"not pass its keywords down to the attention ({LAYER_POOLS})")
    heads, dim = query.shape[1], query.shape[3]
    scale = dim ** -0.5 if scaling is None else scaling
    if _whole_step_op and torch.compiler.is_compiling():
        out_THd = paged_step(query[0], key, value, float(scale),
                             int(sliding_window) if sliding_window is not None else NO_WINDOW,
                             float(softcap) if softcap is not None else NO_SOFTCAP, s_aux, alibi_slopes)
        return out_THd.unsqueeze(0), None
    return _attend_step(hsdp_paged, query[0], key, value, scale,
                        _Variant(sliding_window, softcap, s_aux, alibi_slopes)), None


def _attend_step(layout: PagedLayout, query_HTd, key_HNd, value_HNd, scale: float, variant: _Variant) -> torch.Tensor:
    """Every sequence's attention of a step: [1, T, H, dv]."""
    out_THd = query_HTd.new_empty(query_HTd.shape[1], query_HTd.shape[0], value_HNd.shape[-1])
    if layout.decode is not None:
        _attend_decode(layout.decode, query_HTd, key_HNd, value_HNd, scale, variant, out_THd)
    for chunk in layout.prefill:
        _attend_chunk(chunk, query_HTd, key_HNd, value_HNd, scale, variant, out_THd)
    return out_THd.unsqueeze(0)


def _paged_step(query_HTd: torch.Tensor, key_HNd: torch.Tensor, value_HNd: torch.Tensor, scale: float, window: int,
                softcap: float, sinks_H: torch.Tensor | None, alibi_H: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.hsdp.paged_step``: :func:`_attend_step` by the layout :func:`step_layout` set,
    [T, H, dv]; ``window`` / ``softcap`` :data:`NO_WINDOW` / :data:`NO_SOFTCAP` where the layer has none."""
    follow_threads()  # inside a compiled step: the plan's threads (server.engine.cores)
    if _step_layout is None:
        raise RuntimeError("hsdp::paged_step ran outside a step: no layout was set (step_layout)")
    variant = _Variant(window if window != NO_WINDOW else None, softcap if softcap != NO_SOFTCAP else None, sinks_H,
                       alibi_H)
    return _attend_step(_step_layout, query_HTd, key_HNd, value_HNd, scale, variant)[0]


def _paged_step_fake(query_HTd, key_HNd, value_HNd, scale, window, softcap, sinks_H, alibi_H=None):
    return query_HTd.new_empty(query_HTd.shape[1], query_HTd.shape[0], value_HNd.shape[-1])


paged_step = define_op("paged_step(Tensor query_HTd, Tensor key_HNd, Tensor value_HNd, float scale, int window, "
                       "float softcap, Tensor? sinks_H, Tensor? alibi_H=None) -> Tensor", _paged_step, _paged_step_fake)


def _unpaged(module, query, key, value, attention_mask, *, softcap, s_aux, **kwargs):
    """SDPA, or where the layer needs what SDPA lacks (soft-capping, sinks) the model's own eager
    attention (its module's ``eager_attention_forward``, which implements them)."""
    if softcap is None and s_aux is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedAttention(f"{type(module).__name__} asks for soft-capping or sinks and its module has no "
                                   "eager attention to compute them")
    extra = {"softcap": softcap} if softcap is not None else {}
    if s_aux is not None:
        extra["s_aux"] = s_aux
    return eager(module, query, key, value, attention_mask, **extra, **kwargs)


class _Variant:
    """A layer's departures from plain causal attention."""

    __slots__ = ("window", "softcap", "sinks_H", "alibi_H")

    def __init__(self, window, softcap, sinks_H, alibi_H=None):
        self.window = int(window) if window is not None else None
        self.softcap = float(softcap) if softcap is not None else None
        self.sinks_H = sinks_H
        self.alibi_H = alibi_H

    def probabilities(self, scores, valid, sinks_shape: tuple[int, ...]) -> torch.Tensor:
        """:func:`server.engine.kernels.probabilities` with this layer's soft-cap and sinks."""
        return probabilities(scores, valid, self.softcap, self.sinks_H, sinks_shape)


def _attend_decode(group: _DecodeGroup, query_HTd, key_HNd, value_HNd, scale: float, variant: _Variant,
                   out_THd) -> None:
    out_THd.index_copy_(0, group.rows_S, _decode_out(group, query_HTd.index_select(1, group.rows_S), key_HNd,
                                                     value_HNd, scale, variant))


def _decode_out(group: _DecodeGroup, query_HSd, key_HNd, value_HNd, scale: float, variant: _Variant) -> torch.Tensor:
    """The decode rows' attention [S, H, dv], their queries ``query_HSd`` [H, S, d]."""
    window = variant.window if variant.window is not None else NO_WINDOW
    softcap = variant.softcap if variant.softcap is not None else NO_SOFTCAP
    if _one_decode_inline and torch.compiler.is_compiling() and _static_one(group.rows_S):
        return decode_one(query_HSd, key_HNd, value_HNd, group.slots_SL, group.positions_L, group.contexts_S,
                          float(scale), window, softcap, variant.sinks_H, variant.alibi_H)
    # one opaque op (torch.compile does not trace into it: see server.engine.kernels)
    return paged_decode(query_HSd, key_HNd, value_HNd, group.slots_SL, group.valid_SL, group.positions_L,
                        group.contexts_S, float(scale), window, softcap, variant.sinks_H, variant.alibi_H)


def _static_one(rows_S: torch.Tensor) -> bool:
    """Whether a traced step's decode rows are one, as a static size (not the open graph's symbol)."""
    rows = rows_S.shape[0]
    return isinstance(rows, int) and rows == 1


def _attend_chunk(chunk: _Chunk, query_HTd, key_HNd, value_HNd, scale: float, variant: _Variant, out_THd) -> None:
    out_THd[chunk.row:chunk.row + chunk.count] = _chunk_out(
        chunk, query_HTd[:, chunk.row:chunk.row + chunk.count].unsqueeze(0), key_HNd.index_select(1, chunk.slots_L),
        value_HNd.index_select(1, chunk.slots_L), scale, variant)


def _chunk_out(chunk: _Chunk, q, k_HLd, v_HLd, scale: float, variant: _Variant) -> torch.Tensor:
    """A prompt chunk's attention [Q, H, dv]: its queries ``q`` [1, H, Q, d] over its context's keys
    and values [Hkv, L, d / dv]."""
    k, v = k_HLd.unsqueeze(0), v_HLd.unsqueeze(0)  # [1, Hkv, L, d]
    mask_QL = chunk.mask(variant.window)
    if variant.softcap is None and variant.sinks_H is None:
        mask = mask_QL
        if variant.alibi_H is not None:  # [1, H, Q, L]: the slopes' bias, -inf outside the causal window
            mask = alibi_bias(variant.alibi_H, chunk.k_pos, mask_QL[None, None], (1, -1, 1, 1), q.dtype, scale)
        out = sdpa(q, k, v, mask, scale, enable_gqa=q.shape[1] != k.shape[1])
    else:  # SDPA has neither soft-capping nor sinks: the eager computation, a block of queries at a time
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # float32 scores of at most ~EXPLICIT_SCORES_BYTES per block: [1, H, block, L]
        block = max(1, EXPLICIT_SCORES_BYTES // (4 * q.shape[1] * max(1, k.shape[2])))
        outs = []
        for a in range(0, q.shape[2], block):
            scores = torch.matmul(q[:, :, a:a + block], k.transpose(-1, -2)).float().mul_(scale)
            if variant.alibi_H is not None:
                scores = scores + alibi_bias(variant.alibi_H, chunk.k_pos, None, (1, -1, 1, 1), torch.float32,
                                                    scale)
            probs = variant.probabilities(scores, mask_QL[None, None, a:a + block], (1, -1, 1, 1))
            outs.append(torch.matmul(probs.to(v.dtype), v))
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out[0].transpose(0, 1)


def use_paged_attention(model) -> None:
    """Register ``hsdp_paged`` and switch ``model`` (and its sub-configs) to it. Collective-free;
    every rank calls it the same way."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    text = model.config.get_text_config()
    if text is not model.config:
        text._attn_implementation = ATTN_IMPLEMENTATION
