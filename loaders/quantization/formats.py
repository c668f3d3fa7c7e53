"""What a checkpoint's ``quantization_config`` asks for, decided before any weight is read.

:func:`quantization_plan` returns None for a plain checkpoint and a :class:`QuantizationPlan` for
one the server computes exactly:

* ``quant_method: fp8`` (transformers' FineGrainedFP8: DeepSeek-V3/R1, Qwen3-FP8, ...): e4m3
  weights with float32 ``weight_scale_inv`` per ``weight_block_size`` block, dynamic activations;
* ``quant_method: compressed-tensors`` (what llm-compressor writes) in the formats
  ``pack-quantized`` (INT4/INT8 weight-only by channel or group, symmetric or with zero points),
  ``int-quantized`` (INT8 weights by channel, W8A8 with dynamic per-token activations) and
  ``float-quantized`` (FP8 weights, weight-only or with dynamic per-token FP8 activations);
* ``quant_method: gptq`` (AutoGPTQ / GPTQModel's ``gptq`` and ``gptq_v2`` checkpoint formats):
  2-, 4- or 8-bit weights packed along the input into int32 ``qweight``, zero points packed along
  the output into ``qzeros``, ``scales`` and ``g_idx`` per input row (activation ordering too);
* ``quant_method: awq`` (AutoAWQ's ``gemm`` layout): 4-bit weights packed along the output in
  AWQ's interleaved order, zero points likewise, ``scales`` by group;
* ``quant_method: mxfp4`` (gpt-oss): fused experts as MXFP4 blocks and scales
  (:mod:`loaders.quantization.experts`), every linear in the model's dtype.

Anything else (another method: bitsandbytes, HQQ, ...; 3-bit GPTQ, AWQ's GEMV layouts, static
activation scales, a quantized KV cache, sparsity, compressed-tensors' activation ordering,
transforms) raises :class:`loaders.errors.UnsupportedQuantizationError` naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from loaders.errors import UnsupportedQuantizationError

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4")
COMPRESSED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
GPTQ_BITS = (2, 4, 8)
"""Bit widths whose codes tile an int32 word (GPTQ's 3-bit codes straddle words: refused)."""
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""GPTQ checkpoint formats and the offset their stored zero points carry: AutoGPTQ's original
(``gptq``, "v1") stores each zero point minus one, GPTQModel's ``gptq_v2`` stores it as is."""
AWQ_VERSIONS = ("gemm",)
MXFP4_EXPERTS = "mxfp4 experts (e2m1, a power-of-two scale per 32)"
FP8 = torch.float8_e4m3fn
"""The fp8 method's weight dtype (e4m3: the only ``fmt`` served)."""


@dataclass(frozen=True)
class LinearFormat:
    """How one quantized linear is stored and computed. ``kind``: ``fp8-block``, ``gptq``, ``awq``
    or one of :data:`COMPRESSED_FORMATS`; ``scheme``: compressed-tensors' ``QuantizationScheme`` of
    the module (None otherwise); ``block``: fp8's (rows, columns) per scale; ``bits``,
    ``group_size`` (None: one group over the whole input), ``zero_offset`` (GPTQ's stored zero
    points plus this are the zero points) and ``act_order`` for GPTQ and AWQ."""

    kind: str
    scheme: object = None
    block: tuple[int, int] | None = None
    bits: int = 0
    group_size: int | None = None
    zero_offset: int = 0
    act_order: bool = False

    @property
    def stored_names(self) -> tuple[str, ...]:
        """The module's tensors in the checkpoint (besides ``bias``)."""
        if self.kind == "fp8-block":
            return ("weight", "weight_scale_inv")
        if self.kind == "gptq":
            return ("qweight", "qzeros", "scales", "g_idx")
        if self.kind == "awq":
            return ("qweight", "qzeros", "scales")
        from compressed_tensors.compressors import BaseCompressor

        return tuple(BaseCompressor.get_value_from_registry(self.kind).compression_param_names(self.scheme))

    def describe(self) -> str:
        if self.kind == "fp8-block":
            return f"fp8 e4m3, {self.block[0]}x{self.block[1]} blocks"
        if self.kind in ("gptq", "awq"):
            group = f"group {self.group_size}" if self.group_size else "per channel"
            return f"{self.kind}: int{self.bits} {group}{' act-order' if self.act_order else ''}"
        w, a = self.scheme.weights, self.scheme.input_activations
        group = f" group {w.group_size}" if w.strategy == "group" else f" per {w.strategy}"
        act = f", {a.type}{a.num_bits} activations per {a.strategy} (dynamic)" if a is not None else ""
        return f"{self.kind}: {w.type}{w.num_bits}{group}{'' if w.symmetric else ' asymmetric'}{act}"


@dataclass
class QuantizationPlan:
    """A checkpoint's quantization: ``method``, and :meth:`format_for` a module's format."""

    method: str
    formats: list[tuple[list[str], LinearFormat]] = field(default_factory=list)  # (targets, format)
    ignore: list[str] = field(default_factory=list)

    def format_for(self, name: str, module: torch.nn.Module) -> LinearFormat | None:
        """The format of linear ``name`` if the config quantizes it (the checkpoint confirms it)."""
        if self.method in ("fp8", "gptq", "awq", "mxfp4"):  # every linear the checkpoint stores quantized
            if not self.formats:  # mxfp4: its experts only (loaders.quantization.experts)
                return None
            if any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in self.ignore):
                return None
            return self.formats[0][1]
        from compressed_tensors.utils import match_targets

        if self.ignore and match_targets(name, module, self.ignore):
            return None
        # as compressed-tensors applies config groups: the most specific target wins (an exact name,
        # then a regex, then a class name), and of equals the later group
        best, chosen = 3, None
        for targets, fmt in self.formats:
            for target in match_targets(name, module, targets):
                rank = 1 if target.startswith("re:") else 0 if target == name else 2
                if rank <= best:
                    best, chosen = rank, fmt
        return chosen

    def describe(self) -> str:
        if self.method == "mxfp4":
            return MXFP4_EXPERTS
        return "; ".join(sorted({fmt.describe() for _, fmt in self.formats}))


