"""Quantized checkpoints (FP8 blocks, compressed-tensors INT4/INT8/FP8, GPTQ, AWQ, MXFP4 experts): sharded, exact.

Greedy output on 2 and 3 ranks and a 2x2 mesh equals transformers' own load of the same
checkpoint (float32; where transformers cannot load it, FP8 with partial edge blocks and
asymmetric INT4, the dense checkpoint of exactly the weights transformers' dequantization
gives; for GPTQ and AWQ, which transformers loads only through GPTQModel's kernels, the dense
checkpoint of the weights their specifications give, unpacked by hand); every quantized tensor stays a row-sharded DTensor in its stored dtype; each rank reads
about 1/S of it; one server reports its quantized bytes; an unsupported quantization is refused
in one line before anything is read; ``--quantization int8|fp8`` makes, rows by rows on each rank,
the shards compressed-tensors' quantization of the whole checkpoint gives.
"""

import json
import os
import shutil

import pytest
import torch

from loaders.quantization.linear import int8_kernel_refusal
import tests.quantized_checkpoints as qc
from tests.checkpoints import PROMPTS, assert_greedy_tokens, generate_ids, reference_generate, write_checkpoint
from tests.dist import run_ranks, values
from tests.server_process import ServerProcess, free_port

TOKENS = 12
FORMATS = {
    # name: (writer, whether transformers loads it as is: else the dense dequantized copy is the reference)
    "fp8-block": (lambda path, base: qc.write_fp8_block(path, base=base, block=(32, 32)), False),  # partial blocks
    "fp8-block-16": (lambda path, base: qc.write_fp8_block(path, base=base, block=(16, 16)), True),  # transformers loads
    "w4a16": (lambda path, base: qc.write_compressed_w4a16(path, base=base, group_size=16), True),
    "w4a16-asym": (lambda path, base: qc.write_compressed_w4a16(path, base=base, symmetric=False), False),
    "w8a8": (lambda path, base: qc.write_compressed_w8a8(path, base=base), True),
    "w8a8-bf16-scales": (lambda path, base: _bf16_scales(qc.write_compressed_w8a8(path, base=base)), True),
    "fp8-dynamic": (lambda path, base: qc.write_compressed_fp8(path, base=base), True),
    "fp8-tensor": (lambda path, base: qc.write_compressed_fp8(path, base=base, weight_strategy="tensor"), True),
    "gptq": (lambda path, base: qc.write_gptq(path, base=base, bits=4, group_size=16), False),
    "gptq-8-act-order-v2": (lambda path, base: qc.write_gptq(path, base=base, bits=8, group_size=32, symmetric=False,
                                                            act_order=True, checkpoint_format="gptq_v2"), False),
    "awq": (lambda path, base: qc.write_awq(path, base=base, group_size=16), False),
}
STORED = {"fp8-block": ("weight", torch.float8_e4m3fn), "fp8-block-16": ("weight", torch.float8_e4m3fn),
          "w8a8-bf16-scales": ("weight", torch.int8), "w4a16": ("weight_packed", torch.int32),
          "w4a16-asym": ("weight_packed", torch.int32), "w8a8": ("weight", torch.int8),
          "fp8-dynamic": ("weight", torch.float8_e4m3fn), "fp8-tensor": ("weight", torch.float8_e4m3fn),
          "gptq": ("qweight", torch.int32), "gptq-8-act-order-v2": ("qweight", torch.int32),
          "awq": ("qweight", torch.int32)}


def _bf16_scales(path: str) -> str:
    """The checkpoint with its scales stored in bf16, as llm-compressor writes a bf16 model's: served in
    float32, transformers holds them in float32 and dequantizes there (a bf16 product would differ)."""
    tensors = qc.read_tensors(path)
    for name in [n for n in tensors if n.endswith("weight_scale")]:
        tensors[name] = tensors[name].to(torch.bfloat16)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    qc.write_shards(path, tensors)
    return path


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """{format: (checkpoint, greedy reference ids per prompt)}."""
    root = tmp_path_factory.mktemp("quantized")
    base = write_checkpoint(root / "base", "llama")
    out = {}
    for name, (write, loads) in FORMATS.items():
        path = write(root / name, base)
        reference = path if loads else qc.write_dequantized(root / f"{name}-dense", path)
        out[name] = path, reference_generate(reference, max_new_tokens=TOKENS)
    return out


def _load_and_generate(rank, world_size, paths, mesh):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    out = {}
    for name, path in paths.items():
        loaded = load_hsdp_model(path, HSDPInferenceConfig(replicate_size=mesh[0], shard_size=mesh[1]),
                                 dtype="float32")
        stored, dtype = STORED[name]
        up = loaded.model.model.layers[0].mlp.up_proj
        param = getattr(up, stored)
        assert isinstance(param, DTensor) and param.dtype == dtype, (name, type(param), param.dtype)
        local_rows = param.to_local().shape[0], param.shape[0]
        out[name] = {"ids": [generate_ids(loaded.model, loaded.tokenizer, p, TOKENS) for p in PROMPTS],
                     "bytes_read": loaded.stats.bytes_read, "checkpoint_bytes": loaded.stats.checkpoint_bytes,
                     "local_rows": local_rows, "layers": loaded.stats.quantized_layers}
    return out


