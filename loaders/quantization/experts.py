"""Quantized fused experts: the checkpoint's tensors as parameters, dequantized where a forward runs.

transformers keeps a MoE layer's experts as fused parameters of one module (``gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I] for most families; [E, in, out] for gpt-oss). Checkpoints
store them quantized as:

* **MXFP4** (gpt-oss): ``<proj>_blocks`` uint8 [experts, out, in/32, 16] (two e2m1 codes a byte,
  the low nibble first) and ``<proj>_scales`` uint8 [experts, out, in/32] (one power of two,
  biased by 127, for each 32 values), stored fused. :func:`quantize_fused_experts` swaps those two
  tensors in for each fused parameter. The dequantization is transformers' own
  (``convert_moe_packed_tensors``: the code looked up in the e2m1 table in the model's dtype,
  ``ldexp`` by the scale).
* **FP8 blocks** (DeepSeek-V3/R1, Kimi K2, Qwen3-MoE-FP8: ``quant_method: fp8``): one
  float8_e4m3fn ``weight`` and float32 ``weight_scale_inv`` per expert and projection
  (``experts.{e}.gate_proj.weight``...), which transformers' conversion mapping stacks into the
  fused parameter. :func:`quantize_fp8_experts` swaps in ``<proj>_fp8`` (the stacked e4m3 weight,
  as stored) and ``<proj>_scale_inv`` (the stacked block scales) for each fused parameter whose
  sources the checkpoint stores so; :func:`loaders.conversion.plan_conversions` then stacks the
  experts' weights and their scales with the same chain as the dense weights (row-local: each
  rank reads its own experts'). The dequantization is transformers' (``Fp8Dequantize``: e4m3
  widened to float32 times the block's scale, then the model's dtype).
* **Linears of each expert** in any format served for linears but fp8 blocks: compressed-tensors'
  ``pack-quantized``, ``int-quantized`` and ``float-quantized``, GPTQ and AWQ
  (:func:`quantize_linear_experts`, :data:`EXPERT_STORAGE`), stacked by experts as stored and
  dequantized by the format's own code (compressed-tensors' compressors; ours for GPTQ and AWQ).
  Activations an int8 or fp8 scheme quantizes stay unquantized in the experts.

Either way the new parameters are ordinary parameters of the unit, sharded by their first
dimension (the experts: each rank reads and holds its experts' quantized tensors, scales whole
with their experts) and gathered as stored. The module's class becomes a subclass whose fused
names are properties: the stacked weight of the experts this forward routes to, dequantized in
the model's dtype, each time the forward reads it (``_routed_forward`` renumbers the routed experts
for the call, so a decode step dequantizes its tokens' top-k experts, not all of the layer's: with
DeepSeek-V3's 256 experts a layer's whole would be 22 GB in bf16). transformers' experts forwards
(``grouped_mm``, ``batched_mm``: the default on every device) read each once a forward; its
per-expert ``eager`` loop would dequantize once per expert it visits. Greedy output equals
transformers' load of the checkpoint (which dequantizes on CPU) bit for bit in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.errors import CheckpointError
from loaders.quantization.formats import FP8, dequantize_fp8_block, fp8_scale_shape

FUSED_PROJECTIONS = ("gate_up_proj", "down_proj")
"""The fused experts parameters MXFP4 checkpoints store as blocks and scales (gpt-oss's names)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an e2m1 (FP4) code, as transformers' ``FP4_VALUES``."""
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` [E, out, in/32, 16] and ``scales`` [E, out, in/32] -> the weight [E, in, out] in
    ``dtype``: each code's e2m1 value times 2**(scale - 127), as transformers'
    ``convert_moe_packed_tensors`` computes it."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int32)  # low nibble first
    values = table[codes].reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1)).to(dtype)
    return values.reshape(*blocks.shape[:-2], -1).transpose(1, 2).contiguous()


def _routed(module: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s rows of the experts this forward routes to (all outside one: ``_routed_forward``)."""
    routed = module.__dict__.get("_routed_experts")
    return tensor if routed is None else tensor.index_select(0, routed)


def _dequantized_mxfp4(proj: str):
    def weight(self) -> torch.Tensor:
        return dequantize_mxfp4(_routed(self, getattr(self, f"{proj}_blocks")),
                                _routed(self, getattr(self, f"{proj}_scales")), self.experts_dtype)

    return property(weight, doc=f"``{proj}`` of the routed experts, dequantized from MXFP4 blocks and scales")


def _dequantized_fp8(proj: str):
    def weight(self) -> torch.Tensor:
        return dequantize_fp8_block(_routed(self, getattr(self, f"{proj}_fp8")),
                                    _routed(self, getattr(self, f"{proj}_scale_inv")),
                                    self.fp8_block, parts=self.fp8_parts[proj]).to(self.experts_dtype)

    return property(weight, doc=f"``{proj}`` of the routed experts, dequantized from e4m3 and block scales")


def _dequantized_packed(proj: str):
    def weight(self) -> torch.Tensor:
        packed = _routed(self, getattr(self, f"{proj}_packed"))
        scales = _routed(self, getattr(self, f"{proj}_packed_scale"))
        columns = self.linear_columns[proj]
        if not self.__dict__.get("_shapes_checked"):
            _check_packed_shapes(self)
        experts, rows = packed.shape[:2]
        # compressed-tensors' own decompression, in one call: by groups or channels every row stands alone, so
        # the experts' linears (and gate's and up's parts) decompress as the rows of one linear, bit for bit;
        # asymmetric zero points are packed along the rows, so they stack as the rows do (each linear's rows
        # fill whole words: quantize_linear_experts checks)
        tensors = {"weight_packed": packed.reshape(experts * rows, -1),
                   "weight_scale": scales.reshape(experts * rows, -1),
                   "weight_shape": torch.Size((experts * rows, columns))}
        zero_points = getattr(self, f"{proj}_packed_zero_point", None)
        if zero_points is not None:
            zero_points = _routed(self, zero_points)
            tensors["weight_zero_point"] = zero_points.reshape(-1, zero_points.shape[-1])
        weight = self.linear_compressor.decompress(tensors, self.linear_format.scheme)["weight"]
        return weight.reshape(experts, rows, columns).to(self.experts_dtype)

    return property(weight, doc=f"``{proj}`` of the routed experts, decompressed from their packed codes and scales")


def _dequantized_scaled(proj: str):
    def weight(self) -> torch.Tensor:
        fmt, names = self.linear_format, EXPERT_STORAGE[self.linear_format.kind]
        quantized = _routed(self, getattr(self, proj + names["weight"]))
        experts, rows, columns = quantized.shape
        # compressed-tensors' own decompression, in one call, as for packed experts: a scale (and zero point)
        # per row, each part's own (gate's, up's) on its rows where the scheme keeps one per linear
        tensors = {"weight": quantized.reshape(experts * rows, columns)}
        for stored in ("weight_scale", "weight_zero_point"):
            held = getattr(self, proj + names[stored], None) if stored in names else None  # zero points: int8 asymmetric
            if held is None:
                continue
            values = _routed(self, held).reshape(experts, -1)
            if values.shape[1] != rows:  # tensor strategy: one a linear, [experts, parts]
                values = values.repeat_interleave(rows // values.shape[1], dim=1)
            tensors[stored] = values.reshape(experts * rows, 1)
        # transformers holds the scales in the model's dtype and dequantizes in it (as QuantizedLinear does)
        tensors["weight_scale"] = tensors["weight_scale"].to(self.experts_dtype)
        weight = self.linear_compressor.decompress(tensors, fmt.scheme)["weight"]
        return weight.reshape(experts, rows, columns).to(self.experts_dtype)

    return property(weight, doc=f"``{proj}`` of the routed experts, dequantized from int8 or fp8 weights and scales "
                                "(weight-only: their inputs stay in the model's dtype)")


def _dequantized_linears(proj: str):
    def weight(self) -> torch.Tensor:
        from loaders.quantization.storage import dequantize_stored

        fmt, parts, columns, rows = (self.linear_format, self.linear_parts[proj], self.linear_columns[proj],
                                     self.linear_rows[proj])
        tensors = {n: _routed(self, getattr(self, proj + suffix)) for n, suffix in EXPERT_STORAGE[fmt.kind].items()}
        experts = next(iter(tensors.values())).shape[0]
        out = torch.empty((experts, rows, columns), dtype=self.experts_dtype, device=tensors["qweight"].device)
        for e in range(experts):  # each expert's linear, each part (gate, up) its own, as stored
            pieces = {n: t[e].chunk(parts, dim=0) for n, t in tensors.items()}
            for part in range(parts):
                out[e, part * rows // parts:(part + 1) * rows // parts] = dequantize_stored(
                    fmt, {n: chunks[part] for n, chunks in pieces.items()}, rows // parts, columns)
        return out

    return property(weight, doc=f"``{proj}`` of the routed experts, dequantized from their GPTQ or AWQ tensors")


def _check_packed_shapes(module: nn.Module) -> None:
    """Each expert's stored ``weight_shape`` against the layer's (once, at the first forward)."""
    for proj, parts in module.linear_parts.items():
        shapes = getattr(module, f"{proj}_packed_shape")
        if shapes.device.type == "meta":
            return
        want = [module.linear_rows[proj] // parts, module.linear_columns[proj]] * parts
        for row in shapes.tolist():
            if row != want:
                raise CheckpointError(f"an expert's weight_shape {row} != the layer's {want} ({proj})")
    module.__dict__["_shapes_checked"] = True


def _routed_bias(name: str):
    def bias(self) -> torch.Tensor:
        return _routed(self, nn.Module.__getattr__(self, name))  # the parameter itself, under this property

    return property(bias, doc=f"``{name}`` of the routed experts")


def _routed_forward(forward):
    """``forward`` (transformers' experts forward: hidden states, each token's experts, their
    weights) over the experts the tokens route to only: their ids renumbered 0..U-1 in order, and
    ``num_experts`` U for the call, so that every implementation (``grouped_mm``, ``batched_mm``,
    ``eager``) reads U dequantized experts where it read them all. Dequantizing is elementwise, and
    each expert's products are the same whichever the others, so the output is the same bit for bit;
    a decode step dequantizes top-k experts a token, not every expert of the layer. Inside a
    compiled graph (whose shapes cannot follow the routing) every expert is dequantized, as before."""
    def routed_forward(self, hidden_states, top_k_index, *args, **kwargs):
        if (torch.compiler.is_compiling() or getattr(self, "_is_expert_parallel", False)
                or not isinstance(getattr(self, "num_experts", None), int)):
            # (expert-parallel sentinels and experts without a count of their own: every expert, as before)
            return forward(self, hidden_states, top_k_index, *args, **kwargs)
        routed, renumbered = torch.unique(top_k_index, return_inverse=True)
        experts = self.num_experts
        self.__dict__["_routed_experts"], self.num_experts = routed, routed.numel()
        try:
            return forward(self, hidden_states, renumbered.reshape(top_k_index.shape), *args, **kwargs)
        finally:
            self.__dict__["_routed_experts"], self.num_experts = None, experts

    return routed_forward


_SUBCLASSES: dict[tuple[type, str, tuple[str, ...]], type] = {}


def _quantized_class(cls: type, kind: str, projections: tuple[str, ...], biases: tuple[str, ...] = ()) -> type:
    """``cls`` with ``projections`` read through the ``kind`` (``MXFP4``, ``FP8``, ``Packed``, ``GPTQ``,
    ``AWQ``) dequantization,
    of the routed experts only (``biases``: its per-expert bias parameters, read likewise) (one
    subclass per class, kind and set)."""
    key = (cls, kind, projections, biases)
    if key not in _SUBCLASSES:
        name = f"{kind}{cls.__name__}" + ("" if projections == FUSED_PROJECTIONS else "_" + "_".join(projections))
        getter = {"MXFP4": _dequantized_mxfp4, "FP8": _dequantized_fp8, "Packed": _dequantized_packed,
                  "Scaled": _dequantized_scaled, "GPTQ": _dequantized_linears, "AWQ": _dequantized_linears}[kind]
        subclass = type(name, (cls,), {**{p: getter(p) for p in projections}, **{b: _routed_bias(b) for b in biases},
                                       "forward": _routed_forward(cls.forward), "__module__": __name__})
        # importable by name, as pickle finds classes (compiled graphs saved to disk name their modules' classes)
        globals()[name] = subclass
        _SUBCLASSES[key] = subclass
    return _SUBCLASSES[key]


def _expert_biases(module: nn.Module) -> tuple[str, ...]:
    """The module's per-expert bias parameters (gpt-oss's ``gate_up_proj_bias``, ``down_proj_bias``)."""
    own = dict(module.named_parameters(recurse=False))
    return tuple(f"{p}_bias" for p in FUSED_PROJECTIONS if f"{p}_bias" in own)


def quantize_fused_experts(model: nn.Module, stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
                           path: str | None = None) -> int:
    """Swap, in the meta skeleton ``model``, each fused experts parameter that the checkpoint stores
    as MXFP4 (``stored``: model-named tensors -> (shape, dtype)) for its blocks and scales; returns the
    modules changed. A shape that does not match the parameter's is an error naming the tensor."""
    changed = 0
    for name, module in list(model.named_modules()):
        own = dict(module.named_parameters(recurse=False))
        projections = [p for p in FUSED_PROJECTIONS if p in own and f"{name}.{p}_blocks" in stored]
        if not projections:
            continue
        dtypes = set()
        for proj in projections:
            dense = own[proj]
            if dense.dim() != 3 or dense.shape[1] % MXFP4_BLOCK:
                raise CheckpointError(f"{name}.{proj} {tuple(dense.shape)} cannot hold MXFP4 blocks (3 dimensions, "
                                      f"the second a multiple of {MXFP4_BLOCK})", path=path, tensor=f"{name}.{proj}_blocks")
            experts, inputs, outputs = dense.shape
            expected = {"blocks": (experts, outputs, inputs // MXFP4_BLOCK, MXFP4_BLOCK // 2),
                        "scales": (experts, outputs, inputs // MXFP4_BLOCK)}
            for part, shape in expected.items():
                key = f"{name}.{proj}_{part}"
                got = stored.get(key)
                if got is None or tuple(got[0]) != shape or got[1] != torch.uint8:
                    raise CheckpointError(f"{key} is {got and (tuple(got[0]), got[1])}, expected uint8 {shape} for "
                                          f"{name}.{proj} {tuple(dense.shape)}", path=path, tensor=key)
            dtypes.add(dense.dtype)
            delattr(module, proj)  # the parameter goes (nn.Module's own deletion)
            for part, shape in expected.items():
                module.register_parameter(f"{proj}_{part}", nn.Parameter(
                    torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False))
        module.experts_dtype = dtypes.pop()
        module.row_sharded = tuple(f"{p}_{part}" for p in projections for part in ("blocks", "scales"))
        module.quantized_tensor_names = module.row_sharded
        module.__class__ = _quantized_class(type(module), "MXFP4", tuple(projections), _expert_biases(module))
        changed += 1
    return changed


def _fused_shape(name: str, dense: nn.Parameter, keys: list[str], parts: int, path: str | None):
    """(experts, rows, columns) of the fused parameter ``name``, whose rows its ``parts`` sources share."""
    experts, rows, columns = dense.shape
    if rows % parts:
        raise CheckpointError(f"{name} {tuple(dense.shape)}: {rows} rows do not split into {parts}", path=path,
                              tensor=keys[0])
    return experts, rows, columns


def quantize_fp8_experts(model: nn.Module, fused: dict[str, tuple[list[str], int]],
                         stored: dict[str, tuple[tuple[int, ...], torch.dtype]], block: tuple[int, int],
                         path: str | None = None) -> tuple[int, set[str]]:
    """Swap, in the meta skeleton ``model``, each fused experts parameter whose checkpoint sources
    are e4m3 weights with block scales for ``<proj>_fp8`` and ``<proj>_scale_inv``.

    ``fused``: model name of a fused parameter -> (its sources' checkpoint keys under the model's
    prefix, in the conversion's order: expert 0's gate, ..., then the ups; the number of tensors
    concatenated along its rows, 2 for ``gate_up_proj``); ``stored``: those keys -> (shape, dtype).
    Returns (modules changed, the checkpoint keys they take). Mixed storage (some sources e4m3,
    some not), a missing scale or a shape that does not stack to the parameter's is an error
    naming the tensor."""
    changed, taken = 0, set()
    for name, module in list(model.named_modules()):
        own = dict(module.named_parameters(recurse=False))
        projections = [p for p in own if f"{name}.{p}" in fused and own[p].dim() == 3
                       and any(stored[k][1] == FP8 for k in fused[f"{name}.{p}"][0] if k in stored)]
        if not projections:
            continue
        dtypes, parts_of = set(), {}
        for proj in projections:
            dense, (keys, parts) = own[proj], fused[f"{name}.{proj}"]
            experts, rows, cols = _fused_shape(f"{name}.{proj}", dense, keys, parts, path)
            want = (rows // parts, cols)
            scale_rows, scale_cols = fp8_scale_shape(*want, block)
            scale_dtypes = set()
            for key in keys:
                got, scale = stored.get(key), stored.get(key + "_scale_inv")
                if got is None or got[1] != FP8 or tuple(got[0]) != want:
                    raise CheckpointError(f"{key} is {got and (tuple(got[0]), got[1])}, expected {FP8} {want} (the "
                                          f"experts of {name}.{proj} are stored in fp8)", path=path, tensor=key)
                if scale is None or tuple(scale[0]) != (scale_rows, scale_cols):
                    raise CheckpointError(f"{key}_scale_inv is {scale and tuple(scale[0])}, expected "
                                          f"{(scale_rows, scale_cols)} for {block[0]}x{block[1]} blocks", path=path,
                                          tensor=key + "_scale_inv")
                scale_dtypes.add(scale[1])
                taken.update((key, key + "_scale_inv"))
            if len(scale_dtypes) != 1:
                raise CheckpointError(f"the experts' scales of {name}.{proj} mix dtypes {sorted(map(str, scale_dtypes))}",
                                      path=path, tensor=keys[0] + "_scale_inv")
            dtypes.add(dense.dtype)
            delattr(module, proj)
            module.register_parameter(f"{proj}_fp8", nn.Parameter(
                torch.empty(dense.shape, dtype=FP8, device="meta"), requires_grad=False))
            module.register_parameter(f"{proj}_scale_inv", nn.Parameter(
                torch.empty((experts, parts * scale_rows, scale_cols), dtype=scale_dtypes.pop(), device="meta"),
                requires_grad=False))
            parts_of[proj] = parts
        module.experts_dtype = dtypes.pop()
        module.fp8_block, module.fp8_parts = tuple(block), parts_of
        module.row_sharded = tuple(f"{p}{suffix}" for p in projections for suffix in ("_fp8", "_scale_inv"))
        module.quantized_tensor_names = module.row_sharded
        module.__class__ = _quantized_class(type(module), "FP8", tuple(projections), _expert_biases(module))
        changed += 1
    return changed, taken


EXPERT_STORAGE = {
    "int-quantized": {"weight": "_quantized", "weight_scale": "_quantized_scale",
                      "weight_zero_point": "_quantized_zero_point"},
    "float-quantized": {"weight": "_quantized", "weight_scale": "_quantized_scale"},
    "pack-quantized": {"weight_packed": "_packed", "weight_scale": "_packed_scale", "weight_shape": "_packed_shape",
                       "weight_zero_point": "_packed_zero_point"},
    "gptq": {"qweight": "_qweight", "qzeros": "_qzeros", "scales": "_scales", "g_idx": "_g_idx"},
    "awq": {"qweight": "_qweight", "qzeros": "_qzeros", "scales": "_scales"},
}
"""For each linear format served for experts: each stored tensor's suffix on the fused parameter's
name in the model (``loaders.conversion.QUANTIZED_COMPANIONS`` stacks them under those names);
a scheme stores some of them only (zero points: asymmetric weights)."""


def _storage(fmt, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, str]]:
    """(stored name, suffix) of each tensor ``fmt``'s scheme stores (``shapes``: its stored shapes)."""
    return [(name, suffix) for name, suffix in EXPERT_STORAGE[fmt.kind].items() if name in shapes]


def quantize_linear_experts(model: nn.Module, plan, fused: dict[str, tuple[list[str], int]],
                            stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
                            path: str | None = None) -> tuple[dict[str, int], set[str]]:
    """Swap, in the meta skeleton ``model``, each fused experts parameter whose checkpoint sources
    are quantized linears, each expert's under its own name, for their stored tensors stacked by
    experts (:data:`EXPERT_STORAGE`): compressed-tensors ``pack-quantized`` (llm-compressor's
    W4A16 / W8A16 of Qwen3-MoE, DeepSeek, ...: ``<proj>_packed`` int32 codes, ``_packed_scale``,
    ``_packed_shape``), ``int-quantized`` and ``float-quantized`` (W8A8 INT8, FP8_DYNAMIC, FP8
    weight-only: ``<proj>_quantized`` int8 or e4m3, ``_quantized_scale`` by channel or tensor,
    INT8's zero points where asymmetric; computed weight-only, their inputs unquantized, as vLLM's
    Marlin kernels run FP8 checkpoints on GPUs without FP8), GPTQ and AWQ (GPTQModel's and AutoAWQ's MoE checkpoints: ``<proj>_qweight``,
    ``_qzeros``, ``_scales``, GPTQ's ``_g_idx``). Gate's and up's tensors are concatenated along each
    expert's first dimension, whatever it means for the format (rows for pack-quantized, packed
    inputs or groups for GPTQ and AWQ): a forward splits them back into parts.

    ``plan``: the checkpoint's QuantizationPlan, whose format for each expert's linear says how it
    is stored; ``fused``: model name of a fused parameter -> (its sources' ``.weight`` names, as a
    dense checkpoint would store them; the parts concatenated along its rows). Returns ({format:
    modules changed}, the checkpoint keys they take). A missing tensor, a shape that does not stack or
    zero points that do not fill whole packed words is an error naming the tensor (the plan has
    already refused pack-quantized activations and strategies other than groups and channels)."""
    from loaders.quantization.storage import stored_shapes

    counts: dict[str, int] = {}
    taken: set[str] = set()

    def format_of(key: str, rows: int, columns: int):
        linear = key.removesuffix(".weight")
        fmt = plan.format_for(linear, nn.Linear(columns, rows, bias=False, device="meta"))
        if fmt is None or fmt.kind not in EXPERT_STORAGE or f"{linear}.{fmt.stored_names[0]}" not in stored:
            return None
        return fmt

    for name, module in list(model.named_modules()):
        own = dict(module.named_parameters(recurse=False))
        projections = [p for p in own if f"{name}.{p}" in fused and own[p].dim() == 3 and any(
            format_of(k, own[p].shape[1] // fused[f"{name}.{p}"][1], own[p].shape[2])
            for k in fused[f"{name}.{p}"][0])]
        if not projections:
            continue
        first = fused[f"{name}.{projections[0]}"][0][0].removesuffix(".weight")
        if getattr(module, "is_transposed", False):
            raise CheckpointError(f"{name}: quantized experts of a transposed layout are not supported", path=path,
                                  tensor=first)
        dtypes, parts_of, columns_of, rows_of, fmt = set(), {}, {}, {}, None
        for proj in projections:
            dense, (keys, parts) = own[proj], fused[f"{name}.{proj}"]
            experts, rows, columns = _fused_shape(f"{name}.{proj}", dense, keys, parts, path)
            for key in keys:
                linear = key.removesuffix(".weight")
                got = format_of(key, rows // parts, columns)
                if got is None:
                    raise CheckpointError(f"{linear} is not stored quantized as its experts' others are", path=path,
                                          tensor=key)
                if fmt is not None and got != fmt:
                    raise CheckpointError(f"the experts of {name} mix formats ({fmt.describe()}, {got.describe()})",
                                          path=path, tensor=f"{linear}.{got.stored_names[0]}")
                fmt = got
                shapes = stored_shapes(fmt, rows // parts, columns)
                if "weight_zero_point" in shapes and rows // parts * fmt.scheme.weights.num_bits % 32:
                    raise CheckpointError(f"{linear}.weight_zero_point: the zero points of {rows // parts} rows, packed "
                                          f"{32 // fmt.scheme.weights.num_bits} a word, do not fill whole words, so "
                                          "the experts' do not stack", path=path, tensor=f"{linear}.weight_zero_point")
                for stored_name, shape in shapes.items():
                    entry = stored.get(f"{linear}.{stored_name}")
                    if entry is None or tuple(entry[0]) != tuple(shape):
                        raise CheckpointError(f"{linear}.{stored_name} is {entry and tuple(entry[0])}, expected "
                                              f"{tuple(shape)} for {name}.{proj} {tuple(dense.shape)}", path=path,
                                              tensor=f"{linear}.{stored_name}")
                    taken.add(f"{linear}.{stored_name}")
            dtypes.add(dense.dtype)
            delattr(module, proj)
            for stored_name, suffix in _storage(fmt, shapes):
                shape, dtype = shapes[stored_name], stored[f"{keys[0].removesuffix('.weight')}.{stored_name}"][1]
                module.register_parameter(proj + suffix, nn.Parameter(torch.empty(
                    (experts, parts * shape[0], *shape[1:]), dtype=dtype, device="meta"), requires_grad=False))
            parts_of[proj], columns_of[proj], rows_of[proj] = parts, columns, rows
        module.experts_dtype = dtypes.pop()
        module.row_sharded = tuple(proj + suffix for proj in projections for _, suffix in _storage(fmt, shapes))
        module.quantized_tensor_names = module.row_sharded
        # each projection's parts (gate, up), columns and rows, as one expert's linears store them in ``fmt``
        module.linear_format, module.linear_parts, module.linear_columns, module.linear_rows = \
            fmt, parts_of, columns_of, rows_of
        kind = fmt.kind.upper()
        what = f"{fmt.describe()} experts"
        if fmt.kind in ("pack-quantized", "int-quantized", "float-quantized"):
            from compressed_tensors.compressors import BaseCompressor

            module.linear_compressor = BaseCompressor.get_value_from_registry(fmt.kind)  # resolved once
            kind = "Packed" if fmt.kind == "pack-quantized" else "Scaled"
            if fmt.scheme.input_activations is not None:  # no experts forward takes quantized inputs
                what = f"{fmt.describe()} experts, their activations unquantized"
        module.__class__ = _quantized_class(type(module), kind, tuple(projections), _expert_biases(module))
        counts[what] = counts.get(what, 0) + 1
    return counts, taken
