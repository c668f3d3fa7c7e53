"""Small pre-quantized checkpoints in the formats real hubs ship, plus exact dequantization references.

Contract
--------
Every ``write_*`` function quantizes a tiny float32 Llama (``tests.checkpoints.write_checkpoint(...,
"llama")``: hidden 64, intermediate 176, 3 layers, 4 heads / 2 kv heads, untied ``lm_head``; or the
float32 checkpoint directory given as ``base``) and writes a complete checkpoint directory at
``path``, returning ``path`` as ``str``:

* safetensors shards ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, split
  at ``max_shard_size`` (default ``"20KB"``) in module order, so layers -- and sometimes a weight and
  its own scale -- straddle files;
* ``config.json`` = the base config plus the format's ``quantization_config``;
* every other base file copied unchanged (tokenizer files, ``generation_config.json``).

Only the nn.Linear projections inside ``model.layers`` (q/k/v/o, gate/up/down) are quantized;
``embed_tokens``, the norms and ``lm_head`` stay float32 under their usual names.

Formats (tensor names are per quantized linear ``<m>``, e.g. ``model.layers.0.mlp.up_proj``):

``write_fp8_block`` -- transformers ``quant_method: "fp8"`` (FineGrainedFP8; DeepSeek-V3, Qwen3-FP8):
    ``<m>.weight`` float8_e4m3fn [out, in]; ``<m>.weight_scale_inv`` float32
    [ceil(out/b0), ceil(in/b1)]; per block ``scale_inv = amax|w_block| / 448`` (1.0 for an all-zero
    block) and ``weight = (w / scale_inv).clamp(-448, 448).to(float8_e4m3fn)`` (round to nearest
    even). Edge blocks may be partial. Dequantize: ``weight.float() * scale_inv[i // b0, j // b1]``.
    NB: transformers' CPU loader (``Fp8Dequantize``) rejects partial blocks; ``block=(16, 16)``
    divides every shape of the tiny Llama.

``write_compressed_w4a16`` -- compressed-tensors ``pack-quantized`` INT4 weight-only, group strategy,
    made with compressed-tensors itself: ``<m>.weight_packed`` int32 [out, in/8], ``<m>.weight_scale``
    float32 [out, in/group], ``<m>.weight_shape`` int64 [2], and when asymmetric
    ``<m>.weight_zero_point`` int32 [ceil(out/8), in/group] (packed along dim 0). compressed-tensors
    cannot group-quantize a linear whose in_features is not a multiple of ``group_size``: such
    linears (``down_proj``, in=176, for ``group_size=32``) are left float32 and listed in
    ``ignore``. ``group_size=16`` quantizes all seven.

``write_compressed_w8a8`` -- compressed-tensors ``int-quantized``: ``<m>.weight`` int8 [out, in],
    ``<m>.weight_scale`` float32 [out, 1] (symmetric per output channel); input activations dynamic,
    symmetric, per token, int8 (no tensor stored for them).

``write_compressed_fp8`` -- compressed-tensors ``float-quantized`` (llm-compressor's FP8_DYNAMIC):
    ``<m>.weight`` float8_e4m3fn [out, in], ``<m>.weight_scale`` float32 [out, 1] (``"channel"``) or
    [1] (``"tensor"``); input activations dynamic per-token FP8.

``write_gptq`` -- AutoGPTQ / GPTQModel ``quant_method: "gptq"`` (2, 4 or 8 bits, groups, optional
    activation order through ``g_idx``, ``checkpoint_format`` v1 ``"gptq"`` or ``"gptq_v2"``), and
``write_awq`` -- AutoAWQ's GEMM layout (``quant_method: "awq"``, 4 bits): packed by hand from the
    formats' specifications, since no CPU library loads them (transformers needs GPTQModel, which
    builds kernels); their reference is ``write_dequantized``'s dense copy.

The ``dequantize_*`` / ``fake_quantize_*`` functions re-implement, by hand, the arithmetic transformers
5.24 + compressed-tensors 0.20.1 apply on CPU in float32 (they match it bit for bit); ``read_tensors``
and ``quantization_config`` read a written checkpoint back; ``dequantized_state_dict`` /
``write_dequantized`` give the dense float32 weights transformers ends up holding.

What transformers 5.24 does with these on CPU (``from_pretrained(path, dtype=torch.float32)``):

* fp8: no GPU -> ``dequantize=True`` is forced; the Linears stay ``nn.Linear`` and each weight is
  dequantized at load, ``(weight.to(f32) * scale_inv_per_block).to(param dtype)``; no activation
  quantization at all. It derives the block from the scale grid (``rows // scale_rows``), so partial
  edge blocks raise ``ValueError`` (default ``block=(32, 32)`` here: gate/up/down fail to load), and a
  block that leaves the grid dividing the shape (e.g. (48, 48)) loads *silently wrong*. Use
  ``block=(16, 16)``, or ``write_dequantized`` + ``reference_generate`` as the reference.
* compressed-tensors (default ``dequantize=False``): the packed tensors load as is; a forward pre-hook
  on the model decompresses every module (weight -> ``scale.dtype``) on the first forward, and each
  quantized Linear's patched forward then fake-quantizes its input per token when the scheme has
  ``input_activations`` (W8A8, FP8-dynamic) before ``F.linear`` with the dequantized weight.
  ``CompressedTensorsConfig(dequantize=True)`` instead dequantizes at load into plain ``nn.Linear``s
  and does *not* quantize activations. Asymmetric W4A16 (``weight_zero_point``) fails to load on the
  default path (compressed-tensors' meta-device compress leaves the zero point unpacked, [out, groups]
  vs the checkpoint's packed [out/8, groups]); it loads with ``dequantize=True``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_SHARD = "20KB"

_SKIP_FILES = ("config.json", "model.safetensors.index.json")


# ---------------------------------------------------------------------------------------------
# reading / writing checkpoints
# ---------------------------------------------------------------------------------------------

def _size_to_int(size) -> int:
    if isinstance(size, int):
        return size
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    for unit, mult in units.items():
        if size.upper().endswith(unit):
            return int(size[: -len(unit)]) * mult
    return int(size)


def _natural_key(name: str):
    m = re.match(r"(.*?\.layers\.)(\d+)\.(.*)", name)
    if m:
        return (1, int(m.group(2)), m.group(3))
    return (0 if "embed" in name else 2, 0, name)


def read_tensors(path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (sharded or not), by name."""
    from safetensors.torch import load_file

    path = str(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def quantization_config(path) -> dict | None:
    with open(os.path.join(str(path), "config.json")) as f:
        return json.load(f).get("quantization_config")


def write_shards(path, tensors: dict[str, torch.Tensor], max_shard_size=DEFAULT_SHARD,
                 order=None) -> list[str]:
    """Write ``tensors`` as transformers-style shards + index; returns the shard file names.

    Greedy split in ``order`` (default: embeddings, layers in order, then the rest): a new shard starts
    when the next tensor would overflow ``max_shard_size`` (a tensor bigger than that gets its own).
    """
    from safetensors.torch import save_file

    path = str(path)
    os.makedirs(path, exist_ok=True)
    limit = _size_to_int(max_shard_size)
    names = list(order) if order is not None else sorted(tensors, key=_natural_key)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    total = len(shards)
    files = []
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file({k: tensors[k].detach().contiguous() for k in shard}, os.path.join(path, fname),
                  metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
    if total > 1:
        total_size = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return files


def _copy_side_files(base: str, path: str, quant_config: dict | None, drop_quant: bool = False):
    """Copy tokenizer / generation config files; write config.json with ``quant_config`` (or without
    any quantization_config when ``drop_quant``)."""
    for f in os.listdir(base):
        src = os.path.join(base, f)
        if f.endswith(".safetensors") or f in _SKIP_FILES or not os.path.isfile(src):
            continue
        shutil.copyfile(src, os.path.join(path, f))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    if drop_quant:
        config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


@contextmanager
def _base_checkpoint(base, seed: int):
    """Yield a float32 base checkpoint directory: ``base`` itself, or a fresh tiny Llama in a tmp dir."""
    if base is not None:
        yield str(base)
        return
    from tests.checkpoints import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="hsdp-qbase-") as tmp:
        yield write_checkpoint(os.path.join(tmp, "base"), "llama", dtype=torch.float32, seed=seed)


def _prepare_out(path) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):  # stale shards of an earlier write would be read back as well
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    return path