@pytest.mark.parametrize("mesh", [(1, 2), (1, 3), (2, 2)], ids=["2-ranks", "3-ranks", "2x2"])
def test_greedy_matches_transformers_and_rows_are_sharded(tmp_path, quantized, mesh):
    # 3 ranks: 176-row linears split 59/59/58, so FP8's 32-row scale blocks straddle the shard edges
    names = list(FORMATS) if mesh == (1, 2) else ["fp8-block", "w8a8", "gptq"] if mesh == (1, 3) else ["w4a16", "awq"]
    world = mesh[0] * mesh[1]
    results = values(run_ranks(_load_and_generate, world, tmp_path, {n: quantized[n][0] for n in names}, mesh,
                               timeout=420))
    for rank, out in enumerate(results):
        for name in names:
            got = out[name]
            assert got["ids"] == quantized[name][1], f"{name} rank {rank} mesh {mesh}"
            assert sum(got["layers"].values()) >= 18, got["layers"]
            local, rows = got["local_rows"]  # up_proj's stored rows: 176 outputs, or GPTQ's/AWQ's packed inputs
            chunk = -(-rows // mesh[1])  # FSDP2's rows a rank: torch.chunk's
            assert local == min(chunk, rows - chunk * (rank % mesh[1])), (name, rank, got["local_rows"])
            # each rank reads its rows: about 1/S of the checkpoint (the norms and
            # weight_shape vectors are read whole by every rank)
            assert got["bytes_read"] < 1.15 * got["checkpoint_bytes"] / mesh[1], (name, got)


def _load_mxfp4(rank, world_size, path, mesh):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from loaders.quantization import quantized_bytes
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(replicate_size=mesh[0], shard_size=mesh[1]), dtype="float32")
    experts = loaded.model.model.layers[0].mlp.experts
    blocks = experts.gate_up_proj_blocks
    assert isinstance(blocks, DTensor) and blocks.dtype == torch.uint8 and "gate_up_proj" not in experts._parameters
    return {"ids": [generate_ids(loaded.model, loaded.tokenizer, p, TOKENS) for p in PROMPTS],
            "local_experts": blocks.to_local().shape[0], "held": quantized_bytes(loaded.model),
            "bytes_read": loaded.stats.bytes_read, "checkpoint_bytes": loaded.stats.checkpoint_bytes,
            "layers": loaded.stats.quantized_layers}


@pytest.mark.parametrize("mesh", [(1, 2), (2, 2)], ids=["2-ranks", "2x2"])
def test_mxfp4_experts_equal_transformers_and_are_sharded_by_experts(tmp_path, mesh):
    """gpt-oss's MXFP4 experts: greedy output equals transformers' own load of the checkpoint (it
    dequantizes on CPU) in float32; the blocks and scales stay uint8, each rank holds its experts'
    (4 experts: 2 a rank) and reads about 1/S of the checkpoint."""
    path = qc.write_mxfp4(tmp_path / "mxfp4")
    reference = reference_generate(path, max_new_tokens=TOKENS)
    results = values(run_ranks(_load_mxfp4, mesh[0] * mesh[1], tmp_path, path, mesh, timeout=300))
    blocks = 2 * 4 * (2 * 64 * 2 * 16 + 64 * 2 * 16)  # 2 layers, 4 experts: gate_up [128, 2, 16], down [64, 2, 16]
    for rank, got in enumerate(results):
        assert got["ids"] == reference, (rank, got["ids"], reference)
        assert got["local_experts"] == 2 and got["layers"] == {"mxfp4 experts (e2m1, a power-of-two scale per 32)": 2}
        assert got["held"]["weights"] == blocks // 2 and got["held"]["scales"] == blocks // 32, got["held"]
        assert got["bytes_read"] < 1.15 * got["checkpoint_bytes"] / mesh[1], got


def _load_fp8_experts(rank, world_size, path, mesh):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from loaders.quantization import quantized_bytes
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(replicate_size=mesh[0], shard_size=mesh[1]), dtype="float32")
    experts = loaded.model.model.layers[1].mlp.experts
    own = dict(experts.named_parameters(recurse=False))
    assert "gate_up_proj" not in own and isinstance(own["gate_up_proj_fp8"], DTensor), sorted(own)
    return {"ids": [generate_ids(loaded.model, loaded.tokenizer, p, TOKENS) for p in PROMPTS],
            "stored": {n: (tuple(p.to_local().shape), p.dtype) for n, p in own.items()},
            "held": quantized_bytes(loaded.model), "bytes_read": loaded.stats.bytes_read,
            "checkpoint_bytes": loaded.stats.checkpoint_bytes, "layers": loaded.stats.quantized_layers}


@pytest.mark.parametrize("arch,block,mesh", [("deepseek_v3", 16, (1, 2)), ("qwen3_moe", 16, (1, 2)),
                                             ("deepseek_v3", 16, (2, 2)), ("qwen3_moe", 16, (1, 3)),
                                             ("deepseek_v3", 32, (1, 2))],
                         ids=["deepseek_v3-2-ranks", "qwen3_moe-2-ranks", "deepseek_v3-2x2", "qwen3_moe-3-ranks",
                              "deepseek_v3-partial-blocks"])
