"""Checkpoint keys to model keys, with the weight conversions ``from_pretrained`` applies.

transformers 5 keeps some weights in another layout in the model than on the Hub: a Mixtral's
experts are one fused ``mlp.experts.gate_up_proj`` [E, 2I, H] in the model and 3E per-expert
``block_sparse_moe.experts.{e}.w{1,2,3}.weight`` tensors in its checkpoints. ``from_pretrained``
converts them with the model's conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``: ``WeightRenaming`` objects
renaming keys, ``WeightConverter`` objects gathering several checkpoint tensors into one model
tensor through a chain of operations). :func:`plan_conversions` applies the same mapping to the
checkpoint's keys before any tensor is read, so that the streaming loader knows which tensors
are plain (renamed at most) and which feed a conversion, and for each conversion target whether
a rank can read only its own rows:

* **row-local**: the chain starts by stacking a list of tensors along dim 0
  (``MergeModulelist(dim=0)``: one tensor per expert) and nothing after it touches dim 0
  (``Concatenate`` along another dim). Row ``e`` of the target is made of source ``e`` of each
  list alone, so the rank owning rows [a, b) reads sources a..b-1 and runs the chain on them: its
  shard, and about 1/S of the bytes.
* **whole**: anything else; every rank reads every source, runs the chain and keeps its rows
  (the load report counts these bytes).

``core_model_loading`` is semi-private transformers API, pinned by pyproject.toml's range and by
tests that load Hub-layout checkpoints of the families that use it (tests/test_families.py).
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ConversionTarget:
    """One model tensor (or several, for chains that split) made from several checkpoint tensors."""

    name: str
    """The model key of the (first) output, as the mapping renames its sources."""
    converter: object
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Checkpoint keys per source pattern, in transformers' order (expert 0, 1, ...)."""
    row_local: bool = False
    collected: dict[str, dict[int, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    remaining: int = 0
    """Sources not read or skipped yet: the chain runs when this reaches 0."""

    def position(self, key: str) -> tuple[str, int]:
        """(pattern, index in its list) of checkpoint key ``key``."""
        for pattern, keys in self.sources.items():
            if key in keys:
                return pattern, keys.index(key)
        raise KeyError(key)

    @property
    def rows(self) -> int:
        """Rows along dim 0 of a row-local target: the length of each source list."""
        return len(next(iter(self.sources.values())))

    def run(self, model: nn.Module, offset: int = 0) -> dict[str, torch.Tensor]:
        """The chain on what was collected (indices from ``offset`` on), as WeightConverter.convert
        runs it; returns {model key: tensor}."""
        inputs = {}
        for pattern in self.converter.source_patterns:
            if pattern in self.collected:
                got = self.collected[pattern]
                inputs[pattern] = [got[i] for i in sorted(got)]
        self.collected.clear()
        for op in self.converter.operations:
            inputs = op.convert(inputs, source_patterns=self.converter.source_patterns,
                                target_patterns=self.converter.target_patterns, full_layer_name=self.name,
                                model=model, config=getattr(model, "config", None), missing_keys=None)
        full = self.name.replace("*.", "0.")
        try:
            prefix, _, suffix = next(full.partition(k) for k in inputs if k in full)
        except StopIteration:
            return dict(inputs)
        return {prefix + k + suffix: v for k, v in inputs.items()}


@dataclass
class ConversionPlan:
    renamed: dict[str, str]
    """Checkpoint key -> model key (before the base-model prefix is matched) for plain tensors."""
    target_of: dict[str, ConversionTarget]
    """Checkpoint key -> the conversion it feeds."""
    targets: list[ConversionTarget]

    @property
    def model_keys(self) -> set[str]:
        return set(self.renamed.values()) | {t.name for t in self.targets}


def plan_conversions(model: nn.Module, checkpoint_keys, expected: dict[str, torch.Tensor] | None = None
                     ) -> ConversionPlan:
    """Rename every checkpoint key as ``from_pretrained`` would and group converter sources by target.

    With ``expected`` (the model's tensors by name) and ``checkpoint_keys`` a mapping of keys to
    ``(path, TensorInfo)``: a checkpoint whose every tensor already has a model tensor's name and
    shape converts nothing, and is planned as it is without transformers' conversion tables (whose
    first use compiles about a thousand patterns: 0.14 s of a 0.6 s load, ``benchmarks.load``)."""
    if expected is not None and _nothing_to_convert(checkpoint_keys, expected):
        return ConversionPlan({k: k for k in checkpoint_keys}, {}, [])
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # a transformers without conversion mappings: keys are taken as they are
        keys = list(checkpoint_keys)
        return ConversionPlan({k: k for k in keys}, {}, [])
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = _with_quantized_companions([m for m in mapping if isinstance(m, WeightConverter)], model)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    renamed, target_of, targets = {}, {}, {}
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            renamed[key] = name
            continue
        target = targets.get(name)
        if target is None:
            target = targets[name] = ConversionTarget(name, copy.deepcopy(by_pattern[pattern]))
        target.sources.setdefault(pattern, []).append(key)
        target.remaining += 1
        target_of[key] = target
    for target in targets.values():
        target.row_local = _row_local(target)
    return ConversionPlan(renamed, target_of, list(targets.values()))


def _nothing_to_convert(tensors, expected: dict[str, torch.Tensor]) -> bool:
    if not isinstance(tensors, dict) or not tensors:
        return False
    for key, entry in tensors.items():
        target = expected.get(key)
        if target is None or tuple(target.shape) != tuple(entry[1].shape):
            return False
    return True


QUANTIZED_COMPANIONS = {
    "_scale_inv": {"_fp8": ".weight", "_scale_inv": ".weight_scale_inv"},
    "_packed_scale": {"_packed": ".weight_packed", "_packed_scale": ".weight_scale", "_packed_shape": ".weight_shape",
                      "_packed_zero_point": ".weight_zero_point"},  # zero points: asymmetric only
    "_quantized_scale": {"_quantized": ".weight", "_quantized_scale": ".weight_scale",
                         "_quantized_zero_point": ".weight_zero_point"},  # int8, fp8 by channel or tensor
    "_g_idx": {"_qweight": ".qweight", "_qzeros": ".qzeros", "_scales": ".scales", "_g_idx": ".g_idx"},  # GPTQ
    "_qzeros": {"_qweight": ".qweight", "_qzeros": ".qzeros", "_scales": ".scales"},  # AWQ
}
"""How a fused parameter stored quantized by experts is named in the model (the suffix on the
converter's target; the first key: the parameter that says the target is held so) and in the
checkpoint (the suffix on each source, in place of ``.weight``): fp8 experts' e4m3 weights and
block scales (:func:`loaders.quantization.experts.quantize_fp8_experts`), and the stored tensors of
experts quantized as linears: compressed-tensors' packed codes, scales and shapes, GPTQ's and
AWQ's (:func:`~loaders.quantization.experts.quantize_linear_experts`); GPTQ's before AWQ's (both
have ``_qzeros``)."""


def _with_quantized_companions(converters: list, model: nn.Module) -> list:
    """The model's converters, where a converter's target is held quantized (the model has
    ``<target>`` and a key of :data:`QUANTIZED_COMPANIONS`) replaced by one copy per stored tensor,
    each with the same chain: for fp8 the experts' weights into ``<target>_fp8`` and their scales
    into ``<target>_scale_inv``; for packed experts their codes, scales and shapes. As transformers'
    quantizers copy a converter for the scales a module keeps (``HfQuantizer.update_weight_conversions``)."""
    names = "\n".join(name for name, _ in model.named_parameters())
    out = []
    for converter in converters:
        sources, targets = list(converter.source_patterns), list(converter.target_patterns)
        companions = next((c for marker, c in QUANTIZED_COMPANIONS.items()
                           if len(targets) == 1 and all(s.endswith(".weight") for s in sources)
                           and re.search(re.escape(targets[0]) + marker + "$", names, re.MULTILINE)), None)
        if companions is None:
            out.append(converter)
            continue
        for suffix, stored in companions.items():
            if not re.search(re.escape(targets[0]) + suffix + "$", names, re.MULTILINE):
                continue  # a tensor this format stores only in some schemes (zero points)
            out.append(converter.copy([s.removesuffix(".weight") + stored for s in sources], [targets[0] + suffix],
                                      operations=copy.deepcopy(list(converter.operations))))
    return out


def _row_local(target: ConversionTarget) -> bool:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(target.converter.operations)
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return False
    if len(target.converter.target_patterns) != 1:
        return False
    if len({len(keys) for keys in target.sources.values()}) != 1:
        return False
    return all(isinstance(op, Concatenate) and op.dim != 0 for op in ops[1:])