def _is_quantized_linear(name: str) -> bool:
    return bool(re.search(r"\.layers\.\d+\.(self_attn|mlp)\.(%s)\.weight$" % "|".join(LINEARS), name))


def _is_any_projection(name: str) -> bool:
    """Every projection of a block, experts' and latent attention's too (DeepSeek-V3's fp8 checkpoints
    quantize all of them; the router ``mlp.gate`` and the norms stay)."""
    return bool(re.search(r"\.layers\.\d+\.(self_attn|mlp)\.((shared_)?experts\.(\d+\.)?)?\w*proj\w*\.weight$", name))


# ---------------------------------------------------------------------------------------------
# 1. transformers "fp8" (FineGrainedFP8): block-wise float8_e4m3fn + weight_scale_inv
# ---------------------------------------------------------------------------------------------

def quantize_fp8_block(w: torch.Tensor, block=(32, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/b0), ceil(in/b1)])."""
    b0, b1 = block
    w = w.detach().to(torch.float32)
    out, inn = w.shape
    rows, cols = math.ceil(out / b0), math.ceil(inn / b1)
    padded = torch.nn.functional.pad(w, (0, cols * b1 - inn, 0, rows * b0 - out))  # zeros: amax unchanged
    blocks = padded.reshape(rows, b0, cols, b1)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows * b0, cols * b1)[:out, :inn].contiguous(), scale_inv.contiguous()


def dequantize_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block,
                         dtype=torch.float32) -> torch.Tensor:
    """``weight.to(f32) * scale_inv`` per block (one f32 multiply per element), then ``.to(dtype)``.

    Bit-identical to transformers' ``Fp8Dequantize._dequantize_one`` where that accepts the shape.
    """
    b0, b1 = block
    out, inn = weight.shape
    s = weight_scale_inv.to(torch.float32)
    s = s.repeat_interleave(b0, dim=0)[:out].repeat_interleave(b1, dim=1)[:, :inn]
    return (weight.to(torch.float32) * s).to(dtype)


def write_fp8_block(path, *, base=None, block=(32, 32), seed=0, max_shard_size=DEFAULT_SHARD,
                    experts: bool = False) -> str:
    """DeepSeek-V3 / Qwen3-FP8 style checkpoint (transformers ``quant_method: "fp8"``).

    config ``quantization_config``: ``{"quant_method": "fp8", "activation_scheme": "dynamic",
    "fmt": "e4m3", "weight_block_size": [b0, b1]}`` -- no ``modules_to_not_convert``, as DeepSeek-V3
    ships it (transformers skips ``lm_head`` by default). ``experts``: every projection of a block
    (``_is_any_projection``: each expert's, latent attention's), as DeepSeek-V3 and Qwen3-MoE-FP8
    ship; ``base`` then a MoE checkpoint in the Hub's per-expert layout (save_pretrained writes it).
    """
    block = (int(block[0]), int(block[1]))

    def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_fp8_block(w.t().contiguous(), block)
        return {"weight": q, "weight_scale_inv": s}

    return _write_packed(path, base, seed, max_shard_size, pack, {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [block[0], block[1]],
    }, select=_is_any_projection if experts else _is_quantized_linear)


# ---------------------------------------------------------------------------------------------
# 2-4. compressed-tensors, produced with compressed-tensors itself
# ---------------------------------------------------------------------------------------------

def _observe_minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max per the weight strategy, shaped like the module's ``weight_scale`` (memoryless min-max)."""
    from compressed_tensors.quantization import QuantizationStrategy

    strategy = args.strategy
    if strategy == QuantizationStrategy.GROUP:
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        return g.amin(dim=-1), g.amax(dim=-1)
    if strategy == QuantizationStrategy.CHANNEL:
        return w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    if strategy == QuantizationStrategy.TENSOR:
        lo, hi = torch.aminmax(w)
        return lo, hi
    raise ValueError(f"unsupported weight strategy {strategy}")