def quantization_plan(config, path: str | None = None) -> QuantizationPlan | None:
    """``config``'s quantization (a transformers config or its dict), or None where it has none.
    Raises :class:`UnsupportedQuantizationError` naming what cannot be served; ``path`` (the
    config file) goes into the error."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else None
        qc = getattr(text, "quantization_config", None) if text is not None and text is not config else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")

    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(f"quantization_config: {what}", path=path)

    if method == "fp8":
        return _fp8_plan(qc, refuse)
    if method == "compressed-tensors":
        return _compressed_plan(qc, refuse)
    if method == "gptq":
        return _gptq_plan(qc, refuse)
    if method == "awq":
        return _awq_plan(qc, refuse)
    if method == "mxfp4":
        return QuantizationPlan("mxfp4", ignore=list(qc.get("modules_to_not_convert") or []))
    raise refuse(f"quant_method {qc.get('quant_method')!r} is not supported (supported: {', '.join(SUPPORTED_METHODS)})")


def _fp8_plan(qc: dict, refuse) -> QuantizationPlan:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"fp8 activation_scheme {qc.get('activation_scheme')!r} is not supported (static activation "
                     "scales; supported: dynamic)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"fp8 fmt {qc.get('fmt')!r} is not supported (supported: e4m3)")
    block = qc.get("weight_block_size")
    if block is None:
        raise refuse("fp8 without weight_block_size (per-tensor scales) is not supported in the fp8 method's layout "
                     "(compressed-tensors float-quantized per-tensor is)")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise refuse(f"fp8 weight_block_size {block!r} is not two positive integers")
    fmt = LinearFormat("fp8-block", block=(int(block[0]), int(block[1])))
    return QuantizationPlan("fp8", [(["Linear"], fmt)], list(qc.get("modules_to_not_convert") or []))


def _group_size(qc: dict, refuse) -> int | None:
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise refuse(f"{qc.get('quant_method')} group_size {group!r} is not a positive integer or -1")
    return None if group == -1 else group


def _gptq_plan(qc: dict, refuse) -> QuantizationPlan:
    """AutoGPTQ / GPTQModel checkpoints (transformers' ``GPTQConfig``)."""
    bits = qc.get("bits")
    if bits not in GPTQ_BITS:
        raise refuse(f"gptq bits {bits!r} are not supported (supported: {', '.join(map(str, GPTQ_BITS))})")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise refuse(f"gptq checkpoint_format {fmt!r} is not supported (supported: {', '.join(GPTQ_FORMATS)})")
    if qc.get("dynamic"):
        raise refuse("gptq dynamic (per-module bits and groups) is not supported")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise refuse(f"gptq pack_dtype {qc.get('pack_dtype')!r} is not supported (supported: int32)")
    linear = LinearFormat("gptq", bits=bits, group_size=_group_size(qc, refuse), zero_offset=GPTQ_FORMATS[fmt],
                          act_order=bool(qc.get("desc_act")))
    return QuantizationPlan("gptq", [(["Linear"], linear)], list(qc.get("modules_to_not_convert") or []))


def _awq_plan(qc: dict, refuse) -> QuantizationPlan:
    """AutoAWQ checkpoints (transformers' ``AwqConfig``) in the GEMM layout, the one AutoAWQ writes
    by default (its other kernels repack it when they load)."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse(f"awq bits {bits!r} are not supported (supported: 4)")
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise refuse(f"awq version {version!r} is not supported (supported: {', '.join(AWQ_VERSIONS)}; "
                     "GEMV layouts pack differently)")
    if not qc.get("zero_point", True):
        raise refuse("awq zero_point false is not supported")
    linear = LinearFormat("awq", bits=4, group_size=_group_size(qc, refuse))
    return QuantizationPlan("awq", [(["Linear"], linear)], list(qc.get("modules_to_not_convert") or []))


def _compressed_plan(qc: dict, refuse) -> QuantizationPlan:
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise refuse(f"compressed-tensors checkpoints need the compressed-tensors package ({e})") from None
    if qc.get("sparsity_config"):
        sparsity = qc["sparsity_config"]
        if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
            raise refuse(f"sparsity_config {sparsity!r} is not supported (sparse compressed-tensors formats)")
    if qc.get("transform_config"):
        raise refuse("transform_config is not supported (rotations and other transforms)")
    try:
        config = QuantizationConfig.model_validate({k: v for k, v in qc.items()
                                                   if k in QuantizationConfig.model_fields})
    except Exception as e:  # noqa: BLE001 - pydantic's validation error: its first complaint, on one line
        first = e.errors()[0] if hasattr(e, "errors") and e.errors() else None
        where = ".".join(str(p) for p in first["loc"] if "[" not in str(p)) if first else ""
        why = f"{where}: {first['msg']}" if first else str(e).splitlines()[0]
        raise refuse(f"compressed-tensors cannot read it ({why})") from None
    if config.kv_cache_scheme is not None:
        raise refuse("kv_cache_scheme is not supported (a quantized KV cache)")
    status = str(getattr(config.quantization_status, "value", config.quantization_status))
    if status != "compressed":
        raise refuse(f"quantization_status {status!r} is not supported (supported: compressed)")
    plan = QuantizationPlan("compressed-tensors", ignore=list(config.ignore or []))
    for group_name, scheme in (config.config_groups or {}).items():
        kind = str(getattr(scheme.format, "value", scheme.format) or getattr(config.format, "value", config.format))
        where = f"config_groups.{group_name}"
        if kind not in COMPRESSED_FORMATS:
            raise refuse(f"{where}: format {kind!r} is not supported (supported: {', '.join(COMPRESSED_FORMATS)})")
        _check_scheme(scheme, kind, where, refuse)
        plan.formats.append((list(scheme.targets), LinearFormat(kind, scheme=scheme)))
    if not plan.formats:
        raise refuse("compressed-tensors config_groups is empty")
    return plan


def enum_value(x) -> str | None:
    """A compressed-tensors option as its text (its enums' ``value``, or the string given), or None."""
    return str(getattr(x, "value", x)) if x is not None else None


def _check_scheme(scheme, kind: str, where: str, refuse) -> None:
    w, a = scheme.weights, scheme.input_activations
    value = enum_value

    if w is None:
        raise refuse(f"{where}: activation-only quantization is not supported")
    if scheme.output_activations is not None:
        raise refuse(f"{where}: output_activations quantization is not supported")
    if value(w.actorder) not in (None, "static", "weight"):  # (those reorder only while quantizing: no g_idx stored)
        raise refuse(f"{where}: weights.actorder {value(w.actorder)!r} is not supported (activation ordering, g_idx)")
    if w.dynamic:
        raise refuse(f"{where}: dynamic weight quantization is not supported")
    strategies = {"pack-quantized": ("channel", "group"), "int-quantized": ("channel", "tensor"),
                  "float-quantized": ("channel", "tensor")}[kind]
    if value(w.strategy) not in strategies:
        raise refuse(f"{where}: {kind} weights.strategy {value(w.strategy)!r} is not supported (supported: "
                     f"{', '.join(strategies)})")
    wtype = "float" if kind == "float-quantized" else "int"
    bits = (4, 8) if kind == "pack-quantized" else (8,)
    if value(w.type) != wtype or w.num_bits not in bits:
        raise refuse(f"{where}: {kind} weights {value(w.type)}{w.num_bits} are not supported (supported: "
                     f"{', '.join(f'{wtype}{b}' for b in bits)})")
    if kind == "float-quantized" and not w.symmetric:
        raise refuse(f"{where}: asymmetric float weights are not supported")
    if a is not None:
        if kind == "pack-quantized":
            raise refuse(f"{where}: pack-quantized with input_activations is not supported (weight-only)")
        if not a.dynamic or value(a.strategy) != "token":
            raise refuse(f"{where}: input_activations {value(a.strategy)} "
                         f"{'dynamic' if a.dynamic else 'static'} are not supported (supported: dynamic per token)")
        if value(a.type) != wtype or a.num_bits != 8:
            raise refuse(f"{where}: input_activations {value(a.type)}{a.num_bits} are not supported with {kind}")


def fp8_scale_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """The shape of an fp8 weight's ``weight_scale_inv``: one scale per block, edge blocks partial."""
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         parts: int = 1) -> torch.Tensor:
    """An fp8 weight [..., rows, cols] times its block scales [..., ceil(rows/b0), ceil(cols/b1)],
    in float32, as transformers' FineGrainedFP8 dequantizes on load: each block's e4m3 values
    widened to float32 and multiplied by that block's scale. ``parts``: the rows are that many
    tensors concatenated (fused experts' gate and up), each with its own scale rows, so that a
    part whose rows are not a multiple of ``b0`` keeps its partial edge block."""
    if parts > 1:
        return torch.cat([dequantize_fp8_block(w, s, block) for w, s in
                          zip(weight.chunk(parts, dim=-2), scale_inv.chunk(parts, dim=-2))], dim=-2)
    rows, cols = weight.shape[-2:]
    if rows % block[0] == 0 and cols % block[1] == 0:  # whole blocks: each scale broadcast over its block
        lead = weight.shape[:-2]
        blocks = weight.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1]).to(torch.float32)
        return blocks.mul_(scale_inv.to(torch.float32)[..., :, None, :, None]).reshape(*lead, rows, cols)
    scales = scale_inv.to(torch.float32).repeat_interleave(block[0], -2)[..., :rows, :]
    scales = scales.repeat_interleave(block[1], -1)[..., :cols]
    return weight.to(torch.float32) * scales
