"""MXFP4 fused experts (gpt-oss): the checkpoint's blocks and scales as parameters, dequantized where a forward runs.

gpt-oss ships its experts' ``gate_up_proj`` and ``down_proj`` (stacked [experts, in, out] in the
model) as OCP MXFP4: ``<proj>_blocks`` uint8 [experts, out, in/32, 16] (two e2m1 codes a byte, the
low nibble first) and ``<proj>_scales`` uint8 [experts, out, in/32] (one power of two, biased by 127,
for each 32 values). :func:`quantize_fused_experts` swaps those two tensors in for each fused
parameter of the meta skeleton's experts modules: they are ordinary parameters of the unit, sharded
by their first dimension (the experts: each rank reads and holds its experts' blocks, 4.25 bits a
weight) and gathered as stored. The module's class becomes a subclass whose ``gate_up_proj`` /
``down_proj`` are properties: the whole stacked weight dequantized, in the model's dtype, each time
the forward reads it. transformers' experts forwards (``grouped_mm``, ``batched_mm``: the default
on every device) read each once a forward; its per-expert ``eager`` loop would dequantize once per
expert it visits. The dequantization is transformers' own (``convert_moe_packed_tensors``: the code
looked up in the e2m1 table in the model's dtype, ``ldexp`` by the scale), so greedy output equals
its load of the checkpoint (which dequantizes on CPU) bit for bit in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.errors import CheckpointError

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


def _dequantized(proj: str):
    def weight(self) -> torch.Tensor:
        return dequantize_mxfp4(getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"),
                                self.mxfp4_dtype)

    return property(weight, doc=f"``{proj}`` dequantized from its MXFP4 blocks and scales, for this forward")


_SUBCLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _mxfp4_class(cls: type, projections: tuple[str, ...]) -> type:
    """``cls`` with ``projections`` read through :func:`dequantize_mxfp4` (one subclass per class and set)."""
    key = (cls, projections)
    if key not in _SUBCLASSES:
        name = f"MXFP4{cls.__name__}" + ("" if projections == FUSED_PROJECTIONS else "_" + "_".join(projections))
        subclass = type(name, (cls,), {**{p: _dequantized(p) for p in projections}, "__module__": __name__})
        # importable by name, as pickle finds classes (compiled graphs saved to disk name their modules' classes)
        globals()[name] = subclass
        _SUBCLASSES[key] = subclass
    return _SUBCLASSES[key]


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
        module.mxfp4_dtype = dtypes.pop()
        module.row_sharded = tuple(f"{p}_{part}" for p in projections for part in ("blocks", "scales"))
        module.quantized_tensor_names = module.row_sharded
        module.__class__ = _mxfp4_class(type(module), tuple(projections))
        changed += 1
    return changed
