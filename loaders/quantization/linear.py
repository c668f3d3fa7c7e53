"""The quantized linear: the checkpoint's tensors as parameters, dequantized where a forward runs.

:class:`QuantizedLinear` replaces an ``nn.Linear`` of the meta skeleton (:func:`quantize_skeleton`).
Its parameters have the shapes its format implies for the layer (so the loader's shape check
refuses a checkpoint that disagrees, naming the tensor) and the dtypes the checkpoint stores them
in; all of them are row-sharded (``row_sharded``: ``shard_engine.units`` reads it). Its forward
runs on the gathered tensors: the weight dequantized by the function transformers' load uses
(compressed-tensors' compressor ``decompress``; fp8 blocks times ``weight_scale_inv`` in float32;
GPTQ's and AWQ's codes unpacked as their specifications say, ``(code - zero) * scale`` in float32),
the input fake-quantized where the scheme quantizes activations (compressed-tensors'
``forward_quantize``, as its quantized forward does), then ``F.linear`` in the input's dtype.
Nothing dequantized is kept between forwards.

One exception to dequantizing, where torch has a kernel that reads the stored weight itself: INT8
weights with one symmetric scale per output row and unquantized activations (``int-quantized``
weight-only, what ``--quantization int8`` writes), computed in bf16 or fp16 on CPU, for a forward
of at most :data:`INT8_KERNEL_MAX_ROWS` rows (a decode step's) go through
``torch._weight_int8pack_mm``, which multiplies by the int8 weight and scales each output after
the sum (both branches inside one opaque op, ``torch.ops.hsdp.int8_linear``, so that a compiled
graph takes the same branch as eager for every row count). That is the exact product of the
stored weights, where transformers' bf16 load rounds each dequantized weight to bf16 first:
outputs within bf16 rounding of the reference, not bit-equal (float32, longer forwards and other
formats keep the reference path; on CPUs without AVX-512 the kernel is slower than the reference
and :func:`int8_kernel_refusal` says so).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from loaders.errors import CheckpointError
from loaders.quantization.experts import quantize_fp8_experts, quantize_fused_experts, quantize_linear_experts
from loaders.quantization.formats import COMPRESSED_FORMATS, MXFP4_EXPERTS, LinearFormat, QuantizationPlan, enum_value
from loaders.quantization.storage import dequantize_stored, stored_shapes
from shard_engine.ops import define_op

logger = logging.getLogger(__name__)

INT8_KERNEL_MAX_ROWS = 16
"""Rows (tokens) up to which an INT8 weight-only forward uses ``torch._weight_int8pack_mm``: its time
grows with the rows (about 1 ms a row over the bench Llama's 77 linears on one AVX-512 thread) where
dequantizing's is nearly fixed. Served at 16 clients, 64 gave a later first token than 16 (steps that
carry a prompt chunk: benchmarks/RESULTS.md, session 23)."""
INT8_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.hsdp.int8_linear``: an INT8 weight-only layer by channel (symmetric; ``scale``
    [out, 1]) in bf16 or fp16: torch's int8 kernel for up to :data:`INT8_KERNEL_MAX_ROWS` rows,
    else the weight dequantized as compressed-tensors does it (``weight.to(dtype) * scale``, the
    model's dtype: bit-equal to its decompress, tested) and ``F.linear``. An opaque op, so that a
    compiled graph of symbolic rows (decode steps and prompt steps alike) chooses when it runs."""
    rows = x.shape[:-1].numel()
    if 0 < rows <= INT8_KERNEL_MAX_ROWS:
        out = torch._weight_int8pack_mm(x.reshape(rows, x.shape[-1]).contiguous(), weight,
                                        scale.reshape(-1).to(x.dtype))
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight.to(x.dtype) * scale.to(x.dtype), bias)


