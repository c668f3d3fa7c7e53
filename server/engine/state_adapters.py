"""Stateful families whose state code is their own, given the cache interface of ``server.engine.state``.

transformers' hybrids read and write their states through their cache (``get_conv_state`` /
``update_conv_state`` / ``get_recurrent_state`` / ``update_recurrent_state``), which
``server.engine.state`` answers from a slot per sequence. Three families keep them otherwise; a thin
adapter per family gives their modules that interface, around their own forward:

* **RecurrentGemma** (Griffin): each recurrent block keeps its convolution window and RG-LRU state
  in attributes (``conv1d_state``, ``rg_lru.recurrent_states``) that its model sets up for one batch.
  :class:`_StateInAttributes` puts a part's states there from its cache before the block's own
  forward and takes them back after. The block reads its positions only to tell a prompt's first
  token (``position_ids == 0`` resets the recurrence) and a one-token call (its recurrent form) from
  a prompt (its convolution over the chunk, from zeros): the adapter gives it ``0, 1, ...`` for a
  part that starts its state and ``1, 2, ...`` for one that continues it, whatever the row's
  positions. Its prompt path cannot continue a state, so a later chunk of a prompt goes a token at
  a time (``prompt_starts_from_zero``, read by ``state._scans_from_zero``).
* **xLSTM** (xLSTM-7B): each mLSTM layer takes its state (each head's cell ``C``, normaliser ``n``
  and stabiliser ``m``) as an argument and returns the new one, and its model's loop reads them
  from its own cache class (``xLSTMCache.rnn_state``) and copies them back.
  :class:`_StateAsArgument` passes the layer its part's states from the cache (recurrent states
  0, 1, 2; none for a part that starts them, as the model's first forward passes zeros) and writes
  the new ones back. :class:`_PagedXLSTM` is the causal LM's forward when the engine's cache comes
  with a step's layout: the model's own modules in its own order (embeddings, each block with the
  cache as its state, the output norm, the head over the rows ``logits_to_keep`` names, the logits'
  soft cap), which is its loop without ``xLSTMCache``; otherwise (a plain call) its own forward.
* **RWKV-4**: its time and channel mixing read and write five states a layer (two previous inputs;
  the time mixing's numerator, denominator and running maximum) in a list of ``[batch, hidden,
  layers]`` tensors its model passes down, indexed by the layer. :class:`_RwkvBlockState` runs the
  block's own modules in its order with each state's column of its layer (:class:`_Column`) loaded
  from the slots (a part that starts them: the zeros and ``-1e30`` its model starts from) and
  writes them back; a previous input reads as ``[batch, 1, hidden]``, so that several sequences
  decode at once (transformers' RWKV decodes one: a ``[batch, hidden]`` state broadcasts against
  the one-token input). Its eval mode divides two output weights of each block by ``2 **
  (block // rescale_every)`` in place and halves the hidden state every ``rescale_every`` blocks:
  the blocks divide their outputs instead (the same floats: a power of two), the model never
  rescales its weights (:class:`_RwkvWeightsAsLoaded`: FSDP holds them), and :class:`_PagedRwkv`
  runs the model's loop, halvings included, over the engine's cache.

Contract: :func:`adapt` mixes these into ``model``'s modules (also a model FSDP2 has wrapped: the
adapter subclasses the module's own class) and gives each adapted stateful module its
``layer_idx`` (the index in the name of the layer holding it); ``server.engine.state.install`` and
``state.state_shapes`` (on the probe's skeleton) call it. Idempotent.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


class _StateInAttributes:
    """RecurrentGemma's recurrent block, its state through the cache interface (module docstring)."""

    prompt_starts_from_zero = True

    def forward(self, input_states, position_ids=None, attention_mask=None, use_cache=True, cache=None, **kwargs):
        if cache is None or not hasattr(cache, "get_conv_state"):
            return super().forward(input_states, position_ids, attention_mask, use_cache=use_cache, **kwargs)
        batch, length = input_states.shape[:2]
        layer = _layer_of(self, cache)
        conv = cache.get_conv_state(layer)
        self.conv1d_state, self.rg_lru.recurrent_states = conv, cache.get_recurrent_state(layer)
        positions = torch.arange(int(conv is not None), length + int(conv is not None), device=input_states.device)
        try:
            out = super().forward(input_states, positions.expand(batch, length), attention_mask, use_cache=True,
                                  **kwargs)
            # (a continued state takes the new columns after its own, as LinearAttentionLayer's update does)
            cache.update_conv_state(self.conv1d_state if conv is None else self.conv1d_state[..., -length:], layer)
            cache.update_recurrent_state(self.rg_lru.recurrent_states, layer)
        finally:
            self.conv1d_state = self.rg_lru.recurrent_states = None
        return out


