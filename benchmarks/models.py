"""The benchmarks' checkpoints, random weights with the demo's locally trained tokenizer, generated
once and cached (nothing is downloaded): the serving bench Llama of about 80M parameters, a deep
tiny Llama whose step is nearly all host time, and a pair of equal size but for their attention
(multi-head latent attention shaped as DeepSeek-V3's, and grouped-query) for the MLA step."""

from __future__ import annotations

import os
import shutil
import sys

import torch

BENCH_NAME = "bench-llama-80m-v2"
DEEP_TINY_NAME = "bench-llama-24x64-v1"
PAIR_SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8)
"""The MLA/GQA pair's common shape: DeepSeek-V3's proportions at hidden 512 (its latent 1/4 of the
hidden size as V3's 512 of 7168 is not: kept at V3's 128-dim heads' quarter)."""


def bench_checkpoint(out_dir: str | None = None) -> str:
    """11 decoder layers of hidden size 768 (78.5M parameters, 157 MB in bf16), in 40 MB files so
    that layers straddle them; vocabulary of the demo's tokenizer trained on ASCII bytes only.
    Written once under hsdp-serve's cache directory unless ``out_dir`` says where."""
    return _llama_checkpoint(out_dir or BENCH_NAME, hidden_size=768, intermediate_size=2048, num_hidden_layers=11,
                             num_attention_heads=12, num_key_value_heads=12, max_shard_size="40MB")


def deep_tiny_checkpoint(out_dir: str | None = None) -> str:
    """24 decoder layers of hidden size 64, 2 heads of 32 (vLLM's CPU attention takes head dim 32,
    not 16), about 1M parameters in float32: a step's arithmetic is nearly nothing, so its time is
    the host's (module calls, hooks, the engine). Issue 25's CPU model."""
    return _llama_checkpoint(out_dir or DEEP_TINY_NAME, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                             num_attention_heads=2, num_key_value_heads=2, max_shard_size="2MB", dtype=torch.float32)


def deep_tiny_bloom_checkpoint(out_dir: str | None = None) -> str:
    """:func:`deep_tiny_checkpoint`'s shape as a Bloom (24 layers of hidden 64, 2 heads of 32; its MLP
    4x the hidden size): ALiBi through the attention adapter (``server.engine.adapters``), whose
    step, eager or compiled, is nearly all host time as the tiny Llama's is."""
    from transformers import BloomConfig

    return _checkpoint(out_dir or "bench-bloom-24x64-v1", BloomConfig, max_shard_size="2MB", dtype=torch.float32,
                       hidden_size=64, n_layer=24, n_head=2)


def deep_tiny_lfm2_checkpoint(out_dir: str | None = None) -> str:
    """:func:`deep_tiny_checkpoint`'s shape as an LFM2 hybrid: of its 24 layers, two short
    convolutions (a state slot per sequence: ``server.engine.state``) to one attention layer, as
    LFM2's own 10 of 16; its step, eager or compiled, is nearly all host time."""
    from transformers import Lfm2Config

    layer_types = ["conv", "conv", "full_attention"] * 8
    return _checkpoint(out_dir or "bench-lfm2-24x64-v1", Lfm2Config, max_shard_size="2MB", dtype=torch.float32,
                       hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=2,
                       num_key_value_heads=2, layer_types=layer_types)


def deep_tiny_qwen3_5_checkpoint(out_dir: str | None = None) -> str:
    """:func:`deep_tiny_checkpoint`'s shape as a Qwen3.5 hybrid: of its 24 layers, three gated
    delta-nets (a convolution window and a recurrent state per sequence: ``server.engine.state``) to
    one attention layer, as Qwen3.5's own; delta-net heads 2 of 32 for keys and values."""
    from transformers import Qwen3_5TextConfig

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return _checkpoint(out_dir or "bench-qwen3_5-24x64-v1", Qwen3_5TextConfig, max_shard_size="2MB",
                       dtype=torch.float32, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=32, layer_types=layer_types * 6,
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                       linear_value_head_dim=32)


def deep_tiny_xlstm_checkpoint(out_dir: str | None = None) -> str:
    """:func:`deep_tiny_checkpoint`'s shape as an xLSTM: 24 mLSTM layers (a matrix memory a head, its
    state passed as an argument: ``server.engine.state_adapters``), 2 heads, keys half as wide as
    values as xLSTM-7B's."""
    from transformers import xLSTMConfig

    return _checkpoint(out_dir or "bench-xlstm-24x64-v1", xLSTMConfig, max_shard_size="2MB", dtype=torch.float32,
                       hidden_size=64, num_hidden_layers=24, num_heads=2)


def deep_tiny_rwkv_checkpoint(out_dir: str | None = None) -> str:
    """:func:`deep_tiny_checkpoint`'s shape as an RWKV-4: 24 blocks of time and channel mixing (five
    states a layer: ``server.engine.state_adapters``), its eval mode's rescaling every 6 blocks."""
    from transformers import RwkvConfig

    return _checkpoint(out_dir or "bench-rwkv-24x64-v1", RwkvConfig, max_shard_size="2MB", dtype=torch.float32,
                       hidden_size=64, num_hidden_layers=24, intermediate_size=128)