def _write_compressed(path, base, seed, scheme, max_shard_size, ignore_extra=()) -> str:
    """Load base, apply ``scheme`` to the layers' Linears, calibrate weights (min-max), compress, save."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    path = _prepare_out(path)
    with _base_checkpoint(base, seed) as base_dir:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        config = QuantizationConfig(
            config_groups={"group_0": scheme},
            ignore=["lm_head", *ignore_extra],
            quantization_status=QuantizationStatus.INITIALIZED,
        )
        apply_quantization_config(model, config, show_progress=False)
        with torch.no_grad():
            for name, module in model.named_modules():
                qscheme = getattr(module, "quantization_scheme", None)
                if qscheme is None or qscheme.weights is None:
                    continue
                lo, hi = _observe_minmax(module.weight.data.to(torch.float32), qscheme.weights)
                scale, zero_point = calculate_qparams(lo, hi, qscheme.weights)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
                module.quantization_status = QuantizationStatus.FROZEN
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        state = model.state_dict()
        write_shards(path, state, max_shard_size, order=list(state))
        _copy_side_files(base_dir, path, None)
        compressor.update_config(path)
    return path


def _linear_in_features(base, seed) -> dict[str, int]:
    with _base_checkpoint(base, seed) as base_dir:
        from safetensors import safe_open

        sizes = {}
        for f in os.listdir(base_dir):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(base_dir, f), "pt") as st:
                    for k in st.keys():
                        if _is_quantized_linear(k):
                            sizes[k[: -len(".weight")]] = st.get_slice(k).get_shape()[-1]
        return sizes


def write_compressed_w4a16(path, *, base=None, group_size=32, symmetric=True, seed=0,
                           max_shard_size=DEFAULT_SHARD) -> str:
    """compressed-tensors ``pack-quantized`` INT4 weight-only, group strategy (llm-compressor W4A16 /
    W4A16_ASYM with ``group_size``). Linears whose in_features ``group_size`` does not divide are
    added to ``ignore`` and stay float32 (compressed-tensors cannot group-quantize them)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size,
                                 symmetric=symmetric, dynamic=False),
    )
    base_is_tmp = base is None
    if base_is_tmp:  # build the base once: it is needed twice
        with _base_checkpoint(None, seed) as base_dir:
            return write_compressed_w4a16(path, base=base_dir, group_size=group_size,
                                          symmetric=symmetric, seed=seed, max_shard_size=max_shard_size)
    indivisible = [m for m, n in _linear_in_features(base, seed).items() if n % group_size]
    return _write_compressed(path, base, seed, scheme, max_shard_size, ignore_extra=indivisible)


