"""How each linear format stores a weight and how it is dequantized: the tensors' shapes for a
layer (:func:`stored_shapes`, which the loader's shape check holds the checkpoint to) and the
float32 weight from them (:func:`dequantize_stored`: FP8 blocks, GPTQ and AWQ as their
specifications say; compressed-tensors' formats through its own compressors). Shared by
:class:`~loaders.quantization.linear.QuantizedLinear` and the stacked quantized experts
(:mod:`loaders.quantization.experts`)."""

from __future__ import annotations

import math

import torch

from loaders.errors import CheckpointError
from loaders.quantization.formats import LinearFormat, dequantize_fp8_block, enum_value, fp8_scale_shape


def stored_shapes(fmt: LinearFormat, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor ``fmt`` stores for an ``out_features x in_features`` weight."""
    if fmt.kind == "fp8-block":
        return {"weight": (out_features, in_features),
                "weight_scale_inv": fp8_scale_shape(out_features, in_features, fmt.block)}
    if fmt.kind in ("gptq", "awq"):
        groups = math.ceil(in_features / (fmt.group_size or in_features))
        packed_out = math.ceil(out_features * fmt.bits / 32)
        shapes = {"qweight": ((math.ceil(in_features * fmt.bits / 32), out_features) if fmt.kind == "gptq"
                              else (in_features, packed_out)),
                  "qzeros": (groups, packed_out), "scales": (groups, out_features)}
        if fmt.kind == "gptq":
            shapes["g_idx"] = (in_features,)
        return shapes
    w = fmt.scheme.weights
    strategy = enum_value(w.strategy)
    groups = {"tensor": None, "channel": 1, "group": math.ceil(in_features / (w.group_size or in_features))}[strategy]
    scale = (1,) if groups is None else (out_features, groups)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in fmt.stored_names:
        if name == "weight_packed":
            shapes[name] = (out_features, math.ceil(in_features * w.num_bits / 32))
        elif name == "weight_shape":
            shapes[name] = (2,)
        elif name == "weight":
            shapes[name] = (out_features, in_features)
        elif name == "weight_scale":
            shapes[name] = scale
        elif name == "weight_zero_point":
            shapes[name] = ((math.ceil(out_features * w.num_bits / 32), scale[1]) if fmt.kind == "pack-quantized"
                            else scale)
        else:
            raise CheckpointError(f"compressed-tensors stores {name!r} for {fmt.describe()}, which is not supported")
    return shapes


def dequantize_stored(fmt: LinearFormat, tensors: dict[str, torch.Tensor], out_features: int,
                      in_features: int) -> torch.Tensor:
    """An FP8-block, GPTQ or AWQ linear's weight [out, in] in float32 from its stored ``tensors``
    (by their checkpoint names): a QuantizedLinear's, or one expert's of stacked quantized experts
    (``loaders.quantization.experts``)."""
    if fmt.kind == "fp8-block":
        return dequantize_fp8_block(tensors["weight"], tensors["weight_scale_inv"], fmt.block)
    if fmt.kind == "gptq":
        return dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], fmt.bits,
                               fmt.zero_offset, in_features, out_features)
    if fmt.kind == "awq":
        return dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], fmt.group_size or in_features,
                              in_features, out_features)
    raise ValueError(f"{fmt.kind} is dequantized by compressed-tensors' compressors")


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``bits``-wide unsigned codes of int32 words, the first code in the lowest bits (GPTQ's and
    AWQ's packing), unpacked along ``dim`` (0 or 1) of a 2-D tensor: [R, C] -> [R * 32/bits, C] or
    [R, C * 32/bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    if dim == 0:
        codes = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask
        return codes.reshape(-1, packed.shape[1])
    codes = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask
    return codes.reshape(packed.shape[0], -1)


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int, zero_offset: int, in_features: int,
                    out_features: int) -> torch.Tensor:
    """A GPTQ linear's weight [out, in] in float32: for input row i of group ``g_idx[i]``,
    ``(code - (zero + zero_offset)) * scale``, the codes and zero points unpacked as AutoGPTQ's and
    GPTQModel's torch kernels unpack them (zeros one by one: a v1 zero point is its stored code plus
    one), the integer difference exact, the product in float32 (their kernels multiply in the
    scales' fp16)."""
    codes = unpack_codes(qweight, bits, 0)[:in_features]
    zeros = unpack_codes(qzeros, bits, 1)[:, :out_features] + zero_offset
    groups = g_idx.long()
    return ((codes - zeros[groups]).to(torch.float32) * scales.to(torch.float32)[groups]).t()


AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Where each of 8 consecutive output columns sits among the 8 codes of an AWQ word (AutoAWQ packs
columns 0, 2, 4, 6, 1, 3, 5, 7 into codes 0-7)."""


def dequantize_awq(qweight, qzeros, scales, group_size: int, in_features: int, out_features: int) -> torch.Tensor:
    """An AWQ (GEMM layout) linear's weight [out, in] in float32: ``(code - zero) * scale`` of each
    input row's group, codes and zero points unpacked along the output and put back in column order."""
    order = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)
    columns = (torch.arange(out_features, device=qweight.device) // 8 * 8 + order.repeat(-(-out_features // 8))
               [:out_features])
    codes = unpack_codes(qweight, 4, 1)[:, columns]
    zeros = unpack_codes(qzeros, 4, 1)[:, columns]
    groups = torch.arange(in_features, device=qweight.device) // group_size
    return ((codes - zeros[groups]).to(torch.float32) * scales.to(torch.float32)[groups]).t()
