"""Length-dependent rope (dynamic NTK, longrope) computed per sequence, as transformers computes it for one.

transformers' rotary modules of ``rope_type`` ``dynamic`` and ``longrope`` pick their frequencies
from the longest position in the forward's batch (``dynamic_rope_update``): dynamic NTK rescales
the base once a sequence is longer than ``max_position_embeddings``, longrope switches from its
short to its long factors past ``original_max_position_embeddings``. The engine packs many
sequences into one row, where that maximum would be another sequence's. So each sequence here
gets the frequencies transformers gives it when it is generated alone: those of its own length
``L``, where a token at position ``p`` of a request whose prompt has ``P`` tokens has
``L = max(P, p + 1)``: every prompt token that of the whole prompt (``generate`` computes the
prompt in one forward, whatever chunks the engine splits it into), every generated token its own
length at the step that made it. That holds for a sequence recomputed after a preemption too
(its generated tokens are computed again with the frequencies they had), so its keys are what
they were.

Phi-3's, PhiMoE's and Phi-4-multimodal's ``generate`` do one thing more (their
``prepare_inputs_for_generation``): when a sequence first grows past
``original_max_position_embeddings``, they drop its cache and compute the whole sequence again,
every key with the long factors. :class:`RopeSwitch` (``recompute``) says so for such a model: the
scheduler then takes the sequence off its rank at that step and recomputes it from its tokens, as
after a preemption, and the length that picks a sequence's frequencies is its whole length when
admitted (``P`` above is then the prompt plus what it has generated).

Prefix caching: a block's keys depend on the frequencies they were computed with, so the prefix
keys' chain of a sequence admitted past the threshold starts from a root salted with what chose
them (longrope: "long"; dynamic NTK: its length), and a block is found only by a sequence that
would compute it the same way (:meth:`RopeSwitch.prefix_root`). Blocks a sequence fills while it
decodes past the threshold stay in its unsalted chain; only prompts longer than the threshold
could reach them, and those look in salted chains.

Contract. :func:`install` replaces, on one model, each rotary module of these types with a
per-sequence forward and returns the model's :class:`RopeSwitch` (None: nothing to do); the rank
engine wraps each forward in :func:`sequence_lengths` with each row's ``L``
(:func:`token_lengths`), the scheduler plans by the same :class:`RopeSwitch` (:func:`rope_switch`). Within, the rotary forward
groups the row's tokens by the frequencies their ``L`` selects (the original ones up to the
threshold; longrope's long ones, or dynamic NTK's for each length, past it) and runs the family's
own forward (``dynamic_rope_update``'s undecorated function) once per group, so cos and sin are
its arithmetic, bit for bit. Outside :func:`sequence_lengths` (warm-up, compilation) the module
is transformers' own. What transformers' stateful module does that this does not: once grown,
its dynamic frequencies stay at the longest length it has seen until a sequence shorter than
``max_position_embeddings`` resets them, so its output for a prompt depends on the prompts
generated before it; here a sequence's output depends only on itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

LENGTH_DEPENDENT = ("dynamic", "longrope")
_FREQUENCIES_KEPT = 1024  # dynamic NTK's frequencies per length, computed once each

_lengths: torch.Tensor | None = None


def rope_type(module: nn.Module) -> str | None:
    """``module``'s length-dependent rope type, or None (another rope, per-layer-type ropes, not rotary)."""
    kind = getattr(module, "rope_type", None)
    return kind if isinstance(kind, str) and kind in LENGTH_DEPENDENT else None


@dataclass(frozen=True)
class RopeSwitch:
    """A model's length-dependent rope: ``kind`` (dynamic | longrope), the ``threshold`` length past
    which its frequencies change, and whether its ``generate`` recomputes a sequence's cache when the
    sequence first passes it (``recompute``)."""

    kind: str
    threshold: int
    recompute: bool

    def prompt_length(self, tokens: int, generated: int) -> int:
        """``P`` of a sequence holding ``tokens`` tokens of which it generated ``generated``."""
        return tokens if self.recompute else tokens - generated

    def prefix_root(self, root: bytes, prompt_length: int) -> bytes:
        """The root of the prefix keys' chain of a sequence of ``P = prompt_length``: ``root`` itself up
        to the threshold, salted by what picks its frequencies past it."""
        if prompt_length <= self.threshold:
            return root
        tag = b"rope:long" if self.kind == "longrope" else b"rope:dynamic:%d" % prompt_length
        return hashlib.blake2b(root + tag, digest_size=16).digest()

    def recomputes_at(self, admitted: int, computed: int, tokens: int) -> bool:
        """Whether a sequence admitted with ``admitted`` tokens (its keys' frequencies chosen then)
        that has computed ``computed`` of its ``tokens`` tokens is recomputed whole at this step:
        its generate's cache drop, at the step that passes the threshold, once."""
        return (self.recompute and admitted <= self.threshold and computed == self.threshold
                and tokens == self.threshold + 1)


def _threshold(module: nn.Module, kind: str) -> int:
    """The length past which ``module``'s frequencies change: longrope's
    ``original_max_position_embeddings``; dynamic NTK's ``max_position_embeddings`` (its module's
    ``original_max_seq_len``)."""
    if kind == "longrope":
        return int(module.config.rope_parameters["original_max_position_embeddings"])
    return int(getattr(module, "original_max_seq_len", None) or module.config.max_position_embeddings)


