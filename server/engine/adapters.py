"""Families with their own attention code (Bloom, MPT, Falcon) over the paged cache: a thin adapter per family.

Bloom's, MPT's and Falcon's attention modules compute their own attention (transformers'
attention interface never sees them): Bloom and MPT build an ALiBi bias for the whole batch, add
it to their scores and apply a causal mask made for one padded batch; Falcon applies its rope and
calls SDPA itself. Packed sequences of different lengths in
one row, over a paged cache, need neither: :func:`install` swaps each such module's class for a
subclass whose forward, when the engine's :class:`~server.engine.attention.PagedKVCache` comes with
a step's layout, runs the module's own projections (Bloom's fused ``query_key_value`` and its
head split, MPT's ``Wqkv`` with its ``clip_qkv``), writes the keys and values through the cache,
and calls the engine's attention (``attention.paged_attention``) with the module's scale and one
ALiBi slope per head, which the engine adds to each score as slope x the key's position in its
own sequence; the output projection (and Bloom's residual add) follow as in the module. The slopes
are the family's own functions' (Bloom's ``_get_alibi_slopes``; MPT's ``build_mpt_alibi_tensor``
with its ``alibi_bias_max``). Bloom's bias is slope x key position; MPT's is slope x (key position
- last position): they differ from the engine's by a constant per query, which the softmax
cancels, so the output equals the module's up to float rounding.

Falcon's adapter runs the module's fused projection and head split, un-broadcasts the new
architecture's keys and values to its ``num_kv_heads`` (the module broadcasts them to every query
head; the cache holds each once), and attends with scale 1/sqrt(head_dim). Its rope layouts
(Falcon-7B/40B/180B) apply the module's rope with the model's cos and sin at each token's own
position. Its ALiBi layout (``alibi: true``, Falcon-RW) passes the slopes of the model's own
``build_alibi_tensor`` as bfloat16: that model rounds the position and the product
``slope x position`` to bfloat16 and adds the bias divided by sqrt(head_dim) (its SDPA path, as
Falcon-RW's own modelling code; transformers' eager path adds the bias a second time through its
mask), which :func:`server.engine.kernels.alibi_bias` reproduces for bfloat16 slopes.

Without a layout (an idle rank's forward, a plain ``generate``) the module's own forward runs.
MPT's model forward casts its causal mask to bool, and transformers makes no mask for an attention
implementation it does not know (``hsdp_paged``): the adapter wraps ``create_causal_mask`` in MPT's
modeling module to give a placeholder the adapted attention never reads, where the cache is the
engine's (every other call is transformers' own).

Contract: :func:`install` returns the modules adapted; :data:`ADAPTED_MODEL_TYPES` names the
families (``server.engine.capability`` serves them although their attention bypasses the
interface); :func:`kv_heads` the key/value heads an adapted family's cache holds.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from server.engine.attention import PagedKVCache, is_paged, paged_attention

ADAPTED_MODEL_TYPES = frozenset({"bloom", "mpt", "falcon"})
"""Model types whose attention modules :func:`install` adapts to the paged engine."""
POOLS_KEYWORD = "hsdp_pools_keyword"
"""The attribute :func:`install` sets on a decoder layer holding an adapted attention: the keyword
its forward passes the cache down by (these blocks keep their other keywords from the attention, so
a compiled layer's pools go down in place of the cache: ``server.engine.compiled``)."""


def _slopes(module: nn.Module, make) -> torch.Tensor:
    """The module's ALiBi slopes [heads] (float32), made once per device."""
    slopes = getattr(module, "_hsdp_alibi_slopes", None)
    if slopes is None:
        slopes = module._hsdp_alibi_slopes = make()
    return slopes


class _PagedBloomAttention:
    """Bloom's attention over the paged cache (mixed into ``BloomAttention`` by :func:`install`)."""

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        cache = layer_past if layer_past is not None else kwargs.get("cache")
        if not is_paged(cache):
            return super().forward(hidden_states, residual, alibi, attention_mask, layer_past=layer_past,
                                   use_cache=use_cache, output_attentions=output_attentions, **kwargs)
        bloom = sys.modules[type(self).__bases__[1].__module__]
        batch, length, _ = hidden_states.shape
        query, key, value = self._reshape(self.query_key_value(hidden_states))  # [1, heads, T, d] each
        key, value = cache.update(key, value, self.layer_idx)
        slopes = _slopes(self, lambda: bloom._get_alibi_slopes(self.num_heads, hidden_states.device))
        out, _ = paged_attention(self, query, key, value, None, scaling=self.inv_norm_factor,
                                 hsdp_paged=cache.layout, alibi_slopes=slopes)
        output = self.dense(out.reshape(batch, length, self.num_heads * self.head_dim))
        return bloom.dropout_add(output, residual, self.hidden_dropout, self.training), None


class _PagedMptAttention:
    """MPT's attention over the paged cache (mixed into ``MptAttention`` by :func:`install`)."""

    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        if not is_paged(cache):
            return super().forward(hidden_states, position_bias, cache=cache, attention_mask=attention_mask, **kwargs)
        mpt = sys.modules[type(self).__bases__[1].__module__]
        batch, length, _ = hidden_states.shape
        mixed = self.Wqkv(hidden_states)
        if self.clip_qkv:
            mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = (t.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
                             for t in mixed.chunk(3, dim=2))
        key, value = cache.update(key, value, self.layer_idx)

        def make() -> torch.Tensor:  # bias of a 2-token context: [heads, 1, 2] = (-slope, 0)
            bias = mpt.build_mpt_alibi_tensor(self.n_heads, 2, self.hsdp_alibi_bias_max, device=hidden_states.device)
            return -bias[:, 0, 0].float()

        out, _ = paged_attention(self, query, key, value, None, scaling=self.softmax_scale, hsdp_paged=cache.layout,
                                 alibi_slopes=_slopes(self, make))
        return self.out_proj(out.reshape(batch, length, self.n_heads * self.head_dim)), None


def _placeholder_mask_for_paged(create_causal_mask):
    """``create_causal_mask`` that, for the engine's cache, returns a 0-dim placeholder (MPT's model
    forward calls ``.to(torch.bool)`` on the mask; the adapted attention ignores it)."""
    if getattr(create_causal_mask, "hsdp_wrapped", False):
        return create_causal_mask

    def wrapped(*args, **kwargs):
        if isinstance(kwargs.get("cache", kwargs.get("past_key_values")), PagedKVCache):
            return torch.ones((), dtype=torch.bool)
        return create_causal_mask(*args, **kwargs)

    wrapped.hsdp_wrapped = True
    return wrapped


class _PagedFalconAttention:
    """Falcon's rope attention over the paged cache (mixed into ``FalconAttention`` by :func:`install`)."""

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        if not is_paged(layer_past):
            return super().forward(hidden_states, alibi, attention_mask, position_ids=position_ids,
                                   layer_past=layer_past, use_cache=use_cache, output_attentions=output_attentions,
                                   position_embeddings=position_embeddings, **kwargs)
        falcon = sys.modules[type(self).__bases__[1].__module__]
        batch, length, _ = hidden_states.shape
        query, key, value = self._split_heads(self.query_key_value(hidden_states))  # [B, T, heads, d]
        if self.new_decoder_architecture:  # the module broadcast each kv head to its group of query heads
            groups = self.num_heads // self.num_kv_heads
            key, value = (t.unflatten(2, (self.num_kv_heads, groups))[:, :, :, 0] for t in (key, value))
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        slopes = None
        if not self.config.alibi:  # the config's, not the model's bias tensor (sized by the step: a compiled
            cos, sin = position_embeddings  # layer's graph would specialize on it)
            query, key = falcon.apply_rotary_pos_emb(query, key, cos, sin)
        else:  # Falcon-RW: bfloat16 slopes, the engine's sign for the model's rounded bias (server.engine.kernels)
            def make() -> torch.Tensor:  # a 2-token context's bias [heads, 1, 2] = (0, bf16(slope))
                bias = falcon.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long, device=hidden_states.device),
                                                 self.num_heads, torch.bfloat16)
                return bias[:, 0, 1].contiguous()

            slopes = _slopes(self, make)
        key, value = layer_past.update(key, value, self.layer_idx)
        out, _ = paged_attention(self, query, key, value, None, scaling=self.head_dim ** -0.5,
                                 hsdp_paged=layer_past.layout, alibi_slopes=slopes)
        return self.dense(out.reshape(batch, length, self.num_heads * self.head_dim)), None