class _StateAsArgument:
    """xLSTM's mLSTM layer, its state (C, n, m) through the cache interface (module docstring)."""

    def forward(self, x, state=None):
        if state is None or not hasattr(state, "get_recurrent_state"):
            return super().forward(x, state)
        cache, layer = state, _layer_of(self, state)
        previous = [cache.get_recurrent_state(layer, i) for i in range(3)]
        y, new = super().forward(x, None if previous[0] is None else tuple(previous))
        for i, value in enumerate(new):
            cache.update_recurrent_state(value, layer, state_idx=i)
        return y, None


class _PagedXLSTM:
    """xLSTM's causal LM over the engine's cache (module docstring)."""

    def forward(self, input_ids=None, inputs_embeds=None, cache=None, labels=None, use_cache=None, **kwargs):
        from transformers.modeling_utils import slice_logits_to_keep

        from server.engine.attention import is_paged

        if not is_paged(cache) or labels is not None:
            return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache, labels=labels,
                                   use_cache=use_cache, **kwargs)
        backbone = self.backbone
        hidden = backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for block in backbone.blocks:
            hidden, _ = block(hidden, cache)
        hidden = slice_logits_to_keep(backbone.out_norm(hidden), kwargs.get("logits_to_keep", 0))
        xlstm = sys.modules[_original(type(self)).__module__]
        return _Logits(xlstm.soft_cap(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float(),
                                     self.config.output_logit_soft_cap))