def rope_switch(model: nn.Module) -> RopeSwitch | None:
    """``model``'s :class:`RopeSwitch`, or None where its rope does not depend on the length."""
    for module in model.modules():
        kind = rope_type(module)
        if kind is None:
            continue
        # Phi-3's generate drops the cache at the switch (its prepare_inputs_for_generation, read from the source
        # transformers ships, so that a family that gains or loses it follows)
        prepare = getattr(type(model), "prepare_inputs_for_generation", None)
        try:
            source = inspect.getsource(prepare) if prepare is not None else ""
        except (OSError, TypeError):
            source = ""
        recompute = kind == "longrope" and "original_max_position_embeddings" in source
        return RopeSwitch(kind, _threshold(module, kind), recompute)
    return None


def install(model: nn.Module) -> RopeSwitch | None:
    """Give every rotary module of ``model`` with a length-dependent rope the per-sequence forward;
    returns the model's :class:`RopeSwitch` (None: none has one). Raises ValueError for one whose
    forward is not transformers' decorated one (nothing to call per group)."""
    for name, module in model.named_modules():
        kind = rope_type(module)
        if kind is None:
            continue
        raw = getattr(type(module).forward, "__wrapped__", None)
        if raw is None:
            raise ValueError(f"{name} ({type(module).__name__}): rope_type {kind!r} without transformers' "
                             "dynamic_rope_update, so its frequencies cannot be chosen per sequence")
        module.forward = _PerSequence(module, kind, raw)
    return rope_switch(model)


@contextlib.contextmanager
def sequence_lengths(lengths: torch.Tensor | None) -> Iterator[None]:
    """Within, the installed rotary forwards take each token's frequencies from ``lengths`` (one
    ``L`` a token of the row: :func:`token_lengths`)."""
    global _lengths
    previous, _lengths = _lengths, lengths
    try:
        yield
    finally:
        _lengths = previous


def token_lengths(items: list[tuple[int, int, int]]) -> torch.Tensor:
    """``L = max(P, p + 1)`` for each token of a row of ``items``: (first position, tokens, prompt length P)."""
    lengths = [max(prompt, p + 1) for start, count, prompt in items for p in range(start, start + count)]
    return torch.tensor(lengths, dtype=torch.long)


class _PerSequence:
    """The rotary module's forward, per sequence within :func:`sequence_lengths` (the module's docstring)."""

    def __init__(self, module: nn.Module, kind: str, raw):
        self.module, self.kind, self.raw = module, kind, raw
        self.decorated = type(module).forward.__get__(module)
        self.threshold = _threshold(module, kind)
        self._frequencies: dict[object, torch.Tensor] = {}
        self._disabled = None  # self._call out of dynamo's reach, made at the first call

    def _inv_freq(self, key, device) -> torch.Tensor:
        if key is None:
            return self.module.original_inv_freq.to(device)
        if key not in self._frequencies:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if len(self._frequencies) >= _FREQUENCIES_KEPT:
                self._frequencies.clear()
            # longrope's long factors: what transformers computes them with (any length past the threshold);
            # dynamic NTK's length as transformers passes it (a tensor: max(position_ids) + 1), whose arithmetic
            # in the base's formula is float32, not Python's float64
            seq_len = self.threshold + 1 if key == "long" else torch.tensor(key, dtype=torch.long, device=device)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.kind](self.module.config, device, seq_len=seq_len)
            if self.kind == "dynamic" and scaling != self.module.attention_scaling:
                raise ValueError(f"dynamic rope scaling {scaling} != the module's {self.module.attention_scaling}")
            self._frequencies[key] = inv_freq
        return self._frequencies[key].to(device)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        # dynamo does not trace it (a compiled whole model breaks its graph here); the compiler is imported
        # when a forward runs, not with this module (the grammar workers import the engine without it)
        if self._disabled is None:
            self._disabled = torch.compiler.disable(self._call)
        return self._disabled(x, position_ids, *args, **kwargs)

    def _call(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        lengths = _lengths
        if lengths is None or args or kwargs or position_ids.shape[0] != 1 or lengths.numel() != position_ids.shape[1]:
            return self.decorated(x, position_ids, *args, **kwargs)
        keys = [None if length <= self.threshold else ("long" if self.kind == "longrope" else length)
                for length in lengths.tolist()]
        groups: dict[object, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        module = self.module
        kept = module.inv_freq
        try:
            if len(groups) == 1:
                module.inv_freq = self._inv_freq(keys[0], x.device)
                return self.raw(module, x, position_ids)
            cos = sin = None
            for key, rows in groups.items():
                index = torch.tensor(rows, device=position_ids.device)
                module.inv_freq = self._inv_freq(key, x.device)
                part_cos, part_sin = self.raw(module, x, position_ids[:, index])
                if cos is None:
                    cos = part_cos.new_empty(1, position_ids.shape[1], part_cos.shape[-1])
                    sin = part_sin.new_empty(cos.shape)
                cos[:, index], sin[:, index] = part_cos, part_sin
            return cos, sin
        finally:
            module.inv_freq = kept