def kv_heads(config) -> int | None:
    """The key/value heads a layer of an adapted family caches (None: not adapted; the config's own
    ``num_key_value_heads`` then)."""
    if config.model_type != "falcon":
        return None
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


_ADAPTERS = {"BloomAttention": _PagedBloomAttention, "MptAttention": _PagedMptAttention,
             "FalconAttention": _PagedFalconAttention}
_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        name = f"Paged{cls.__name__}"
        subclass = type(name, (_ADAPTERS[cls.__name__], cls), {"__module__": __name__})
        globals()[name] = subclass  # importable by name (pickle)
        _CLASSES[cls] = subclass
    return _CLASSES[cls]


def adapted(model: nn.Module) -> bool:
    """Whether :func:`install` adapted any module of ``model``."""
    return any(type(m) in _CLASSES.values() for m in model.modules())


def install(model: nn.Module) -> int:
    """Adapt every Bloom, MPT or Falcon attention module of ``model`` to the paged engine (the module
    docstring); returns how many. Raises ValueError for a layout the adapter does not compute
    (Bloom's ``pretraining_tp`` > 1 with ``slow_but_exact``: its output projection in slices)."""
    count = 0
    config = model.config.get_text_config()
    for module in model.modules():
        cls = type(module)
        if cls.__name__ not in _ADAPTERS or cls in _CLASSES.values():
            continue
        if cls.__name__ == "BloomAttention" and module.pretraining_tp > 1 and module.slow_but_exact:
            raise ValueError("Bloom with pretraining_tp > 1 and slow_but_exact computes its output projection in "
                             "slices, which the paged adapter does not")
        if cls.__name__ == "MptAttention":
            module.hsdp_alibi_bias_max = config.attn_config.alibi_bias_max
            mpt = sys.modules[cls.__module__]
            mpt.create_causal_mask = _placeholder_mask_for_paged(mpt.create_causal_mask)
        module.__class__ = _adapted_class(cls)
        count += 1
    for block in model.modules():  # Bloom's, MPT's and Falcon's blocks pass the cache as layer_past
        if any(type(child) in _CLASSES.values() for child in block.children()):
            setattr(block, POOLS_KEYWORD, "layer_past")
    return count
