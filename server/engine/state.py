"""Per-sequence recurrent state beside the paged KV cache: hybrid and state-space families.

transformers' stateful layers (LFM2's short convolutions; the gated delta-nets of Qwen3-Next,
Qwen3.5 and its MoE, OLMo-Hybrid and LaraMini; Kimi Linear's delta attention, Ling/Ring-linear's
(``bailing_hybrid``); MiniMax's lightning attention (one state, through its own cache's
``get_linear_cache`` / ``set_linear_cache``, mapped onto the same); the Mamba-1 and Mamba2
mixers of Mamba, Jamba, Bamba, Granite-4 hybrid, Nemotron-H and Falcon-H1) keep a convolution window and a recurrent (SSM or delta-net) state
per sequence in their cache, through one interface: ``get_conv_state`` / ``update_conv_state`` /
``get_recurrent_state`` / ``update_recurrent_state`` / ``is_recording_past``, the semantics of
``transformers.cache_utils.LinearAttentionLayer``. (RecurrentGemma's recurrent blocks keep theirs in
attributes of their own, xLSTM's layers and RWKV's blocks take theirs as an argument:
:mod:`server.engine.state_adapters` gives them the same interface.) Their code assumes a batch of
sequences of equal length; the engine packs sequences of every length into one row. So:

* :class:`StatePool` holds, per stateful layer and state, one tensor of slots ``[slots, ...]``
  (one sequence's state shape: :func:`state_shapes` learns it from the model's own code on the
  meta device), and each running sequence its slot (``add`` on admission, ``remove`` on finish or
  preemption; slots are reused). It holds as many slots as the rank runs sequences at most,
  allocated at startup out of ``--kv-cache-memory`` before the KV blocks (``server.main``). A
  sequence's state is never anyone else's: packed prompts and decodes of different sequences
  never share one.
* :func:`install` swaps each stateful module's class for a subclass whose forward, in an engine
  step, splits the row by the step's layout: the decoding sequences (one token each, a state
  each) together as a batch of one-token sequences, each prompt chunk alone; and calls the
  module's own forward on each part with a :class:`_SegmentCache`, a real
  ``LinearAttentionLayer`` loaded with those sequences' states (none for a chunk that starts a
  prompt: the module's own prefill path then starts them), whose updated states go back to their
  slots after. Chunked prefill carries the state across chunks (a later chunk finds its state, as
  transformers' own continuation does; Mamba-1's prompt scan takes no initial state, so its later
  chunks go a token at a time through the mixer's recurrent form: :func:`_scans_from_zero`); a
  preempted sequence recomputes from its prompt, its first chunk starting a fresh state.
* A stateful model does not reuse prefixes (``server.main`` turns prefix caching off for it): a
  cached block holds keys and values, not the state after it.

The stateful modules run on CPU through their torch reference paths; on CUDA their kernels where
transformers finds them installed (causal-conv1d, mamba-ssm, flash-linear-attention: the modules'
own dispatch). Inside a compiled decode step (``server.engine.compiled`` admits steps whose every
sequence continues its state) a module's rows are one batch, their states gathered and scattered
by slot in the graph, a padding row's in the pool's scratch slot (:meth:`StatePool.add_scratch_slot`);
a compiled layer's states are its graph's inputs (:class:`LayerStates`), not found by its index.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch
from torch import nn

from server.engine.state_adapters import adapt as adapt_own_state

MAX_STATES = 5
"""State indices a layer may use (``state_idx``): transformers' hybrids use 0 (and 1 for a second
convolution in some); xLSTM's layers 0-2 and RWKV's blocks 0-4 (``server.engine.state_adapters``)."""
SERVED_STATEFUL_MODEL_TYPES = frozenset({
    "lfm2", "lfm2_moe", "lfm3", "qwen3_next", "olmo_hybrid", "mamba2", "bamba", "granitemoehybrid", "nemotron_h",
    "falcon_h1", "mamba", "falcon_mamba", "jamba", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "bailing_hybrid",
    "lara_mini", "minimax", "zamba", "zamba2", "recurrent_gemma", "zaya", "xlstm", "rwkv",
})
"""Stateful families the engine serves (each tested against transformers' generate)."""
OWN_CACHE_MODEL_TYPES = frozenset({"minimax"})
"""Families whose model refuses, under ``use_cache``, any cache but its own class (MiniMax's): the
engine calls them with ``use_cache=False`` (:func:`uses_cache`); their layers read the cache passed."""


def uses_cache(config) -> bool:
    """The ``use_cache`` the engine's forwards pass ``config``'s model (:data:`OWN_CACHE_MODEL_TYPES`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) not in OWN_CACHE_MODEL_TYPES


STATEFUL_LAYER_TYPES = frozenset({"conv", "linear_attention", "mamba"})
"""``layer_types`` entries of layers whose state :class:`StatePool` keeps."""
HYBRID_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})
"""Layers with attention and a stateful mixer side by side (Falcon-H1; ZAYA, whose attention's projection
convolves and delays): cached keys and values, and a state."""
MIXERLESS_LAYER_TYPES = frozenset({"mlp", "moe"})
"""Layers that mix nothing across tokens (Nemotron-H's feed-forward layers): neither cache nor state."""


def is_stateful_config(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", "") in SERVED_STATEFUL_MODEL_TYPES


StateShapes = dict[tuple[int, str, int], tuple[tuple[int, ...], torch.dtype]]
"""(layer, kind, state index) -> one sequence's state shape and dtype."""


def state_shapes(model: nn.Module) -> StateShapes:
    """One sequence's states, per stateful layer, as the model's own code writes them: each stateful
    module of a skeleton of ``model``'s config on the meta device (nothing allocated) runs a
    3-token prompt with a cache that records what it stores."""
    import transformers

    config = model.config
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapt_own_state(skeleton)
    shapes: StateShapes = {}
    for module in skeleton.modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not _uses_state(type(module)):
            continue
        name = _cache_argument(module)
        hidden = torch.empty((1, 3, config.get_text_config().hidden_size), dtype=dtype, device="meta")
        # (MiniMax's lightning attention takes the rope and mask it does not use positionally: None)
        unused = {n: None for n in ("position_embeddings", "attention_mask")
                  if n in inspect.signature(module.forward).parameters}
        module(hidden, **unused, **{name: _Recorder(shapes, layer)})
    return shapes


def bytes_per_sequence(shapes: StateShapes) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes.values())


def _cache_argument(module: nn.Module) -> str:
    names = inspect.signature(module.forward).parameters
    # ("state": xLSTM's and RWKV's adapted layers, server.engine.state_adapters)
    name = next((n for n in ("cache", "cache_params", "past_key_values", "past_key_value", "state") if n in names),
                None)
    if name is None:
        raise RuntimeError(f"{type(module).__name__}'s forward takes no cache argument")
    return name


class _Recorder:
    """A cache that records the shape of each state a module stores (:func:`state_shapes`)."""

    def __init__(self, shapes: StateShapes, layer: int):
        self.shapes, self.layer = shapes, layer

    def get_conv_state(self, *args, **kwargs):
        return None

    get_recurrent_state = get_conv_state

    def is_recording_past(self, *args, **kwargs) -> bool:
        return False

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        width = conv_kernel_size or conv_states.shape[-1]
        self.shapes[(self.layer, "conv", state_idx)] = ((*conv_states.shape[1:-1], width), conv_states.dtype)
        return conv_states

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self.shapes[(self.layer, "recurrent", state_idx)] = (tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        return recurrent_states

    def get_linear_cache(self, layer_idx: int):
        return None

    def set_linear_cache(self, layer_idx: int, state) -> None:
        self.update_recurrent_state(state, layer_idx)


class StatePool:
    """Every stateful layer's states for one rank's running sequences (the module docstring):
    ``capacity`` slots of each state in ``shapes`` (:func:`state_shapes`), allocated at once."""

    def __init__(self, device: torch.device, shapes: StateShapes, capacity: int):
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}
        self._started: set[int] = set()  # sequences whose state exists (their first chunk computed)
        self._free = list(range(capacity - 1, -1, -1))
        self._hold({key: torch.zeros((capacity, *shape), dtype=dtype, device=device)
                    for key, (shape, dtype) in shapes.items()})
        self.scratch_slot: int | None = None  # a compiled step's padding rows' slot (add_scratch_slot)

    def _hold(self, tensors: dict[tuple[int, str, int], torch.Tensor]) -> None:
        self.tensors = tensors
        self._layers: dict[int, LayerStates] = {}  # each layer's, made once (a compiled step passes them every step)
        for (layer, kind, state), t in tensors.items():
            self._layers.setdefault(layer, LayerStates(layer, {})).tensors[(kind, state)] = t

    def add_scratch_slot(self) -> int:
        """One slot past the sequences' that no sequence gets: the padding rows of a compiled decode
        step (``server.engine.compiled``) read and write their states there. Once; returns it."""
        if self.scratch_slot is None:
            self._hold({key: torch.cat((t, torch.zeros_like(t[:1]))) for key, t in self.tensors.items()})
            self.scratch_slot = self.capacity
        return self.scratch_slot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def bytes_per_sequence(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values()) if self.capacity else 0

    def add(self, seq_id: int) -> int:
        if seq_id in self.slot_of:
            return self.slot_of[seq_id]
        if not self._free:
            raise RuntimeError(f"no free state slot for sequence {seq_id}: all {self.capacity} run (the scheduler "
                               "runs at most that many on a rank)")
        slot = self._free.pop()
        self.slot_of[seq_id] = slot
        return slot

    def starts(self, seq_id: int, start: int) -> None:
        """Check that a step computing ``seq_id`` from position ``start`` has its state: it begins at 0
        (a prompt's first chunk; a preempted sequence's recompute) or continues what this pool
        computed. A prefix-cache hit on a stateful model would skip the tokens its state needs."""
        if start == 0:
            self._started.add(seq_id)
        elif seq_id not in self._started:
            raise RuntimeError(f"sequence {seq_id} starts at position {start} without its state: a stateful model "
                               "cannot take a cached prefix (prefix caching must be off for it)")

    def of_layer(self, layer: int) -> LayerStates:
        """``layer``'s states (none for a layer that keeps none)."""
        states = self._layers.get(layer)
        if states is None:
            states = self._layers[layer] = LayerStates(layer, {})
        return states

    def remove(self, seq_id: int) -> None:
        self._started.discard(seq_id)
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)



class LayerStates:
    """One layer's states of a :class:`StatePool` (``of_layer``: the pool's own tensors, by kind and
    state index), read and written by slot. A compiled layer's graph gets them as its input
    (``attention.LayerPools``) rather than finding them by the layer's index, so that every layer
    of a kind shares one graph (``layer`` names the layer in errors only)."""

    def __init__(self, layer: int, tensors: dict[tuple[str, int], torch.Tensor]):
        self.layer, self.tensors = layer, tensors

    def gather(self, kind: str, state: int, slots: torch.Tensor) -> torch.Tensor | None:
        t = self.tensors.get((kind, state))
        return None if t is None else t.index_select(0, slots)

    def scatter(self, kind: str, state: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        t = self.tensors.get((kind, state))
        if t is None or t.shape[1:] != values.shape[1:] or t.dtype != values.dtype:
            expected = None if t is None else (tuple(t.shape[1:]), t.dtype)
            raise RuntimeError(f"layer {self.layer} stores a {kind} state {state} of {tuple(values.shape[1:])} "
                               f"{values.dtype}; its probe found {expected} (server.engine.state.state_shapes)")
        t.index_copy_(0, slots, values)


class _SegmentCache:
    """What a stateful module sees for a part of the row: its sequences' states in a
    ``LinearAttentionLayer`` (transformers' own state arithmetic), written back by :meth:`store`."""

    def __init__(self, states: LayerStates, layer_idx: int | None, slots: torch.Tensor, previous: bool):
        from transformers.cache_utils import LinearAttentionLayer

        self.states, self.layer_idx, self.slots = states, layer_idx, slots
        self.state = LinearAttentionLayer(number_of_states=MAX_STATES)
        if previous:
            for i in range(MAX_STATES):
                conv = states.gather("conv", i, slots)
                if conv is not None:
                    self.state.conv_states[i] = conv
                    self.state.conv_kernel_size[i] = conv.shape[-1]
                    self.state.is_conv_states_initialized[i] = True
                    self.state.device, self.state.dtype = conv.device, conv.dtype
                recurrent = states.gather("recurrent", i, slots)
                if recurrent is not None:
                    self.state.recurrent_states[i] = recurrent
                    self.state.is_recurrent_states_initialized[i] = True
                self.state.has_previous_state[i] = conv is not None or recurrent is not None

    def _check(self, layer_idx: int) -> None:
        if self.layer_idx is not None and layer_idx != self.layer_idx:  # None: a compiled layer's (LayerStates)
            raise RuntimeError(f"a stateful module of layer {self.layer_idx} asked for layer {layer_idx}'s state")

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._check(layer_idx)
        return self.state.conv_states[state_idx] if self.state.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._check(layer_idx)
        return self.state.recurrent_states[state_idx] if self.state.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check(layer_idx)
        return self.state.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check(layer_idx)
        return self.state.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    # MiniMax's lightning attention keeps one state (K^T V), through its own cache's pair
    def get_linear_cache(self, layer_idx: int):
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.update_recurrent_state(state, layer_idx)

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def store(self) -> None:
        for i in range(MAX_STATES):
            if self.state.is_conv_states_initialized[i]:
                self.states.scatter("conv", i, self.slots, self.state.conv_states[i])
            if self.state.is_recurrent_states_initialized[i]:
                self.states.scatter("recurrent", i, self.slots, self.state.recurrent_states[i])


def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _uses_state(cls: type) -> bool:
    source = _forward_source(cls)
    return "get_conv_state" in source or "get_recurrent_state" in source or "get_linear_cache" in source


def _scans_from_zero(cls: type) -> bool:
    """Whether the module's prompt path cannot start from a state: Mamba-1's selective scan
    (``mamba_selective_scan``: Mamba, Falcon-Mamba, Jamba) takes no initial state, and
    RecurrentGemma's prompt path starts its convolution from zeros, since transformers' generate
    never continues a prompt (``server.engine.state_adapters``). A later chunk of such a module's
    prompt then goes through its one-token recurrent form, a token at a time."""
    return "mamba_selective_scan(" in _forward_source(cls) or getattr(cls, "prompt_starts_from_zero", False)


PER_TOKEN_TUPLE_CLASSES = frozenset({"ZayaCCAProjection"})
"""Stateful modules whose forward returns several tensors a token (ZAYA's CCA projection: its
queries, keys and values); every other module's tuple is its output and what its layer ignores
(MiniMax's state)."""


class _PerSequenceState:
    """Mixed into a stateful module's class by :func:`install` (the module docstring)."""

    _continues_one_token_at_a_time = False  # (:func:`_scans_from_zero`)
    _per_token_tuple = False  # (:data:`PER_TOKEN_TUPLE_CLASSES`)

    def forward(self, hidden_states, *args, **kwargs):
        from server.engine.attention import LayerPools, PagedKVCache

        # the cache argument: by keyword, or by position (ZAYA's projection takes it second)
        where = next((k for k, v in kwargs.items() if isinstance(v, (PagedKVCache, LayerPools))), None)
        if where is None:
            where = next((i for i, v in enumerate(args) if isinstance(v, (PagedKVCache, LayerPools))), None)
        cache = None if where is None else args[where] if isinstance(where, int) else kwargs[where]
        if cache is None or cache.layout is None or cache.states is None:
            return super().forward(hidden_states, *args, **kwargs)
        layout = cache.layout
        if isinstance(cache, LayerPools):  # a compiled layer's: its states its graph's input, its index never read
            states, layer = cache.states, None  # (so that the layers of its kind share the graph)
        else:
            states, layer = cache.states.of_layer(self.layer_idx), self.layer_idx
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None  # a padding mask for one batch; the row has no padding
        if torch.compiler.is_compiling():
            # a compiled decode step (server.engine.compiled: steps whose every sequence continues its state,
            # padded, the padding rows' states in the pool's scratch slot): the row as one batch of
            # one-token sequences, in row order, their states gathered and scattered by slot
            results, tupled = self._segment_forward(hidden_states.transpose(0, 1), _SegmentCache(
                states, layer, layout.state_slots_S, True), where, args, kwargs)
            return self._returned([r.transpose(0, 1) for r in results], tupled)
        out: list[torch.Tensor] = []
        tupled = False

        def run(rows: torch.Tensor, segment: torch.Tensor, slots: torch.Tensor, previous: bool):
            nonlocal tupled
            results, tupled = self._segment_forward(segment, _SegmentCache(states, layer, slots, previous), where,
                                                    args, kwargs)
            if not out:
                out.extend(r.new_empty((1, hidden_states.shape[1], *r.shape[2:])) for r in results)
            for o, r in zip(out, results):
                o[0, rows] = r.reshape(len(rows), *r.shape[2:])

        decode = layout.decode
        if decode is not None:
            continuing = layout.state_previous_S
            for previous in (True, False):
                index = (continuing == previous).nonzero().flatten()
                if len(index):
                    rows = decode.rows_S.index_select(0, index)
                    run(rows, hidden_states[0].index_select(0, rows).unsqueeze(1),
                        layout.state_slots_S.index_select(0, index), previous)
        for chunk, slot in zip(layout.prefill, layout.state_slots_chunks):
            previous = int(chunk.q_pos[0]) > 0
            if previous and self._continues_one_token_at_a_time:
                for row in range(chunk.row, chunk.row + chunk.count):
                    run(torch.tensor([row], device=hidden_states.device), hidden_states[:, row:row + 1], slot, True)
                continue
            rows = torch.arange(chunk.row, chunk.row + chunk.count, device=hidden_states.device)
            run(rows, hidden_states[:, chunk.row:chunk.row + chunk.count], slot, previous)
        if not out:  # a row of padding only (nothing of a sequence to compute)
            return super().forward(hidden_states, *args, **kwargs)
        return self._returned(out, tupled)

    def _returned(self, outputs: list[torch.Tensor], tupled: bool):
        """What the module's own forward returns, of the row's ``outputs`` (:meth:`_segment_forward`)."""
        if not tupled:
            return outputs[0]
        return tuple(outputs) if self._per_token_tuple else (outputs[0], None)

    def _segment_forward(self, segment: torch.Tensor, cache: _SegmentCache, where: str | int, args, kwargs):
        """The module's own forward of ``segment`` with ``cache`` as its cache argument ``where`` (a
        keyword, or a position among ``args``), its states stored after: (its per-token outputs, whether
        they came as a tuple: MiniMax's returns its state beside its output, which its layer ignores;
        ZAYA's projection its queries, keys and values)."""
        if isinstance(where, int):
            result = super().forward(segment, *args[:where], cache, *args[where + 1:], **kwargs)
        else:
            result = super().forward(segment, *args, **{**kwargs, where: cache})
        cache.store()
        if not isinstance(result, tuple):
            return [result], False
        return (list(result) if self._per_token_tuple else [result[0]]), True


def _per_sequence(cls: type) -> bool:
    return issubclass(cls, _PerSequenceState)


def stateful(model: nn.Module) -> bool:
    """Whether :func:`install` gave any module of ``model`` per-sequence state."""
    return any(_per_sequence(type(m)) for m in model.modules())


def install(model: nn.Module) -> int:
    """Give every stateful module of ``model`` (one with a ``layer_idx`` whose forward reads a conv or
    recurrent state from its cache) the per-sequence forward; returns how many it has (those an
    earlier call gave it included). A stateful module that is an FSDP2 unit (RWKV's blocks) gets it
    under FSDP2's class (``shard_engine.torch_private.mix_into_class``)."""
    from shard_engine.torch_private import mix_into_class

    adapt_own_state(model)
    count = 0
    for module in model.modules():
        cls = type(module)
        if _per_sequence(cls):
            count += 1
            continue
        if not isinstance(getattr(module, "layer_idx", None), int) or not _uses_state(cls):
            continue
        mix_into_class(module, _PerSequenceState, "PerSequence", sys.modules[__name__], {
            "_continues_one_token_at_a_time": _scans_from_zero(cls),
            "_per_token_tuple": any(c.__name__ in PER_TOKEN_TUPLE_CLASSES for c in cls.__mro__)})
        count += 1
    return count