def write_compressed_experts(path, *, base, num_bits=4, group_size=16, symmetric=True, kind="pack-quantized",
                             strategy=None, max_shard_size=DEFAULT_SHARD) -> str:
    """A MoE checkpoint as llm-compressor writes Qwen3-MoE's and DeepSeek's, each expert's projections
    under their own names (``experts.{e}.gate_proj.<tensor>``), compressed by compressed-tensors' own
    compressor; the router, norms, embeddings and ``lm_head`` stay float32 (``ignore``). ``base``: a
    MoE checkpoint in the Hub's per-expert layout. ``kind``:

    * ``pack-quantized``: W4A16 (``num_bits`` 4) or W8A16 (8), symmetric (W4A16_ASYM's zero points
      where not), ``group_size`` (None: per channel); every projection of a block.
    * ``int-quantized``: W8A8 (int8 weights per channel, ``symmetric`` or not, dynamic per-token
      int8 activations); ``float-quantized``: FP8_DYNAMIC (e4m3 weights per ``strategy``, channel
      or tensor, dynamic per-token fp8 activations). The experts' projections only: attention stays
      float32 (``ignore``), so that the dense checkpoint of the dequantized weights is the reference
      of a model whose experts run weight-only."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, \
        QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    ignore = ["lm_head", "re:.*mlp.gate$"]
    if kind == "pack-quantized":
        weights = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, dynamic=False,
                                   strategy="group" if group_size else "channel", group_size=group_size)
        activations, select = None, _is_any_projection
    else:
        number = "float" if kind == "float-quantized" else "int"
        weights = QuantizationArgs(num_bits=8, type=number, symmetric=symmetric, dynamic=False,
                                   strategy=strategy or "channel")
        activations = QuantizationArgs(num_bits=8, type=number, strategy="token", symmetric=True, dynamic=True)
        ignore.append("re:.*self_attn.*")

        def select(name: str) -> bool:
            return _is_any_projection(name) and ".experts." in name
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations, format=kind)
    compressor = BaseCompressor.get_value_from_registry(kind)

    def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
        w = w.t().contiguous()  # [out, in]
        lo, hi = _observe_minmax(w, weights)
        scale, zero_point = calculate_qparams(lo, hi, weights)
        per_tensor = weights.strategy == "tensor"
        tensors = {"weight": w, "weight_scale": scale.reshape(1) if per_tensor else scale.reshape(w.shape[0], -1)}
        if not symmetric:
            tensors["weight_zero_point"] = zero_point.reshape(tensors["weight_scale"].shape)
        return compressor.compress(tensors, scheme)

    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format=kind,
                                quantization_status=QuantizationStatus.COMPRESSED)
    quant_config = {"quant_method": "compressed-tensors", **config.model_dump(mode="json", exclude_none=True)}
    return _write_packed(path, base, 0, max_shard_size, pack, quant_config, select=select)


def write_compressed_w8a8(path, *, base=None, seed=0, max_shard_size=DEFAULT_SHARD) -> str:
    """compressed-tensors ``int-quantized`` W8A8 (llm-compressor W8A8 / INT8 preset): int8 weights
    symmetric per output channel, dynamic symmetric per-token int8 input activations."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True,
                                           dynamic=True),
    )
    return _write_compressed(path, base, seed, scheme, max_shard_size)