def test_fp8_experts_equal_transformers_and_are_sharded_by_experts(tmp_path, arch, block, mesh):
    """DeepSeek-V3's and Qwen3-MoE-FP8's layout: each expert's projections stored e4m3 with block
    scales under per-expert names (and, for DeepSeek-V3, latent attention's and the shared experts'
    linears too). Greedy output equals transformers' own load (it dequantizes on CPU) in float32;
    the stacked experts stay e4m3 with their scales, each rank holding its experts' (4 experts: 2 a
    rank, 2/1/1 on 3) and reading about 1/S of the checkpoint. 32x32 blocks leave partial edge
    blocks (``kv_a_proj_with_mqa``'s 48 rows, as DeepSeek-V3's 576 in 128s): transformers derives
    its blocks from the scale grid there (wrongly, or refuses), so the reference is the dense
    checkpoint of the weights the fp8 specification gives."""
    base = write_checkpoint(tmp_path / "base", arch)
    path = qc.write_fp8_block(tmp_path / "fp8", base=base, block=(block, block), experts=True)
    reference = reference_generate(path if block == 16 else qc.write_dequantized(tmp_path / "dense", path),
                                   max_new_tokens=TOKENS)
    results = values(run_ranks(_load_fp8_experts, mesh[0] * mesh[1], tmp_path, path, mesh, timeout=300))
    experts = [-(-4 // mesh[1])] * (mesh[1] - 1)
    experts.append(4 - sum(experts))
    for rank, got in enumerate(results):
        assert got["ids"] == reference, (rank, got["ids"], reference)
        local = experts[rank % mesh[1]]
        assert got["stored"]["gate_up_proj_fp8"] == ((local, 64, 64), torch.float8_e4m3fn), got["stored"]
        # gate's and up's 32 rows each: their scale rows stacked, 2 + 2 in 16s, 1 + 1 in 32s
        assert got["stored"]["gate_up_proj_scale_inv"] == ((local, 64 // block, 64 // block), torch.float32)
        assert got["stored"]["down_proj_fp8"] == ((local, 64, 32), torch.float8_e4m3fn), got["stored"]
        moe_layers = 2 if arch == "qwen3_moe" else 1
        assert got["layers"][f"fp8 e4m3 experts, {block}x{block} blocks"] == moe_layers, got["layers"]
        fp8 = moe_layers * 4 * (64 * 64 + 64 * 32)  # (gate_up + down) x experts x layers, 1 byte each
        assert got["held"]["weights"] >= fp8 * local // 4, got["held"]
        assert got["bytes_read"] < 1.15 * got["checkpoint_bytes"] / mesh[1], got


def test_server_serves_a_quantized_checkpoint_and_reports_its_bytes(quantized, tmp_path):
    path, reference = quantized["w8a8"]
    with ServerProcess(path, nproc=2, extra_args=("--dtype", "float32"), log_path=tmp_path / "log") as server:
        assert_greedy_tokens(server, reference, TOKENS)
        info = server.client.get("/info").json()["quantization"]
        assert list(info["layers"].values()) == [21], info
        held = info["bytes_per_rank"]
        assert len(held) == 2 and all(h["weights"] == held[0]["weights"] > 0 for h in held)
        # int8 weights, a byte each: half the rows of q/o (64x64), k/v (32x64), gate/up (176x64) and down
        # (64x176), in 3 layers; a float32 scale per row
        rows = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (176, 64), "up": (176, 64),
                "down": (64, 176)}
        assert held[0]["weights"] == 3 * sum(out // 2 * cols for out, cols in rows.values())
        assert held[0]["scales"] == 3 * sum(out // 2 * 4 for out, _ in rows.values())
        metrics = server.client.get("/metrics").text
        assert f'hsdp_quantized_bytes{{kind="weights",rank="1"}} {float(held[1]["weights"])}' in metrics


def test_server_serves_deepseek_v3_in_fp8(tmp_path):
    """DeepSeek-V3's fp8 layout through the real server on 2 ranks: latent attention over fp8
    projections in the paged cache, fp8 experts sharded by experts, greedy tokens equal to
    transformers' own load; ``/info`` counts the experts modules among the quantized layers and each
    rank holds half the experts' e4m3 bytes."""
    base = write_checkpoint(tmp_path / "base", "deepseek_v3")
    path = qc.write_fp8_block(tmp_path / "fp8", base=base, block=(16, 16), experts=True)
    reference = reference_generate(path, max_new_tokens=TOKENS)
    with ServerProcess(path, nproc=2, extra_args=("--dtype", "float32"), log_path=tmp_path / "log") as server:
        assert_greedy_tokens(server, reference, TOKENS)
        info = server.client.get("/info").json()["quantization"]
        # 2 layers x (q_a, q_b, kv_a, kv_b, o) + the dense MLP's 3 + the shared experts' 3, and 1 experts module
        assert info["layers"] == {"fp8 e4m3, 16x16 blocks": 16, "fp8 e4m3 experts, 16x16 blocks": 1}, info
        experts = 4 * (64 * 64 + 64 * 32) // 2  # a rank's 2 experts' gate_up and down, a byte a weight
        assert all(h["weights"] > experts for h in info["bytes_per_rank"]), info


def test_server_serves_a_w4a16_moe(tmp_path):
    """llm-compressor's W4A16 of Qwen3-MoE through the real server on 2 ranks: greedy tokens equal to
    transformers' own load; ``/info`` counts each layer's experts module and each rank holds half the
    experts' packed codes."""
    base = write_checkpoint(tmp_path / "base", "qwen3_moe")
    path = qc.write_compressed_experts(tmp_path / "w4a16", base=base)
    reference = reference_generate(path, max_new_tokens=TOKENS)
    with ServerProcess(path, nproc=2, extra_args=("--dtype", "float32"), log_path=tmp_path / "log") as server:
        assert_greedy_tokens(server, reference, TOKENS)
        info = server.client.get("/info").json()["quantization"]
        # 2 layers x (q, k, v, o) linears, and 2 experts modules
        assert info["layers"] == {"pack-quantized: int4 group 16": 8, "pack-quantized: int4 group 16 experts": 2}, info
        experts = 2 * 4 * (64 * 64 + 64 * 32) // 2 // 2  # 2 layers, a rank's 2 of 4 experts, half a byte a weight
        assert all(h["weights"] > experts for h in info["bytes_per_rank"]), info


@pytest.mark.parametrize("qconfig, named", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits 3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*lm_head": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
    ({"quant_method": "hqq"}, "'hqq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                "group_size": 16}}}}, "'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                                       "strategy": "channel"}}}},
     "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                    "strategy": "group", "group_size": 128, "actorder": "group"}}}}, "actorder"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                    "strategy": "channel"}, "input_activations": {"num_bits": 8, "type": "int",
                                    "strategy": "tensor", "dynamic": False}}}}, "static"),
])
def test_unsupported_quantization_is_named(qconfig, named):
    from loaders import UnsupportedQuantizationError
    from loaders.quantization import quantization_plan

    with pytest.raises(UnsupportedQuantizationError) as e:
        quantization_plan({"quantization_config": qconfig}, path="config.json")
    assert named in str(e.value) and "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_and_awq_unpack_as_their_specifications_say(bits):
    """The server's vectorized unpacking against the loops of the formats' specifications, for every
    GPTQ width (the served checkpoints cover 4 and 8 bits) and AWQ's interleaved order."""
    from loaders.quantization.storage import dequantize_awq, dequantize_gptq

    gen = torch.Generator().manual_seed(bits)
    out, inn, group = 48, 64, 16
    codes = torch.randint(0, 2 ** bits, (inn, out), generator=gen)
    zeros = torch.randint(0, 2 ** bits, (inn // group, out), generator=gen)
    scales = torch.rand(inn // group, out, generator=gen).to(torch.float16)
    g_idx = torch.randperm(inn, generator=gen) // group
    packed = qc.pack_codes(codes, bits, 0), qc.pack_codes(zeros, bits, 1)
    for fmt, offset in (("gptq", 1), ("gptq_v2", 0)):
        got = dequantize_gptq(*packed, scales, g_idx.to(torch.int32), bits, offset, inn, out)
        assert torch.equal(got, qc.dequantize_gptq_by_hand(*packed, scales, g_idx, bits, fmt)), fmt
    if bits == 4:
        packed = qc.pack_codes(codes, 4, 1, qc.AWQ_ORDER), qc.pack_codes(zeros, 4, 1, qc.AWQ_ORDER)
        got = dequantize_awq(*packed, scales, group, inn, out)
        assert torch.equal(got, qc.dequantize_awq_by_hand(*packed, scales, group))
        assert not torch.equal(got, dequantize_awq(qc.pack_codes(codes, 4, 1), qc.pack_codes(zeros, 4, 1),
                                                   scales, group, inn, out))  # the order matters


def test_the_most_specific_config_group_wins_and_strays_are_refused():
    from torch import nn

    from loaders import CheckpointError
    from loaders.quantization import QuantizedLinear, quantization_plan
    from loaders.quantization.linear import check_nothing_else_quantized

    def group(bits, targets):
        return {"targets": targets, "format": "pack-quantized", "weights": {
            "num_bits": bits, "type": "int", "strategy": "group", "group_size": 16, "actorder": "weight"}}

    plan = quantization_plan({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["re:.*lm_head"], "config_groups": {"a": group(8, ["re:.*down_proj"]), "b": group(4, ["Linear"])}}})
    linear = nn.Linear(16, 16)
    assert plan.format_for("model.layers.0.mlp.down_proj", linear).scheme.weights.num_bits == 8  # regex over class
    assert plan.format_for("model.layers.0.mlp.up_proj", linear).scheme.weights.num_bits == 4
    assert plan.format_for("lm_head", linear) is None
    model = nn.ModuleDict({"proj": QuantizedLinear(16, 16, plan.format_for("x.up_proj", linear),
                                                   {"weight_packed": torch.int32, "weight_scale": torch.float32,
                                                    "weight_shape": torch.int64}, None)})
    stored = {"proj.weight_packed": ((16, 2), torch.int32), "proj.weight_scale": ((16, 1), torch.float32),
              "proj.weight_shape": ((2,), torch.int64)}
    check_nothing_else_quantized(model, stored)
    for stray in ({"experts.gate_up_proj.weight_scale_inv": ((4, 4), torch.float32)},
                  {"experts.0.down_proj.weight": ((16, 16), torch.float8_e4m3fn)}):
        with pytest.raises(CheckpointError, match="belongs to no layer the server dequantizes"):
            check_nothing_else_quantized(model, {**stored, **stray})


def test_server_refuses_an_unsupported_method_before_reading(quantized, tmp_path):
    from tests.test_startup_failures import _start_and_wait

    path = tmp_path / "bitsandbytes"
    shutil.copytree(quantized["w8a8"][0], path)
    with open(path / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    for shard in (f for f in os.listdir(path) if f.endswith(".safetensors")):
        os.truncate(path / shard, 0)  # nothing may be read: a read would fail on these first
    code, errors, elapsed, stderr = _start_and_wait(["--model", str(path), "--port", str(free_port())])
    assert code != 0 and elapsed < 60
    assert len(errors) == 1, stderr[-2000:]
    assert "quant_method 'bitsandbytes' is not supported" in errors[0] and "config.json" in errors[0], errors


def _quantize_on_load(rank, world_size, base, by_hand):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    config = HSDPInferenceConfig(replicate_size=1, shard_size=world_size)
    out = {}
    for kind, hand_path in by_hand.items():
        on_load = load_hsdp_model(base, config, dtype="float32", quantize=kind)
        shards = {n: p.to_local() for n, p in on_load.model.named_parameters() if isinstance(p, DTensor)}
        hand = {n: p.to_local() for n, p in load_hsdp_model(hand_path, config, dtype="float32").model.named_parameters()
                if isinstance(p, DTensor)}
        assert shards.keys() == hand.keys()
        differ = [n for n in shards if shards[n].dtype != hand[n].dtype or
                  not torch.equal(shards[n].view(torch.uint8), hand[n].view(torch.uint8))]
        out[kind] = {"differ": differ, "layers": on_load.stats.quantized_layers,
                     "ids": [generate_ids(on_load.model, on_load.tokenizer, p, TOKENS) for p in PROMPTS]}
    return out


def test_quantize_while_streaming_equals_quantizing_by_hand(tmp_path):
    # the hand-made reference: compressed-tensors quantizes and compresses the whole model (min-max per
    # row), as llm-compressor would; --quantization does it rows by rows on each rank as they are read
    from loaders.quantization.on_load import KINDS, on_load_format

    base = write_checkpoint(tmp_path / "base", "llama")
    by_hand = {kind: qc._write_compressed(tmp_path / kind, base, 0, on_load_format(kind).scheme, "20KB")
               for kind in KINDS}
    references = {kind: reference_generate(path, max_new_tokens=TOKENS) for kind, path in by_hand.items()}
    for rank, out in enumerate(values(run_ranks(_quantize_on_load, 2, tmp_path, base, by_hand, timeout=300))):
        for kind in KINDS:
            assert out[kind]["differ"] == [], f"{kind} rank {rank}: shards unlike the hand-quantized checkpoint's"
            assert list(out[kind]["layers"].values()) == [21], out[kind]["layers"]  # every linear but lm_head
            assert out[kind]["ids"] == references[kind], f"{kind} rank {rank}"


@pytest.mark.skipif(int8_kernel_refusal() is not None,
                    reason="this CPU keeps INT8 weight-only layers on the reference path")
def test_int8_weight_only_decode_rows_go_through_torchs_kernel_in_bf16():
    """``--quantization int8``'s layers (INT8 by channel, weight-only) in bf16: a forward of up to
    INT8_KERNEL_MAX_ROWS rows is torch's int8 kernel on the stored weight, within bf16 rounding of
    the dequantized reference; more rows, float32, and W8A8 (activations quantized) stay on the
    reference bit for bit; a compiled graph of symbolic rows equals eager at every count."""
    from loaders.quantization.linear import INT8_KERNEL_MAX_ROWS, QuantizedLinear
    from loaders.quantization.on_load import on_load_format, quantize_rows

    torch.manual_seed(0)
    dense = torch.randn(48, 64) * 0.05
    fmt = on_load_format("int8")
    stored = quantize_rows(dense, fmt)
    layer = QuantizedLinear(64, 48, fmt, {n: t.dtype for n, t in stored.items()}, None)
    for name, tensor in stored.items():
        setattr(layer, name, torch.nn.Parameter(tensor, requires_grad=False))
    assert layer._int8_kernel
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1):
            x = torch.randn(1, rows, 64).to(dtype)
            reference = torch.nn.functional.linear(x, layer.dequantized_weight(dtype).to(dtype))
            got = layer(x)
            kernel = dtype == torch.bfloat16 and rows <= INT8_KERNEL_MAX_ROWS
            if kernel:
                exact = torch._weight_int8pack_mm(x.view(rows, 64), stored["weight"],
                                                  stored["weight_scale"].view(-1).to(dtype)).view(1, rows, 48)
                assert torch.equal(got, exact)
                torch.testing.assert_close(got.float(), reference.float(), rtol=2e-2, atol=2e-3)
            else:
                assert torch.equal(got, reference), (dtype, rows)
    # one opaque op takes both branches, so a graph of symbolic rows computes what eager does at every count
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for rows in (2, 9, INT8_KERNEL_MAX_ROWS + 7):
        x = torch.randn(1, rows, 64).to(torch.bfloat16)
        assert torch.equal(compiled(x), layer(x)), rows
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from loaders.quantization.formats import LinearFormat

    tokens = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    w8a8 = LinearFormat("int-quantized", scheme=QuantizationScheme(targets=["Linear"], weights=fmt.scheme.weights,
                                                                   input_activations=tokens))
    assert not QuantizedLinear(64, 48, w8a8, {n: t.dtype for n, t in stored.items()}, None)._int8_kernel


def _compiled_and_eager(rank, world_size, paths):
    """Each quantized model, every unit resident, through the engine eagerly and with compiled layers
    (the CPU default sizes 1,2+): greedy tokens of three prompts and what ran compiled."""
    from loaders import load_hsdp_model
    from server.config import COMPILE_BATCH_SIZES
    from shard_engine import HSDPInferenceConfig, set_resident_units
    from tests.test_engine import Harness

    out = {}
    for name, (path, quantize) in paths.items():
        loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32, quantize=quantize)
        set_resident_units(loaded.model, -1, shared=True)
        got = {}
        for mode in ("eager", "compiled"):
            harness = Harness(loaded.model, blocks=64, block_size=4, prefill=64)
            harness.scheduler.eos_token_ids = set()
            if mode == "compiled":
                harness.engines[0].compile_decode(sizes=COMPILE_BATCH_SIZES["cpu"], region="layer", graph_dir="")
            gen = torch.Generator().manual_seed(1)
            prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (13, 6, 9)]
            outs = [harness.submit(p, 4 + 3 * i) for i, p in enumerate(prompts)]
            harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
            got[mode] = [o["tokens"] if o["error"] is None else o["error"] for o in outs]
        compiled = harness.engines[0].compiled
        got["batches"], got["whole_steps"] = sorted(compiled.batches), compiled.whole_steps
        set_resident_units(loaded.model, 0)
        out[name] = got
    return out


