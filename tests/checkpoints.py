"""Small real checkpoints written with transformers: random weights, layers straddling files."""

from __future__ import annotations

import functools
import os

import torch

from loaders.sources.demo import train_byte_bpe_tokenizer

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a server that never hung",
    "hsdp",
]


@functools.lru_cache(maxsize=1)
def tokenizer():
    return train_byte_bpe_tokenizer()


def make_config(arch: str, vocab_size: int):
    from transformers import BertConfig, GPT2Config, LlamaConfig, Qwen2Config

    if arch == "llama":  # GQA, untied
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    if arch == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    if arch == "gpt2":  # tied, Conv1D
        return GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=3, n_head=4, n_positions=256,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    if arch == "gpt_oss":  # fused experts (4, 2 a token), attention sinks, a window on alternate layers
        from transformers import GptOssConfig

        return GptOssConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    if arch == "qwen3_moe":  # per-expert tensors in its checkpoints, fused in the model (4 experts, 2 a token)
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, max_position_embeddings=256, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    if arch == "deepseek_v3":  # latent attention, a dense first layer, then shared and routed experts; every
        # projection's rows and columns a multiple of 16 (transformers' fp8 dequantization derives 16x16 blocks from them)
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            moe_intermediate_size=32, n_group=1, topk_group=1, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    if arch == "bert":
        return BertConfig(
            vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=128, pad_token_id=0,
        )
    raise ValueError(arch)


def write_checkpoint(path, arch: str, *, dtype=torch.float32, seed: int = 0, max_shard_size="40KB",
                     model_class=None) -> str:
    """Save a random-weight ``arch`` model and the test tokenizer to ``path``; returns ``path``."""
    from transformers import AutoModelForCausalLM, BertModel

    tok = tokenizer()
    config = make_config(arch, len(tok))
    torch.manual_seed(seed)
    cls = model_class or (BertModel if arch == "bert" else AutoModelForCausalLM)
    model = (cls.from_config(config) if hasattr(cls, "_model_mapping") else cls(config)).to(dtype)
    path = str(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tok.save_pretrained(path)
    return path


def reference_generate(path: str, prompts=PROMPTS, max_new_tokens: int = 16) -> list[list[int]]:
    """Greedy tokens from transformers' own unsharded model: the reference we must match."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [generate_ids(model, tokenizer(), p, max_new_tokens) for p in prompts]


@torch.no_grad()
def assert_greedy_tokens(server, reference, max_new_tokens: int) -> None:
    """A server's greedy tokens for PROMPTS equal ``reference`` (``reference_generate``'s, of as
    many tokens)."""
    for prompt, want in zip(PROMPTS, reference):
        r = server.client.post("/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": max_new_tokens, "details": True}})
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == want


def generate_ids(model, tok, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
    )
    return out[0, ids.shape[1]:].tolist()


def shard_files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
