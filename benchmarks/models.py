"""The benchmarks' checkpoints, random weights with the demo's locally trained tokenizer, generated
once and cached (nothing is downloaded): the serving bench Llama of about 80M parameters, and a
deep tiny Llama whose step is nearly all host time."""

from __future__ import annotations

import os
import shutil
import sys

import torch

BENCH_NAME = "bench-llama-80m-v2"
DEEP_TINY_NAME = "bench-llama-24x64-v1"


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


def _llama_checkpoint(out_dir: str, *, max_shard_size: str, dtype=torch.bfloat16, **shape) -> str:
    from loaders.sources.default_model import cache_root

    out_dir = os.path.join(cache_root(), out_dir)  # an absolute out_dir stays what it is
    marker = os.path.join(out_dir, ".complete")
    if os.path.isfile(marker):
        return out_dir
    from transformers import AutoModelForCausalLM, LlamaConfig

    from loaders.sources.demo import train_byte_bpe_tokenizer

    print(f"[bench] generating {out_dir}", file=sys.stderr, flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tok = train_byte_bpe_tokenizer(all_bytes=False)  # every token is whole text: streams show each one
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
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
