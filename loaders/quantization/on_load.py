"""Quantizing a plain checkpoint while it streams (``--quantization int8|fp8``).

Each linear of the skeleton but ``lm_head`` (vLLM's dynamic FP8 leaves it too) becomes a
:class:`~loaders.quantization.linear.QuantizedLinear` of compressed-tensors' weight-only format
with one scale per output row (``int-quantized`` INT8 or ``float-quantized`` FP8 e4m3, symmetric,
min-max): a row's scale needs nothing but that row, so each rank quantizes the rows it reads, as
they arrive (:func:`quantize_rows`), and no unit is ever whole in high precision on any rank.
A trainer's push (``server.weights``) sends such a linear's dense rows (:func:`dense_manifest`),
which each serving rank quantizes the same way as they arrive.
The tensors it makes are those compressed-tensors' own compressor writes for the same weights
(its ``calculate_qparams`` and ``compress``): serving a checkpoint with ``--quantization int8``
computes what serving that checkpoint quantized by compressed-tensors does, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.quantization.formats import LinearFormat
from loaders.quantization.linear import QuantizedLinear

KINDS = ("int8", "fp8")
KEEP = ("lm_head",)
"""Linears left in the model's dtype (their names' last part)."""


def on_load_format(kind: str) -> LinearFormat:
    """The weight-only, per-row format ``--quantization kind`` quantizes into."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind not in KINDS:
        raise ValueError(f"--quantization must be one of {KINDS}, got {kind!r}")
    fmt = "int-quantized" if kind == "int8" else "float-quantized"
    args = QuantizationArgs(num_bits=8, type="int" if kind == "int8" else "float", symmetric=True, strategy="channel")
    return LinearFormat(fmt, scheme=QuantizationScheme(targets=["Linear"], weights=args, format=fmt))


def quantize_skeleton_on_load(model: nn.Module, kind: str, dtype: torch.dtype, checkpoint_names: set[str]) -> dict:
    """Swap every ``nn.Linear`` of the meta skeleton whose weight the checkpoint holds (model names)
    but :data:`KEEP` for a QuantizedLinear that quantizes its rows as they are read. Returns
    {format description: layers}."""
    fmt = on_load_format(kind)
    weight_dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    counts: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.rpartition(".")[2] in KEEP or f"{name}.weight" not in checkpoint_names:
            continue
        replacement = QuantizedLinear(module.in_features, module.out_features, fmt,
                                      {"weight": weight_dtype, "weight_scale": dtype}, module.bias)
        replacement.quantize_on_load = True
        model.set_submodule(name, replacement)
        counts[fmt.describe() + " (quantized on load)"] = counts.get(fmt.describe() + " (quantized on load)", 0) + 1
    return counts


def quantize_rows(rows: torch.Tensor, fmt: LinearFormat) -> dict[str, torch.Tensor]:
    """Rows of a dense weight (in the model's dtype) as ``fmt`` stores them: {``weight``,
    ``weight_scale``}, by compressed-tensors' min-max per row and its compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = fmt.scheme.weights
    if rows.shape[0] == 0:
        scale = rows.new_empty((0, 1))
        return {"weight": torch.empty(rows.shape, dtype=torch.int8 if args.type == "int" else torch.float8_e4m3fn),
                "weight_scale": scale}
    scale, zero_point = calculate_qparams(rows.amin(dim=-1, keepdim=True), rows.amax(dim=-1, keepdim=True), args)
    state = {"weight": rows, "weight_scale": scale, "weight_zero_point": zero_point}
    stored = BaseCompressor.get_value_from_registry(fmt.kind).compress(state, fmt.scheme)
    return {"weight": stored["weight"], "weight_scale": stored["weight_scale"]}


def dense_manifest(model: nn.Module, manifest: list) -> tuple[list, dict[str, nn.Module]]:
    """``manifest`` (``shard_engine.transfer.Slot``s of what the model holds) as a sender of dense
    weights sends it: each linear quantized on load as its dense weight, of its rows' shape in its
    scale's dtype (the model's), its ``weight_scale`` dropped (computed from the rows by
    :func:`quantize_rows`, as at load); and {that weight's name: its module}."""
    from shard_engine.transfer import Slot

    on_load = {f"{fqn}.weight": m for fqn, m in model.named_modules() if getattr(m, "quantize_on_load", False)}
    scales = {name.removesuffix("weight") + "weight_scale" for name in on_load}
    out = []
    for slot in manifest:
        if slot.name in scales:
            continue
        module = on_load.get(slot.name)
        if module is not None:
            slot = Slot(slot.name, slot.shape, str(module.weight_scale.dtype).removeprefix("torch."), slot.sharded)
        out.append(slot)
    sent = {slot.name for slot in out}
    return out, {name: m for name, m in on_load.items() if name in sent}