def mla_checkpoint(out_dir: str | None = None) -> str:
    """A DeepSeek-V3-shaped model of :data:`PAIR_SHAPE`: latent 128 + rope key 32 cached a token a
    layer (160 values), a low-rank query (384), heads of 64 + 32 and values of 64; dense layers only
    (no experts: the step's attention is what differs from :func:`gqa_checkpoint`)."""
    from transformers import DeepseekV3Config

    return _checkpoint(out_dir or "bench-mla-8x512-v1", DeepseekV3Config, max_shard_size="40MB", dtype=torch.float32,
                       num_key_value_heads=PAIR_SHAPE["num_attention_heads"], kv_lora_rank=128, q_lora_rank=384,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                       first_k_dense_replace=PAIR_SHAPE["num_hidden_layers"], **PAIR_SHAPE)


def gqa_checkpoint(out_dir: str | None = None) -> str:
    """The Llama of :data:`PAIR_SHAPE` with grouped-query attention: 2 KV heads of 64, 256 values a
    token a layer cached."""
    return _llama_checkpoint(out_dir or "bench-gqa-8x512-v1", max_shard_size="40MB", dtype=torch.float32,
                             num_key_value_heads=2, head_dim=64, **PAIR_SHAPE)


def moe_fp8_checkpoint(out_dir: str | None = None) -> str:
    """A Qwen3-MoE of 64 experts, 8 routed a token (DeepSeek-V3's 256 and 8 at a quarter; hidden 512,
    experts of 256, 4 layers), every projection stored as DeepSeek-V3 and Qwen3-MoE-FP8 ship them:
    e4m3 in 128x128 blocks with float32 scales (``tests.quantized_checkpoints.write_fp8_block``)."""
    from tests.quantized_checkpoints import write_fp8_block

    return _quantized_moe(out_dir or "bench-qwen3-moe-fp8-64x8-v1",
                          lambda out, base: write_fp8_block(out, base=base, block=(128, 128), experts=True,
                                                            max_shard_size="40MB"))


def moe_w4a16_checkpoint(out_dir: str | None = None) -> str:
    """The MoE of :func:`moe_fp8_checkpoint` as llm-compressor's W4A16 writes it: compressed-tensors
    pack-quantized INT4, symmetric, groups of 128 (``tests.quantized_checkpoints.write_compressed_experts``)."""
    from tests.quantized_checkpoints import write_compressed_experts

    return _quantized_moe(out_dir or "bench-qwen3-moe-w4a16-64x8-v1",
                          lambda out, base: write_compressed_experts(out, base=base, num_bits=4, group_size=128,
                                                                     max_shard_size="40MB"))


def _quantized_moe(out_dir: str, write) -> str:
    from transformers import Qwen3MoeConfig

    from loaders.sources.default_model import cache_root

    out_dir = os.path.join(cache_root(), out_dir)
    if os.path.isfile(os.path.join(out_dir, ".complete")):
        return out_dir
    base = _checkpoint("bench-qwen3-moe-64x8-v1", Qwen3MoeConfig, max_shard_size="40MB", dtype=torch.float32,
                       hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=64,
                       num_experts_per_tok=8, norm_topk_prob=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    write(out_dir, base)
    open(os.path.join(out_dir, ".complete"), "w").close()
    return out_dir


def _llama_checkpoint(out_dir: str, *, max_shard_size: str, dtype=torch.bfloat16, **shape) -> str:
    from transformers import LlamaConfig

    return _checkpoint(out_dir, LlamaConfig, max_shard_size=max_shard_size, dtype=dtype, **shape)


def _checkpoint(out_dir: str, config_class, *, max_shard_size: str, dtype=torch.bfloat16, **shape) -> str:
    from loaders.sources.default_model import cache_root

    out_dir = os.path.join(cache_root(), out_dir)  # an absolute out_dir stays what it is
    marker = os.path.join(out_dir, ".complete")
    if os.path.isfile(marker):
        return out_dir
    from transformers import AutoModelForCausalLM

    from loaders.sources.demo import train_byte_bpe_tokenizer

    print(f"[bench] generating {out_dir}", file=sys.stderr, flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tok = train_byte_bpe_tokenizer(all_bytes=False)  # every token is whole text: streams show each one
    config = config_class(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    tok.save_pretrained(out_dir)
    open(marker, "w").close()
    return out_dir


def compute_dtype(requested: str = "auto") -> str:
    """The dtype a CPU benchmark computes in: the bench checkpoint's bf16 where this CPU has native
    bf16 arithmetic, else float32 (what the server's --dtype auto does); ``requested`` overrides.
    Every figure is printed with it."""
    if requested != "auto":
        return requested
    from loaders.dtypes import auto_dtype

    dtype, why = auto_dtype(torch.bfloat16, "cpu")
    if why:
        print(f"[bench] {why}", file=sys.stderr, flush=True)
    return str(dtype).removeprefix("torch.")


def parameter_count(model_dir: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())