def test_compiled_layers_over_quantized_layers_equal_eager(tmp_path):
    """``--compile decode`` over a quantized checkpoint (W8A8: the input fake-quantized in the graph;
    GPTQ with activation order: its codes unpacked and gathered by ``g_idx`` in the graph; gpt-oss's
    MXFP4 experts and Qwen3-MoE's W4A16 experts, dequantized by the experts module's properties in the
    graph: its FP8 and GPTQ experts' properties are the same mechanism over the dequantizations the
    dense formats test, left out for the suite's time on 2-core AVX2 hosts) and over
    ``--quantization int8``: the layers' graphs hold the quantized layers' dequantization,
    and greedy tokens equal eager's in float32 (steps of 3, 2 and 1 sequences and the prompts' step)."""
    base = write_checkpoint(tmp_path / "base", "llama")
    paths = {"w8a8": (qc.write_compressed_w8a8(tmp_path / "w8a8", base=base), None), "int8": (base, "int8"),
             "gptq": (qc.write_gptq(tmp_path / "gptq", base=base, act_order=True), None),
             "mxfp4": (qc.write_mxfp4(tmp_path / "mxfp4"), None),
             "w4a16-experts": (qc.write_compressed_experts(tmp_path / "w4a16-experts",
                                                           base=write_checkpoint(tmp_path / "moe", "qwen3_moe")), None)}
    [got] = values(run_ranks(_compiled_and_eager, 1, tmp_path, paths, timeout=600))
    for name, result in got.items():
        assert result["compiled"] == result["eager"], (name, result)
        assert {1, 2, 3} <= set(result["batches"]) and result["whole_steps"] >= 1, (name, result)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_quantized_experts_dequantize_only_the_routed_ones(monkeypatch, implementation):
    """A forward dequantizes the experts its tokens route to, not the layer's every expert, and its
    output is the same bit for bit as the whole stacked weight's (each of transformers' experts
    implementations); biases (gpt-oss's) are taken for the routed experts too."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import loaders.quantization.experts as experts_module
    from loaders.quantization.experts import FUSED_PROJECTIONS, _quantized_class

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    dense = Qwen3MoeExperts(config).eval()
    quantized = Qwen3MoeExperts(config).eval()
    # each expert's e4m3 weight and block scales (gate and up each with its own scale rows), stacked;
    # the dense module holds exactly their dequantization
    for proj, parts in (("gate_up_proj", 2), ("down_proj", 1)):
        fp8, scales = [], []
        for expert in getattr(dense, proj).data.normal_():
            pieces = [qc.quantize_fp8_block(piece, (16, 16)) for piece in expert.chunk(parts, dim=0)]
            fp8.append(torch.cat([p[0] for p in pieces]))
            scales.append(torch.cat([p[1] for p in pieces]))
        fp8, scales = torch.stack(fp8), torch.stack(scales)
        delattr(quantized, proj)
        quantized.register_parameter(f"{proj}_fp8", torch.nn.Parameter(fp8, requires_grad=False))
        quantized.register_parameter(f"{proj}_scale_inv", torch.nn.Parameter(scales, requires_grad=False))
        getattr(dense, proj).data = torch.stack([
            torch.cat([qc.dequantize_fp8_block(f, s, (16, 16)) for f, s in zip(f8.chunk(parts), sc.chunk(parts))])
            for f8, sc in zip(fp8, scales)])
    quantized.experts_dtype, quantized.fp8_block = torch.float32, (16, 16)
    quantized.fp8_parts = {"gate_up_proj": 2, "down_proj": 1}
    quantized.__class__ = _quantized_class(Qwen3MoeExperts, "FP8", FUSED_PROJECTIONS)

    seen = []
    real = experts_module.dequantize_fp8_block
    monkeypatch.setattr(experts_module, "dequantize_fp8_block",
                        lambda weight, *args, **kwargs: seen.append(weight.shape[0]) or real(weight, *args, **kwargs))
    hidden = torch.randn(3, 32)
    top_k = torch.tensor([[5, 1], [1, 6], [6, 5]])  # 3 of the 8 experts
    weights = torch.rand(3, 2)
    with torch.no_grad():
        got, want = quantized(hidden, top_k, weights), dense(hidden, top_k, weights)
    assert torch.equal(got, want)
    assert seen and set(seen) == {3}, seen  # each dequantization took the 3 routed experts only
    assert quantized.num_experts == 8 and quantized.__dict__["_routed_experts"] is None


def _load_linear_experts(rank, world_size, path, mesh):
    return _load_packed_experts(rank, world_size, path, mesh, "gate_up_proj_qweight")


def _load_packed_experts(rank, world_size, path, mesh, stacked="gate_up_proj_packed"):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from loaders.quantization import quantized_bytes
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(replicate_size=mesh[0], shard_size=mesh[1]), dtype="float32")
    experts = loaded.model.model.layers[1].mlp.experts
    own = dict(experts.named_parameters(recurse=False))
    assert "gate_up_proj" not in own and isinstance(own[stacked], DTensor), sorted(own)
    return {"ids": [generate_ids(loaded.model, loaded.tokenizer, p, TOKENS) for p in PROMPTS],
            "stored": {n: (tuple(p.to_local().shape), p.dtype) for n, p in own.items()},
            "held": quantized_bytes(loaded.model), "bytes_read": loaded.stats.bytes_read,
            "checkpoint_bytes": loaded.stats.checkpoint_bytes, "layers": loaded.stats.quantized_layers}


@pytest.mark.parametrize("fmt,mesh", [("gptq-act-order", (1, 2)), ("gptq-8-v2", (1, 3)), ("awq", (2, 2))])
def test_gptq_and_awq_experts_equal_their_specifications_and_are_sharded_by_experts(tmp_path, fmt, mesh):
    """GPTQModel's and AutoAWQ's MoE checkpoints: attention's and each expert's projections under
    their own names (the router dense). Greedy output equals the dense checkpoint of the weights
    their specifications give (transformers loads them only through GPTQModel's kernels), unpacked
    by hand; the experts stay packed and stacked, each rank holding its experts' codes."""
    base = write_checkpoint(tmp_path / "base", "qwen3_moe")
    writers = {"gptq-act-order": lambda p: qc.write_gptq(p, base=base, act_order=True, experts=True),
               "gptq-8-v2": lambda p: qc.write_gptq(p, base=base, bits=8, group_size=32, symmetric=False,
                                                   checkpoint_format="gptq_v2", experts=True),
               "awq": lambda p: qc.write_awq(p, base=base, experts=True)}
    path = writers[fmt](tmp_path / fmt)
    reference = reference_generate(qc.write_dequantized(tmp_path / "dense", path), max_new_tokens=TOKENS)
    results = values(run_ranks(_load_linear_experts, mesh[0] * mesh[1], tmp_path, path, mesh, timeout=300))
    for rank, got in enumerate(results):
        assert got["ids"] == reference, (rank, got["ids"], reference)
        assert got["stored"]["gate_up_proj_qweight"][1] == torch.int32, got["stored"]
        assert sum(n for what, n in got["layers"].items() if what.endswith("experts")) == 2, got["layers"]
        assert got["bytes_read"] < 1.15 * got["checkpoint_bytes"] / mesh[1], got


@pytest.mark.parametrize("bits,group,mesh,symmetric", [(4, 16, (1, 2), True), (8, None, (1, 3), True),
                                                      (4, 16, (2, 2), True), (4, 16, (1, 2), False)],
                         ids=["w4a16-2-ranks", "w8a16-channel-3-ranks", "w4a16-2x2", "w4a16-asym-2-ranks"])
def test_compressed_tensors_packed_experts_equal_transformers_and_are_sharded_by_experts(tmp_path, bits, group, mesh,
                                                                                          symmetric):
    """llm-compressor's W4A16 (W8A16; W4A16_ASYM, with zero points) of a MoE: every projection, each
    expert's under its own name, compressed-tensors ``pack-quantized`` (codes in int32, a scale per
    group or channel, its shape, packed zero points where asymmetric). Asymmetric: against the weights
    dequantized by hand, as transformers cannot load them.
    Greedy output equals transformers' own load (it decompresses every expert at load) in float32;
    the experts stay packed, stacked, each rank holding its experts' codes and scales and reading
    about 1/S of the checkpoint; attention's linears are QuantizedLinears of the same format."""
    base = write_checkpoint(tmp_path / "base", "qwen3_moe")
    path = qc.write_compressed_experts(tmp_path / "packed", base=base, num_bits=bits, group_size=group,
                                       symmetric=symmetric)
    # transformers 5.24 cannot load asymmetric ones (its CompressedTensorsDequantize of stacked experts
    # gets no zero points: "Asymmetric quant requires zero-point values"): there, the dense checkpoint of
    # the weights compressed-tensors' specification gives, dequantized by hand
    reference = reference_generate(path if symmetric else qc.write_dequantized(tmp_path / "dense", path),
                                   max_new_tokens=TOKENS)
    results = values(run_ranks(_load_packed_experts, mesh[0] * mesh[1], tmp_path, path, mesh, timeout=300))
    experts = [-(-4 // mesh[1])] * (mesh[1] - 1)
    experts.append(4 - sum(experts))
    groups = 64 // group if group else 1
    for rank, got in enumerate(results):
        assert got["ids"] == reference, (rank, got["ids"], reference)
        local = experts[rank % mesh[1]]
        # gate's and up's 32 rows each, stacked; 64 inputs packed 32 // bits a word
        assert got["stored"]["gate_up_proj_packed"] == ((local, 64, 64 * bits // 32), torch.int32), got["stored"]
        assert got["stored"]["gate_up_proj_packed_scale"] == ((local, 64, groups), torch.float32), got["stored"]
        assert got["stored"]["down_proj_packed"] == ((local, 64, 32 * bits // 32), torch.int32), got["stored"]
        what = f"pack-quantized: int{bits} {'group 16' if group else 'per channel'}{'' if symmetric else ' asymmetric'}"
        assert got["layers"][f"{what} experts"] == 2, got["layers"]
        assert any(what.startswith("pack-quantized") and "experts" not in what for what in got["layers"]), got["layers"]
        # gate's and up's zero points, 32 rows each packed 32 // bits a word, a column a group
        zero_points = None if symmetric else ((local, 2 * 32 * bits // 32, groups), torch.int32)
        assert got["stored"].get("gate_up_proj_packed_zero_point") == zero_points, got["stored"]
        assert got["bytes_read"] < 1.15 * got["checkpoint_bytes"] / mesh[1], got


def test_w8a8_experts_are_taken_and_a_quantized_tensor_no_layer_takes_is_refused_naming_it():
    """W8A8 experts (int8 weights, per-token activations) are taken as experts computed weight-only
    (said in their description); an int8 tensor no quantized layer takes (here an embedding stored
    with a scale) is refused before reading, naming the tensor."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from loaders.errors import CheckpointError
    from loaders.quantization import quantization_plan
    from loaders.quantization.experts import quantize_linear_experts
    from loaders.quantization.linear import check_nothing_else_quantized

    plan = quantization_plan({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"a": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}}})
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=2, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    prefix = "model.layers.0.mlp.experts"
    sources = [f"{prefix}.{e}.{p}.weight" for p in ("gate_proj", "up_proj") for e in range(2)]
    stored = {**{s: ((16, 32), torch.int8) for s in sources},
              **{f"{s}_scale": ((16, 1), torch.float32) for s in sources}}
    counts, taken = quantize_linear_experts(model, plan, {f"{prefix}.gate_up_proj": (sources, 2)}, stored)
    assert counts == {"int-quantized: int8 per channel, int8 activations per token (dynamic) experts, their "
                      "activations unquantized": 1} and taken == set(stored), (counts, taken)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_quantized.shape == (2, 32, 32) and experts.gate_up_proj_quantized.dtype == torch.int8
    assert experts.gate_up_proj_quantized_scale.shape == (2, 32, 1)
    check_nothing_else_quantized(model, stored, taken=taken)
    stored["model.embed_tokens.weight"] = ((64, 32), torch.int8)
    stored["model.embed_tokens.weight_scale"] = ((64, 1), torch.float32)
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight is stored quantized .* belongs to no layer"):
        check_nothing_else_quantized(model, stored, taken=taken)


@pytest.mark.parametrize("kind,strategy,symmetric,mesh", [("float-quantized", "channel", True, (1, 2)),
                                                          ("int-quantized", "tensor", False, (2, 2))],
                         ids=["fp8-dynamic-2-ranks", "w8a8-asymmetric-per-tensor-2x2"])
def test_int8_and_fp8_experts_are_computed_weight_only_and_sharded_by_experts(tmp_path, kind, strategy, symmetric,
                                                                             mesh):
    """llm-compressor's FP8_DYNAMIC and W8A8 of a MoE's experts (attention left dense): e4m3 or int8
    weights by channel or by tensor (each of gate's and up's its own), asymmetric int8's zero points.
    transformers cannot load them (its conversion of stacked experts takes packed ones only), and
    the experts run weight-only (no experts forward takes quantized inputs): greedy output equals the
    dense checkpoint of the dequantized weights; the experts stay int8 or e4m3, stacked, each rank
    holding its experts'."""
    base = write_checkpoint(tmp_path / "base", "qwen3_moe")
    path = qc.write_compressed_experts(tmp_path / kind, base=base, kind=kind, strategy=strategy, symmetric=symmetric)
    reference = reference_generate(qc.write_dequantized(tmp_path / "dense", path), max_new_tokens=TOKENS)
    results = values(run_ranks(_load_packed_experts, mesh[0] * mesh[1], tmp_path, path, mesh,
                               "gate_up_proj_quantized", timeout=300))
    experts = 4 // mesh[1]
    weight = torch.float8_e4m3fn if kind == "float-quantized" else torch.int8
    scales = (experts, 64, 1) if strategy == "channel" else (experts, 2)
    for rank, got in enumerate(results):
        assert got["ids"] == reference, (rank, got["ids"], reference)
        assert got["stored"]["gate_up_proj_quantized"] == ((experts, 64, 64), weight), got["stored"]
        assert got["stored"]["gate_up_proj_quantized_scale"][0] == scales, got["stored"]
        assert got["stored"]["down_proj_quantized"] == ((experts, 64, 32), weight), got["stored"]
        assert ("down_proj_quantized_zero_point" in got["stored"]) == (not symmetric), got["stored"]
        [what] = [w for w in got["layers"] if w.endswith("activations unquantized")]
        assert got["layers"][what] == 2 and what.startswith(kind), got["layers"]
        assert got["held"]["weights"] > 0 and got["bytes_read"] < 1.15 * got["checkpoint_bytes"] / mesh[1], got
