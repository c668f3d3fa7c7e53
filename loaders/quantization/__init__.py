"""Quantized checkpoints: FP8 (linears and experts), compressed-tensors INT4/INT8/FP8, GPTQ, AWQ, MXFP4 experts;
sharded, gathered quantized.

Contract. :func:`quantization_plan` reads a config's ``quantization_config`` before any weight is
read and returns a :class:`QuantizationPlan`, or None for a plain checkpoint, or raises
:class:`loaders.errors.UnsupportedQuantizationError` naming the method or option it cannot serve
(one line, nothing read). :func:`quantize_skeleton` then swaps each ``nn.Linear`` of the meta
skeleton that the checkpoint stores quantized (the checkpoint's own tensor names decide: a module
the config leaves out, ``lm_head`` say, stays in the model's dtype) for a
:class:`QuantizedLinear` whose parameters are the checkpoint's tensors as stored: the packed
weight, its scales, zero points. Those are ordinary parameters of their unit, so FSDP2 shards them
by rows like any other (``shard_engine.units.find_ignored_param_names`` leaves them sharded,
whatever their dtype), every rank reads only its rows, the all-gather moves the quantized bytes
(FSDP2 gathers a unit of mixed dtypes as bytes), and the shared resident copy on one host is the
quantized one. A unit's forward dequantizes each weight as transformers' own load does (the same
functions: compressed-tensors' compressors, or FP8's block scales in the same order; GPTQ and AWQ
as their specifications say), so greedy output equals transformers' in float32. MoE experts
are not linears: :mod:`loaders.quantization.experts` swaps the fused experts parameters for
gpt-oss's MXFP4 blocks and scales, or for the stacked e4m3 weights and block scales of FP8
checkpoints that store each expert's projections (DeepSeek-V3, Qwen3-MoE-FP8).

Row shards and blocks: FSDP2 chunks each tensor by rows on its own, so where a format's scales
cover blocks of rows (FP8's 128-row blocks) a shard boundary need not fall on a block edge, and
then a rank holds scales of rows it does not hold. Nothing computes on a shard: a unit's forward
runs on the gathered, whole tensors, which are exact whatever the boundaries (tested with blocks
that straddle them).
"""

from loaders.quantization.formats import QuantizationPlan, quantization_plan
from loaders.quantization.linear import QuantizedLinear, quantize_skeleton, quantized_bytes

__all__ = ["QuantizationPlan", "QuantizedLinear", "quantization_plan", "quantize_skeleton", "quantized_bytes"]