class _Logits:
    """The part of a causal LM's output the engine reads."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class _Column:
    """One layer's column of an RWKV state (``[batch, hidden, layers]`` in its model): what its
    modules index as ``state[i][:, :, layer_id]``, read and assigned whole (``value``: ``[batch, width]``).

    A previous token's input (states 0 and 1) reads as ``[batch, 1, hidden]``: the modules' one-token
    path mixes it with a ``[batch, 1, hidden]`` input, which a ``[batch, hidden]`` state would
    broadcast to ``[batch, batch, hidden]`` (transformers' RWKV decodes one sequence at a time); their
    prompt path assigns it to the first token's row, which takes either."""

    def __init__(self, value: torch.Tensor, token: bool):
        self.value, self.token = value, token

    def __getitem__(self, index) -> torch.Tensor:
        return self.value.unsqueeze(1) if self.token else self.value

    def __setitem__(self, index, value: torch.Tensor) -> None:
        self.value = value


class _RwkvBlockState:
    """RWKV's block, its five states through the cache interface, its rescaling on its outputs
    (module docstring)."""

    @staticmethod
    def prepare(block: nn.Module) -> None:
        # the factor its model divides the block's two output weights by in eval mode (a float each block:
        # the layers' graphs guard on it, so the blocks of one factor share a graph, not on the block's index)
        every = block.config.rescale_every
        block.hsdp_output_scale = 2.0 ** -(block.layer_id // every) if every > 0 else 1.0

    def forward(self, hidden, state=None, use_cache=False, output_attentions=False):
        cached = state is not None and hasattr(state, "get_recurrent_state")
        if cached:
            cache, layer = state, _layer_of(self, state)
            previous = [cache.get_recurrent_state(layer, i) for i in range(5)]
            if previous[0] is None:  # a sequence's first part: the states its model starts from
                batch, width = hidden.shape[0], self.attention.attention_hidden_size
                previous = [hidden.new_zeros(batch, hidden.shape[-1]), hidden.new_zeros(batch, hidden.shape[-1]),
                            *(hidden.new_zeros(batch, width, dtype=torch.float32) for _ in range(3))]
                previous[4] -= 1e30
            state = [_Column(s, token=i < 2) for i, s in enumerate(previous)]
        # In eval mode its model divides the attention's and the feed-forward's output weights by 2 ** (block //
        # rescale_every), in place, and halves the hidden state every rescale_every blocks. The weights here stay
        # as loaded (FSDP's), and the outputs are divided instead: a power of two, the same floats.
        scale = 1.0 if self.training else self.hsdp_output_scale
        if getattr(self, "pre_ln", None) is not None:  # (the first block's)
            hidden = self.pre_ln(hidden)
        attention, state = self.attention(self.ln1(hidden), state=state, use_cache=use_cache or cached)
        hidden = hidden + attention * scale
        feed_forward, state = self.feed_forward(self.ln2(hidden), state=state)
        hidden = hidden + feed_forward * scale
        if cached:
            for i, column in enumerate(state):
                cache.update_recurrent_state(column.value, layer, state_idx=i)
            state = cache
        return hidden, state, (attention if output_attentions else None)


class _RwkvWeightsAsLoaded:
    """RWKV's model: its eval mode's rescaling never applied to the weights in place (its blocks
    divide their outputs instead: :class:`_RwkvBlockState`); its loop halves the hidden state as
    its own does."""

    def _rescale_layers(self) -> None:
        self.layers_are_rescaled = not self.training


class _PagedRwkv:
    """RWKV's causal LM over the engine's cache (module docstring)."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, state=None, labels=None,
                use_cache=None, **kwargs):
        from transformers.modeling_utils import slice_logits_to_keep

        from server.engine.attention import is_paged

        cache = kwargs.pop("cache", None)
        if not is_paged(cache) or labels is not None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                   state=state, labels=labels, use_cache=use_cache, **kwargs)
        rwkv, every = self.rwkv, self.config.rescale_every
        rwkv._rescale_layers()
        hidden = rwkv.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for index, block in enumerate(rwkv.blocks):
            hidden = block(hidden, state=cache)[0]
            if rwkv.layers_are_rescaled and every > 0 and (index + 1) % every == 0:
                hidden = hidden / 2
        hidden = slice_logits_to_keep(rwkv.ln_out(hidden), kwargs.get("logits_to_keep", 0))
        return _Logits(self.head(hidden))


ADAPTERS: dict[str, tuple[type, bool]] = {
    "RecurrentGemmaRecurrentBlock": (_StateInAttributes, True),
    "xLSTMLayer": (_StateAsArgument, True),
    "xLSTMForCausalLM": (_PagedXLSTM, False),
    "RwkvBlock": (_RwkvBlockState, True),
    "RwkvModel": (_RwkvWeightsAsLoaded, False),
    "RwkvForCausalLM": (_PagedRwkv, False),
}
"""transformers' class name -> (its adapter, whether it is a stateful module: it gets a ``layer_idx``)."""
ADAPTED_STATE_MODEL_TYPES = frozenset({"recurrent_gemma", "xlstm", "rwkv"})
"""The families :func:`adapt` adapts (each tested with ``server.engine.state``)."""


def _layer_of(module: nn.Module, cache) -> int | None:
    """The layer index to ask ``cache`` for: a compiled layer's cache names none (its graph must not
    read the module's index, or each layer would get a graph of its own); the probe's ignores it."""
    return cache.layer_idx if hasattr(cache, "layer_idx") else module.layer_idx


def _original(cls: type) -> type | None:
    """The transformers class of :data:`ADAPTERS` that ``cls`` is or adapts (None: none)."""
    return next((c for c in cls.__mro__ if c.__name__ in ADAPTERS), None)


def _adapted(cls: type) -> bool:
    return issubclass(cls, tuple(adapter for adapter, _ in ADAPTERS.values()))


def adapt(model: nn.Module) -> int:
    """Mix the adapter of :data:`ADAPTERS` into each module of ``model`` of an adapted class
    (``shard_engine.mix_into_class``: under FSDP2's class where the module is a unit); returns how
    many modules carry one."""
    from shard_engine.torch_private import mix_into_class

    count = 0
    for name, module in model.named_modules():
        cls = type(module)
        if _adapted(cls):  # (also once state.install has mixed in its own)
            count += 1
            continue
        original = _original(cls)
        if original is None:
            continue
        adapter, stateful = ADAPTERS[original.__name__]
        if stateful:
            module.layer_idx = next(int(p) for p in reversed(name.split(".")) if p.isdigit())
        mix_into_class(module, adapter, "Engine", sys.modules[__name__])
        if hasattr(adapter, "prepare"):
            adapter.prepare(module)
        count += 1
    return count