def write_compressed_fp8(path, *, base=None, weight_strategy="channel", seed=0,
                         max_shard_size=DEFAULT_SHARD) -> str:
    """compressed-tensors ``float-quantized`` FP8 W8A8 (llm-compressor FP8_DYNAMIC): float8_e4m3fn
    weights, symmetric per channel (or per tensor), dynamic per-token FP8 input activations."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="float", strategy=weight_strategy, symmetric=True,
                                 dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True,
                                           dynamic=True),
    )
    return _write_compressed(path, base, seed, scheme, max_shard_size)


# ---------------------------------------------------------------------------------------------
# 5-6. GPTQ and AWQ, packed by hand from their specifications (no CPU library loads them)
# ---------------------------------------------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: code i of a word holds column AWQ_ORDER[i] of its 8


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) as the int32 a checkpoint stores (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """``bits``-wide codes (0 <= code < 2**bits) of a 2-D tensor into int32 words along ``dim``, code j of
    a word at bits ``[bits*j, bits*(j+1))``; ``order``: which of the word's values each code holds."""
    per = 32 // bits
    c = codes.to(torch.int64) if dim == 1 else codes.to(torch.int64).t()
    c = c.reshape(c.shape[0], -1, per)
    words = torch.zeros(c.shape[:2], dtype=torch.int64)
    for j in range(per):
        words |= c[:, :, (order or range(per))[j]] << (bits * j)
    return _to_int32(words if dim == 1 else words.t())