def _int8_linear_fake(x, weight, scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


int8_linear = define_op("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor", _int8_linear,
                        _int8_linear_fake)


def int8_kernel_refusal() -> str | None:
    """Why this host's INT8 weight-only layers keep the reference path, or None (the kernel is used).
    torch's CPU kernel vectorizes with AVX-512 only: on AVX2 it is slower than dequantizing
    (benchmarks/RESULTS.md, session 14), and in float32 everywhere."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return "this torch has no _weight_int8pack_mm"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return f"this CPU's vector unit is {capability}, and torch's int8 kernel vectorizes only with AVX-512"
    return None


_INT8_KERNEL = int8_kernel_refusal() is None


QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32)
"""Storage dtypes that never hold a plain weight: such a tensor under a dense layer's name is an error,
never a silent cast."""


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as stored (see the module's docstring)."""

    def __init__(self, in_features: int, out_features: int, fmt: LinearFormat, dtypes: dict[str, torch.dtype],
                 bias: nn.Parameter | None):
        super().__init__()
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        shapes = stored_shapes(fmt, out_features, in_features)
        self.row_sharded = tuple(n for n in shapes if n != "weight_shape")
        self.quantized_tensor_names = fmt.stored_names  # (check_nothing_else_quantized, quantized_bytes)
        for name, shape in shapes.items():
            tensor = torch.empty(shape, dtype=dtypes[name], device="meta")
            if name == "weight_shape":  # two integers: read whole by every rank, checked at the first forward
                self.register_buffer(name, torch.zeros(shape, dtype=dtypes[name]), persistent=True)
            else:
                self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.bias = bias
        self._checked = False
        # resolved once: a forward runs every step
        self._names = fmt.stored_names
        self._compressor = None
        # torch's int8 kernel, where the host has it: INT8 weight-only, symmetric, by channel
        w = fmt.scheme.weights if fmt.scheme is not None else None
        self._int8_kernel = (_INT8_KERNEL and fmt.kind == "int-quantized" and fmt.scheme.input_activations is None
                             and w.num_bits == 8 and w.symmetric and enum_value(w.strategy) == "channel")
        if fmt.kind in COMPRESSED_FORMATS:
            from compressed_tensors.compressors import BaseCompressor

            self._compressor = BaseCompressor.get_value_from_registry(fmt.kind)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format.describe()}"

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as transformers' load of the checkpoint holds it in a model of ``dtype``
        (float32 for fp8 blocks, cast to ``dtype`` by the caller as transformers casts it)."""
        fmt = self.format
        if fmt.kind in ("fp8-block", "gptq", "awq"):
            return dequantize_stored(fmt, {n: getattr(self, n) for n in fmt.stored_names}, self.out_features,
                                     self.in_features)
        if not self._checked:
            self._check_shape()
        state = {name: getattr(self, name) for name in self._names}
        # transformers holds the scales in the model's dtype (compressed-tensors' initialize), whatever the
        # checkpoint stored them in, and dequantizes in it
        state["weight_scale"] = state["weight_scale"].to(dtype)
        if "weight_shape" in state:
            state["weight_shape"] = torch.Size((self.out_features, self.in_features))
        return self._compressor.decompress(state, fmt.scheme)["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._int8_kernel and x.dtype in INT8_KERNEL_DTYPES and x.device.type == "cpu":
            return int8_linear(x, self.weight, self.weight_scale, self.bias)
        weight = self.dequantized_weight(x.dtype).to(x.dtype)
        scheme = self.format.scheme
        if scheme is not None and scheme.input_activations is not None:
            x = quantize_input(x, scheme.input_activations)
        return F.linear(x, weight, self.bias)

    def _check_shape(self) -> None:
        stored = getattr(self, "weight_shape", None)
        if stored is not None and stored.device.type != "meta" and \
                tuple(int(v) for v in stored.tolist()) != (self.out_features, self.in_features):
            raise CheckpointError(f"weight_shape {stored.tolist()} != the layer's "
                                  f"{[self.out_features, self.in_features]}")
        self._checked = True


def quantize_input(x: torch.Tensor, args) -> torch.Tensor:
    """Dynamic per-token fake quantization of a linear's input, as compressed-tensors' quantized
    forward does it (the same function)."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize

    if x.numel() == 0:
        return x
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=None)
    return fake_quantize(x=x, scale=scale, zero_point=zero_point, args=args)


def quantize_skeleton(model: nn.Module, plan: QuantizationPlan, stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      path: str | None = None, fused: dict[str, tuple[list[str], int]] | None = None
                      ) -> tuple[dict[str, int], set[str]]:
    """Swap the linears of ``model`` (a meta skeleton) that the checkpoint stores quantized for
    :class:`QuantizedLinear`, and its fused experts for their quantized forms
    (:mod:`loaders.quantization.experts`). ``stored``: model-named checkpoint tensors -> (shape,
    dtype); ``fused``: fused experts parameters made by a conversion -> (their sources' keys, the
    parts concatenated along their rows). Returns ({format description: layers}, the checkpoint
    keys of conversion sources the quantized experts take). A linear the plan quantizes whose
    tensors the checkpoint lacks stays dense; a dense layer whose checkpoint weight has a
    quantized dtype is an error naming ``path`` (the checkpoint) and the tensor."""
    counts: dict[str, int] = {}
    taken: set[str] = set()
    if plan.method == "mxfp4":
        experts = quantize_fused_experts(model, stored, path=path)
        if experts:
            counts[MXFP4_EXPERTS] = experts
    if plan.method == "fp8" and fused:
        block = plan.formats[0][1].block
        experts, taken = quantize_fp8_experts(model, fused, stored, block, path=path)
        if experts:
            counts[f"fp8 e4m3 experts, {block[0]}x{block[1]} blocks"] = experts
    if plan.method in ("compressed-tensors", "gptq", "awq") and fused:
        experts, taken = quantize_linear_experts(model, plan, fused, stored, path=path)
        counts.update(experts)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        fmt = plan.format_for(name, module)
        names = fmt.stored_names if fmt is not None else ()
        if fmt is None or not all(f"{name}.{n}" in stored for n in names):
            weight = stored.get(f"{name}.weight")
            if weight is not None and weight[1] in QUANTIZED_DTYPES:
                raise CheckpointError(f"{name}.weight is stored as {weight[1]} but the quantization_config does not "
                                      f"quantize {name} (or its scales are missing)", path=path,
                                      tensor=f"{name}.weight")
            continue
        dtypes = {n: stored[f"{name}.{n}"][1] for n in names}
        model.set_submodule(name, QuantizedLinear(module.in_features, module.out_features, fmt, dtypes, module.bias))
        counts[fmt.describe()] = counts.get(fmt.describe(), 0) + 1
    return counts, taken


QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_packed", "weight_zero_point", "weight_shape",
                      "weight_g_idx", "input_scale", "activation_scale", "weight_global_scale", "qweight", "qzeros",
                      "g_idx")


def check_nothing_else_quantized(model: nn.Module, stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
                                 path: str | None = None, taken: set[str] = frozenset()) -> None:
    """Refuse, before reading, a checkpoint tensor stored quantized (by its dtype or its name) that no
    quantized module of ``model`` takes (``taken``: conversion sources the quantized experts take):
    experts quantized in a format served for linears only, say. Read as a dense weight it would be
    cast without its scales."""
    taken = set(taken) | {f"{fqn}.{n}" for fqn, m in model.named_modules()
                          for n in getattr(m, "quantized_tensor_names", ())}
    for name, (_, dtype) in stored.items():
        if name in taken:
            continue
        if dtype in QUANTIZED_DTYPES or name.rpartition(".")[2] in QUANTIZED_SUFFIXES:
            raise CheckpointError(f"{name} is stored quantized ({dtype}) but belongs to no layer the server "
                                  "dequantizes (of experts, MXFP4, fp8 blocks, compressed-tensors' pack-, int- and "
                                  "float-quantized, GPTQ and AWQ are served; other non-Linear weights are not)",
                                  path=path, tensor=name)


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of quantized layers' tensors: ``weights`` (packed or fp8/int8 weights, MXFP4
    blocks, fp8 and packed experts), ``scales`` (scales, zero points, GPTQ's ``g_idx``); counted from the local shards;
    ``layers``: quantized linears and experts modules."""
    from torch.distributed.tensor import DTensor

    out = {"weights": 0, "scales": 0, "layers": 0}
    for module in model.modules():
        if not getattr(module, "quantized_tensor_names", ()):
            continue
        out["layers"] += 1
        for name in module.row_sharded:
            p = getattr(module, name)
            local = p.to_local() if isinstance(p, DTensor) else p
            key = "weights" if name in ("weight", "weight_packed", "qweight") or name.endswith(
                ("_blocks", "_fp8", "_packed", "_qweight", "_quantized")) else "scales"
            out[key] += local.numel() * local.element_size()
    return out