def unpack_codes_by_hand(words: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """The inverse of ``pack_codes``: int64 codes."""
    per = 32 // bits
    w = (words.to(torch.int64) & 0xFFFFFFFF) if dim == 1 else (words.to(torch.int64) & 0xFFFFFFFF).t()
    out = torch.zeros(w.shape[0], w.shape[1], per, dtype=torch.int64)
    for j in range(per):
        out[:, :, (order or range(per))[j]] = (w >> (bits * j)) & ((1 << bits) - 1)
    out = out.reshape(w.shape[0], -1)
    return out if dim == 1 else out.t()


def _quantize_groups(w: torch.Tensor, groups: torch.Tensor, bits: int, symmetric: bool):
    """Min-max quantization of ``w`` [in, out] by input group (``groups[i]``: row i's group):
    (codes [in, out], fp16 scales [n, out], zero points [n, out]), GPTQ's and AWQ's arithmetic."""
    maxq = 2 ** bits - 1
    n = int(groups.max()) + 1
    scales = torch.empty(n, w.shape[1])
    zeros = torch.empty(n, w.shape[1], dtype=torch.int64)
    for g in range(n):
        rows = w[groups == g]
        if symmetric:
            scale = (2 * rows.abs().amax(0) / maxq).clamp(min=1e-6)
            zero = torch.full((w.shape[1],), (maxq + 1) // 2)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-6)
            zero = torch.round(-lo / scale).clamp(0, maxq).to(torch.int64)
        scales[g], zeros[g] = scale, zero
    scales = scales.to(torch.float16)
    codes = torch.round(w / scales.float()[groups]) + zeros[groups]
    return codes.clamp(0, maxq).to(torch.int64), scales, zeros


def write_gptq(path, *, base=None, bits=4, group_size=16, symmetric=True, act_order=False,
               checkpoint_format="gptq", seed=0, max_shard_size=DEFAULT_SHARD, experts: bool = False) -> str:
    """AutoGPTQ / GPTQModel checkpoint (``quant_method: "gptq"``): per linear ``<m>.qweight`` int32
    [in*bits/32, out] (codes packed along the input, LSB first), ``<m>.qzeros`` int32
    [groups, out*bits/32] (packed along the output; ``checkpoint_format`` ``"gptq"`` stores each zero
    point minus one, ``"gptq_v2"`` as is), ``<m>.scales`` fp16 [groups, out], ``<m>.g_idx`` int32 [in]
    (row i's group: ``i // group_size``, or with ``act_order`` its rank in a random order // group).
    ``experts``: every projection of a block, each expert's under its own name (GPTQModel's MoE
    checkpoints; ``base`` a MoE checkpoint in the Hub's per-expert layout)."""
    gen = torch.Generator().manual_seed(seed + 1)

    def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
        order = torch.randperm(w.shape[0], generator=gen) if act_order else torch.arange(w.shape[0])
        g_idx = torch.empty(w.shape[0], dtype=torch.int64)
        g_idx[order] = torch.arange(w.shape[0]) // group_size
        codes, scales, zeros = _quantize_groups(w, g_idx, bits, symmetric)
        stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
        return {"qweight": pack_codes(codes, bits, 0), "qzeros": pack_codes(stored_zeros & (2 ** bits - 1), bits, 1),
                "scales": scales, "g_idx": g_idx.to(torch.int32)}

    return _write_packed(path, base, seed, max_shard_size, pack, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
        "checkpoint_format": checkpoint_format}, select=_is_experts_or_linear if experts else _is_quantized_linear)


def _write_packed(path, base, seed, max_shard_size, pack, quant_config: dict, select=_is_quantized_linear) -> str:
    """The base checkpoint with each quantized linear's ``<m>.weight`` (``select(name)``) replaced by
    ``pack(w)``'s tensors (``w`` the weight transposed, [in, out], float32), named ``<m>.<key>``."""
    path = _prepare_out(path)
    with _base_checkpoint(base, seed) as base_dir:
        tensors = read_tensors(base_dir)
        out: dict[str, torch.Tensor] = {}
        for name in sorted(tensors, key=_natural_key):
            t = tensors[name]
            if not select(name):
                out[name] = t.to(torch.float32)
                continue
            m = name[: -len(".weight")]
            out.update({f"{m}.{key}": value for key, value in pack(t.to(torch.float32).t()).items()})
        write_shards(path, out, max_shard_size, order=list(out))
        _copy_side_files(base_dir, path, quant_config)
    return path


def _is_experts_or_linear(name: str) -> bool:
    """What GPTQModel and AutoAWQ quantize in a MoE: attention's and every expert's projections (not
    the router ``mlp.gate``)."""
    return bool(re.search(r"\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?(%s)\.weight$" % "|".join(LINEARS), name))


def write_awq(path, *, base=None, group_size=16, seed=0, max_shard_size=DEFAULT_SHARD, experts: bool = False) -> str:
    """AutoAWQ GEMM checkpoint (``quant_method: "awq"``, 4 bits, zero points): per linear
    ``<m>.qweight`` int32 [in, out/8] (codes packed along the output in ``AWQ_ORDER``), ``<m>.qzeros``
    int32 [groups, out/8] (likewise), ``<m>.scales`` fp16 [groups, out]."""

    def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales, zeros = _quantize_groups(w, torch.arange(w.shape[0]) // group_size, 4, False)
        return {"qweight": pack_codes(codes, 4, 1, AWQ_ORDER), "qzeros": pack_codes(zeros, 4, 1, AWQ_ORDER),
                "scales": scales}

    return _write_packed(path, base, seed, max_shard_size, pack, {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None}, select=_is_experts_or_linear if experts else _is_quantized_linear)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of ``w`` [E, rows, cols] along ``cols``: (blocks uint8 [E, rows, cols/32, 16], two
    e2m1 codes a byte, low nibble first; scales uint8 [E, rows, cols/32], ``2**(scale - 127)``
    scaling each 32 values so that the largest lands in [4, 8), codes the nearest e2m1 value)."""
    e, rows, cols = w.shape
    block = w.reshape(e, rows, cols // 32, 32)
    exponent = (torch.floor(torch.log2(block.abs().amax(-1).clamp(min=2.0 ** -100))) - 2).clamp(-127, 127)
    scaled = block / torch.pow(2.0, exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4(path, *, base=None, seed=0, max_shard_size=DEFAULT_SHARD) -> str:
    """gpt-oss's MXFP4 checkpoint (``quant_method: "mxfp4"``): each layer's fused experts
    ``mlp.experts.{gate_up_proj,down_proj}`` [E, in, out] stored as ``<p>_blocks`` / ``<p>_scales``
    of the transposed [E, out, in] weight (``quantize_mxfp4``); everything else float32. ``base``: a
    float32 gpt_oss checkpoint (``write_checkpoint(..., "gpt_oss")``), made here when None."""
    from tests.checkpoints import write_checkpoint

    path = _prepare_out(path)
    with tempfile.TemporaryDirectory(prefix="hsdp-mxfp4-") as tmp:
        base_dir = str(base) if base is not None else write_checkpoint(os.path.join(tmp, "base"), "gpt_oss", seed=seed)
        tensors = read_tensors(base_dir)
        out: dict[str, torch.Tensor] = {}
        for name in sorted(tensors, key=_natural_key):
            t = tensors[name].to(torch.float32)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
            else:
                out[name] = t
        write_shards(path, out, max_shard_size, order=list(out))
        _copy_side_files(base_dir, path, {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return path


def dequantize_gptq_by_hand(qweight, qzeros, scales, g_idx, bits: int, checkpoint_format: str) -> torch.Tensor:
    """GPTQ's dequantization, from its specification: [out, in] float32,
    ``scale[g] * (code - zero[g])`` with ``g = g_idx[i]``, a v1 zero point its stored code plus one."""
    codes = unpack_codes_by_hand(qweight, bits, 0)
    zeros = unpack_codes_by_hand(qzeros, bits, 1) + (1 if checkpoint_format == "gptq" else 0)
    g = g_idx.to(torch.int64)
    return ((codes - zeros[g]).to(torch.float32) * scales.to(torch.float32)[g]).t()


def dequantize_awq_by_hand(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    codes = unpack_codes_by_hand(qweight, 4, 1, AWQ_ORDER)
    zeros = unpack_codes_by_hand(qzeros, 4, 1, AWQ_ORDER)
    g = torch.arange(codes.shape[0]) // group_size
    return ((codes - zeros[g]).to(torch.float32) * scales.to(torch.float32)[g]).t()


# ---------------------------------------------------------------------------------------------
# exact references for what transformers + compressed-tensors compute on CPU
# ---------------------------------------------------------------------------------------------

def unpack_int4(weight_packed: torch.Tensor, shape, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' own unpacker: int32 words -> int8 values in [-8, 7]."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(weight_packed, 4, torch.Size([int(v) for v in shape]), packed_dim=packed_dim)


def unpack_int4_by_hand(weight_packed: torch.Tensor, shape) -> torch.Tensor:
    """The same without compressed-tensors: element j of a row is nibble j % 8 (LSB first) of word
    j // 8, stored with +8 offset."""
    out, inn = (int(v) for v in shape)
    w = weight_packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nib = (w.unsqueeze(-1) >> shifts) & 0xF
    return (nib.reshape(w.shape[0], -1)[:, :inn] - 8).to(torch.int8)


def dequantize_pack_quantized(weight_packed, weight_scale, weight_shape, weight_zero_point=None, *,
                              group_size: int) -> torch.Tensor:
    """INT4 group dequantization as compressed-tensors does it (``_process_group`` -> ``_dequantize``):
    ``(q.to(scale.dtype) - zp.to(scale.dtype)) * scale`` per group of ``group_size`` columns; result
    in ``scale.dtype``."""
    out, inn = (int(v) for v in weight_shape)
    q = unpack_int4(weight_packed, (out, inn))
    scale = weight_scale
    x = q.unflatten(-1, (inn // group_size, group_size)).to(scale.dtype)
    if weight_zero_point is not None:
        zp = unpack_int4(weight_zero_point, (out, scale.shape[-1]), packed_dim=0)
        x = x - zp.to(scale.dtype).unsqueeze(-1)
    return (x * scale.unsqueeze(-1)).flatten(-2)


def dequantize_naive(weight, weight_scale, weight_zero_point=None) -> torch.Tensor:
    """int-quantized / float-quantized (channel [out, 1] or tensor [1] scales):
    ``(weight.to(scale.dtype) - zp) * scale``."""
    x = weight.to(weight_scale.dtype)
    if weight_zero_point is not None:
        x = x - weight_zero_point.to(weight_scale.dtype)
    return x * weight_scale


def fake_quantize_per_token(x: torch.Tensor, kind: str = "int8") -> torch.Tensor:
    """compressed-tensors' dynamic symmetric per-token activation QDQ (``forward_quantize``).

    Per token = amax over every dim but the first two (for a 3D [batch, seq, hidden] input: over
    hidden; a 2D input reduces over *everything*, i.e. per tensor -- compressed-tensors' quirk).
    int8: ``scale = max(|min(x,0)|, max(x,0)) / 127.5`` (bit range 255 / 2); fp8: ``... / 448``
    (896 / 2); a zero scale becomes ``finfo(scale.dtype).eps``. ``q = round_half_even(clamp(x / scale,
    -128, 127))`` (int8) or ``clamp(x / scale, -448, 448).to(float8_e4m3fn).to(x.dtype)`` (fp8);
    result ``q * scale`` (the zero point is 0 and drops out exactly).
    """
    reduce = tuple(range(2, x.ndim))
    if reduce:
        lo = x.amin(dim=reduce, keepdim=True)
        hi = x.amax(dim=reduce, keepdim=True)
    else:
        lo, hi = torch.aminmax(x)
    lo = torch.minimum(lo, torch.zeros_like(lo))
    hi = torch.maximum(hi, torch.zeros_like(hi))
    amax = torch.maximum(lo.abs(), hi.abs())
    if kind == "int8":
        scale = amax / torch.tensor(255.0 / 2, dtype=amax.dtype)
    elif kind == "fp8":
        scale = amax / torch.tensor(896.0 / 2, dtype=amax.dtype)
    else:
        raise ValueError(kind)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)
    scaled = x / scale
    if kind == "int8":
        q = torch.round(torch.clamp(scaled, -128.0, 127.0))
    else:
        q = torch.clamp(scaled, -FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)
    return q.to(scale.dtype) * scale


def dequantized_state_dict(path) -> dict[str, torch.Tensor]:
    """The float32 weights transformers ends up holding for a checkpoint written here (names of the
    dense model: ``<m>.weight``), computed with the references above."""
    path = str(path)
    qc = quantization_config(path) or {}
    tensors = read_tensors(path)
    out: dict[str, torch.Tensor] = {}
    if qc.get("quant_method") == "fp8":
        block = qc["weight_block_size"]
        for k, v in tensors.items():
            if k.endswith(".weight_scale_inv"):
                continue
            s = tensors.get(k + "_scale_inv")
            out[k] = dequantize_fp8_block(v, s, block) if s is not None else v.to(torch.float32)
        return out
    if qc.get("quant_method") in ("gptq", "awq"):
        for k, v in tensors.items():
            m, _, leaf = k.rpartition(".")
            if leaf in ("qzeros", "scales", "g_idx"):
                continue
            if leaf != "qweight":
                out[k] = v.to(torch.float32)
            elif qc["quant_method"] == "gptq":
                out[m + ".weight"] = dequantize_gptq_by_hand(v, tensors[m + ".qzeros"], tensors[m + ".scales"],
                                                             tensors[m + ".g_idx"], qc["bits"],
                                                             qc.get("checkpoint_format", "gptq"))
            else:
                out[m + ".weight"] = dequantize_awq_by_hand(v, tensors[m + ".qzeros"], tensors[m + ".scales"],
                                                            qc["group_size"])
        return out
    if qc.get("quant_method") != "compressed-tensors":
        return {k: v.to(torch.float32) for k, v in tensors.items()}
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_scale", ".weight_packed"))}
    for k, v in tensors.items():
        m, _, leaf = k.rpartition(".")
        if m not in modules:
            out[k] = v.to(torch.float32)
        elif leaf == "weight_packed":
            group = next(iter(qc["config_groups"].values()))["weights"]["group_size"]
            out[m + ".weight"] = dequantize_pack_quantized(
                v, tensors[m + ".weight_scale"], tensors[m + ".weight_shape"],
                tensors.get(m + ".weight_zero_point"), group_size=group)
        elif leaf == "weight" and m + ".weight_scale" in tensors:
            out[k] = dequantize_naive(v, tensors[m + ".weight_scale"], tensors.get(m + ".weight_zero_point"))
    return out


def write_dequantized(path, quantized_path) -> str:
    """A plain float32 checkpoint of ``dequantized_state_dict(quantized_path)`` (no
    ``quantization_config``), sharded like the others. For the FP8-block and W4A16 formats transformers
    on CPU computes exactly this model (dense float32 linears, no activation quantization), so
    ``reference_generate`` on it is the reference even where transformers cannot load the quantized
    checkpoint itself (partial FP8 blocks). Not so for W8A8 / FP8-dynamic: there transformers also
    fake-quantizes every quantized linear's input per token (see ``fake_quantize_per_token``)."""
    path = _prepare_out(path)
    tensors = dequantized_state_dict(quantized_path)
    write_shards(path, tensors, order=sorted(tensors, key=_natural_key))
    _copy_side_files(str(quantized_path), path, None, drop_quant=True)
    return path
