"""Model families: each served one matches transformers' greedy ``generate`` (eager attention, the
unsharded model), and each the engine cannot serve is refused before anything is read.

In process, every family runs through the scheduler and a rank engine with prompts longer than
any sliding window, packed two at a time and chunked; then each (Cohere aside, the same code path
as Llama) sharded over 2 ranks from a checkpoint save_pretrained wrote, so in the Hub's layout
(per-expert tensors included), as the server holds it; three of them through the real server too,
two requests at once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.server_process import REPO, ServerProcess

WINDOW = 8  # shorter than every prompt below
ROPE_SWITCH = 16  # where dynamic NTK and longrope change frequencies: inside every prompt and decode below


def _config(family: str, vocab: int = 300):
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)
    hybrid = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    delta_net = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_conv_kernel_dim=4)
    mamba2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                  mamba_chunk_size=16)  # the Mamba2 mixers of Bamba, Granite-4 hybrid, Falcon-H1
    served = {
        "llama": lambda: T.LlamaConfig(**common),
        "mistral": lambda: T.MistralConfig(**common, sliding_window=WINDOW),
        "qwen2": lambda: T.Qwen2Config(**common),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=16),
        "gemma": lambda: T.GemmaConfig(**common, head_dim=16),
        # soft-capped logits (attention and final), a window on alternate layers, query_pre_attn_scalar
        "gemma2": lambda: T.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12),
        "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12),
        "phi3": lambda: T.Phi3Config(**common, sliding_window=WINDOW),
        "starcoder2": lambda: T.Starcoder2Config(**common, sliding_window=WINDOW),
        "olmo2": lambda: T.Olmo2Config(**common),
        "granite": lambda: T.GraniteConfig(**common),
        "cohere": lambda: T.CohereConfig(**common),
        "gpt_neox": lambda: T.GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                                            bos_token_id=0, eos_token_id=0),
        "gpt2": lambda: T.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                     bos_token_id=0, eos_token_id=0),
        # attention sinks, a window on alternate layers, experts
        "gpt_oss": lambda: T.GptOssConfig(**{**common, "intermediate_size": 64}, head_dim=16, sliding_window=WINDOW,
                                          num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32),
        "mixtral": lambda: T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        # multi-head latent attention (its latents cached, attended in the absorbed form), a value dim of its own,
        # experts after a dense first layer, and a low-rank query (V3) or a plain one (V2)
        "deepseek_v3": lambda: T.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                                                  num_experts_per_tok=2, first_k_dense_replace=1,
                                                  moe_intermediate_size=32, n_group=1, topk_group=1),
        "deepseek_v2": lambda: T.DeepseekV2Config(**{**common, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                                                  num_experts_per_tok=2, first_k_dense_replace=1,
                                                  moe_intermediate_size=32, n_group=1, topk_group=1),
        # length-dependent rope, switching well inside every prompt and decode here (ROPE_SWITCH tokens)
        "llama_dynamic_rope": lambda: T.LlamaConfig(**{**common, "max_position_embeddings": ROPE_SWITCH},
                                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 10000.0}),
        "phi3_longrope": lambda: T.Phi3Config(**{**common, "max_position_embeddings": 4 * ROPE_SWITCH},
                                              original_max_position_embeddings=ROPE_SWITCH, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ROPE_SWITCH,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
        # ALiBi in the module's own attention code: served through an adapter (server.engine.adapters)
        "bloom": lambda: T.BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=2, n_head=4, bos_token_id=0,
                                       eos_token_id=0, pad_token_id=0),
        "mpt": lambda: T.MptConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, max_seq_len=512,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0),
        # Falcon's own rope attention through an adapter: multi-query (7B), and the new decoder architecture's
        # grouped keys (40B, 180B)
        "falcon": lambda: T.FalconConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=0),
        # and its ALiBi layout (Falcon-RW): 16 heads, whose slopes 2^(-k/2) make the model's bf16 rounding of
        # slope x position matter
        "falcon_rw": lambda: T.FalconConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=2,
                                            num_attention_heads=16, alibi=True, multi_query=False, bos_token_id=0,
                                            eos_token_id=0, pad_token_id=0),
        # per-sequence recurrent state (server.engine.state): short convolutions beside attention
        "lfm2": lambda: T.Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     layer_types=["conv", "full_attention", "conv", "full_attention"],
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0),
        # gated delta-net (a conv window and a recurrent state) beside attention, experts
        "qwen3_next": lambda: T.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32),
        # a state-space model: no attention at all (SSM state and a conv window per sequence)
        "mamba2": lambda: T.Mamba2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                                         state_size=16, n_groups=1, expand=2, conv_kernel=4, chunk_size=16,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=0),
        # more hybrids through the same per-sequence state (server.engine.state)
        # LFM3: short convolutions beside full and sliding-window attention
        "lfm3": lambda: T.Lfm3Config(**{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
                                     layer_types=["conv", "full_attention", "conv", "sliding_attention"]),
        "lfm2_moe": lambda: T.Lfm2MoeConfig(**{**common, "num_hidden_layers": 4},
                                            layer_types=["conv", "full_attention", "conv", "full_attention"],
                                            num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32),
        "olmo_hybrid": lambda: T.OlmoHybridConfig(
            **{**common, "num_hidden_layers": 4},
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
        "bamba": lambda: T.BambaConfig(**{**common, "num_hidden_layers": 4}, attn_layer_indices=[1, 3], **mamba2),
        "granitemoehybrid": lambda: T.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": 4}, layer_types=["mamba", "attention", "mamba", "attention"],
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32, **mamba2),
        # Mamba2 mixers, attention and feed-forward-only layers
        "nemotron_h": lambda: T.NemotronHConfig(
            **{**common, "num_hidden_layers": 4}, layers_block_type=["mamba", "attention", "mamba", "mlp"],
            head_dim=16, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=1, conv_kernel=4,
            chunk_size=16, use_mamba_kernels=False),
        # attention and a Mamba2 mixer side by side in every layer
        "falcon_h1": lambda: T.FalconH1Config(**common, head_dim=16, mamba_d_ssm=128, **mamba2),
        # Mamba-1 (its prompt scan starts from zero: later chunks go a token at a time)
        "mamba": lambda: T.MambaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, state_size=8,
                                       conv_kernel=4, expand=2, bos_token_id=0, eos_token_id=0, pad_token_id=0),
        "falcon_mamba": lambda: T.FalconMambaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                                    state_size=8, conv_kernel=4, expand=2, bos_token_id=0,
                                                    eos_token_id=0, pad_token_id=0),
        "jamba": lambda: T.JambaConfig(**{**common, "num_hidden_layers": 4}, attn_layer_period=2, attn_layer_offset=1,
                                       expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                       num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                       use_mamba_kernels=False),
        # gated delta-net beside attention: Qwen3.5 dense, and Qwen3.5-MoE as its checkpoints ship (an
        # image-text config and layout, IMAGE_TEXT_LAYOUT; its images: tests/test_vision_qwen.py)
        "qwen3_5": lambda: T.Qwen3_5TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, layer_types=hybrid,
                                              **delta_net),
        "qwen3_5_moe": lambda: T.Qwen3_5MoeConfig(
            text_config=dict(**{**common, "num_hidden_layers": 4}, head_dim=16, layer_types=hybrid, **delta_net,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
            image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
            vision_end_token_id=vocab - 1),
        # Kimi Linear: Kimi delta attention beside multi-head latent attention, experts
        "kimi_linear": lambda: T.KimiLinearConfig(
            **{**common, "num_hidden_layers": 4, "num_key_value_heads": 4}, layer_types=hybrid, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, linear_head_dim=16, linear_num_heads=4),
        # Ling/Ring linear (a delta attention with a forget gate) beside latent attention, experts
        "bailing_hybrid": lambda: T.BailingHybridConfig(
            **{**common, "num_hidden_layers": 4, "num_key_value_heads": 4}, layer_types=hybrid, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, linear_head_dim=16, n_group=1, topk_group=1),
        # gated delta-net beside full and sliding-window attention, experts
        "lara_mini": lambda: T.LaraMiniConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, **delta_net,
                                              sliding_window=WINDOW, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=32),
        # lightning attention (one K^T V state, through MiniMax's own cache methods) beside attention, experts;
        # blocks of 8 tokens in its prompt path
        "minimax": lambda: T.MiniMaxConfig(**{**common, "num_hidden_layers": 4}, layer_types=hybrid, head_dim=16,
                                           num_local_experts=4, num_experts_per_tok=2, block_size=8),
        # Mamba layers, and every few a hybrid layer whose shared attention block's weights are tied
        # across them (replicated: shard_engine.units.tied_across_units)
        "zamba2": lambda: T.Zamba2Config(**{**common, "num_hidden_layers": 6}, use_mamba_kernels=False,
                                         num_mem_blocks=2,
                                         layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"]),
        # Griffin: RG-LRU recurrent blocks (a short convolution and a gated linear recurrence, their
        # state in module attributes: server.engine.state._StateInAttributes) beside local attention
        # with half-dimension rope; soft-capped logits
        "recurrent_gemma": lambda: T.RecurrentGemmaConfig(**{**common, "num_hidden_layers": 4},
                                                          attention_window_size=WINDOW, lru_width=64,
                                                          conv1d_width=4, logits_soft_cap=30.0),
        # ZAYA: compressed convolutional attention (queries and keys through a short convolution, half of
        # each value head a token late: a convolution and a recurrent state in every attention layer),
        # full and sliding-window layers, experts routed through the previous layer's router state
        "zaya": lambda: T.ZayaConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
                                     layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
                                     num_experts=4, moe_intermediate_size=32, router_hidden_size=32),
        # xLSTM: mLSTM layers only (a matrix memory, normaliser and stabiliser a head, passed as an
        # argument: server.engine.state_adapters), its prompts in chunks of 8 (and a shorter rest)
        # (keys as wide as values: transformers' own cache holds a square matrix memory, so its generate,
        # the reference, fails for xLSTM-7B's half-width keys; the engine sizes states by the layer's own)
        "xlstm": lambda: T.xLSTMConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_heads=4,
                                       qk_dim_factor=1.0, chunk_size=8, bos_token_id=0, eos_token_id=0,
                                       pad_token_id=0),
        # RWKV-4: time mixing (a recurrence of numerator, denominator and running maximum a channel) and channel
        # mixing, each with the previous token's input: five states a layer, passed through the model as a list;
        # its eval mode's rescaling every 2 layers (the weights divided, the hidden state halved)
        "rwkv": lambda: T.RwkvConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, rescale_every=2,
                                     bos_token_id=0, eos_token_id=0),
        # (transformers builds it from two hybrid layers up, so 12 layers)
        "zamba": lambda: T.ZambaConfig(**{**common, "num_hidden_layers": 12, "num_key_value_heads": 4}),
        "falcon_40b": lambda: T.FalconConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                             bos_token_id=0, eos_token_id=0, pad_token_id=0),
    }
    refused = {
        "qwen4_exp": lambda: T.Qwen4ExpTextConfig(**{**common, "num_hidden_layers": 4}),
        "t5": lambda: T.T5Config(vocab_size=vocab, d_model=64),
        "gemma3_dynamic_rope_per_layer_type": lambda: T.Gemma3TextConfig(**common, head_dim=16, rope_parameters={
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }
    return (served.get(family) or refused[family])()


STATEFUL = ["lfm2", "lfm2_moe", "lfm3", "qwen3_next", "olmo_hybrid", "mamba2", "bamba", "granitemoehybrid", "nemotron_h",
            "falcon_h1", "mamba", "falcon_mamba", "jamba", "qwen3_5", "qwen3_5_moe", "kimi_linear", "bailing_hybrid",
            "lara_mini", "minimax", "zamba", "zamba2", "recurrent_gemma", "zaya", "xlstm", "rwkv"]
"""The hybrid and state-space families (server.engine.state)."""
SERVED = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "starcoder2", "olmo2", "granite",
          "cohere", "gpt_neox", "gpt2", "gpt_oss", "qwen3_moe", "mixtral", "llama_dynamic_rope", "phi3_longrope",
          "deepseek_v3", "deepseek_v2", "bloom", "mpt", "falcon", "falcon_40b", "falcon_rw", *STATEFUL]
TIED_ACROSS_UNITS = {"zamba2": 0.7}
"""Families with weights tied across FSDP units, which every rank reads whole (replicated:
``shard_engine.units.tied_across_units``): the share of the checkpoint's bytes a rank reads at most
(the tiny Zamba2's two shared blocks are a tenth of it; Zamba's one block a smaller part)."""
IMAGE_TEXT_LAYOUT = {"qwen3_5_moe"}
"""Families whose checkpoints are written as their image-text model writes them (``model.language_model.*``
beside ``model.visual.*``), and whose reference is that model's ``generate`` (the loader builds it
image-text too: ``loaders.skeleton.builds_image_text``)."""
REFUSED = {
    "qwen4_exp": "indexed_attention",
    "t5": "encoder-decoder",
    "gemma3_dynamic_rope_per_layer_type": "rope_type 'dynamic' for one layer type of several",
}


@pytest.mark.parametrize("family", SERVED)
def test_served_family_passes_the_capability_check(family):
    from server.engine.capability import check_servable

    check_servable(_config(family))


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_family_is_refused_with_its_reason(family):
    from server.engine.capability import UnsupportedModelError, check_servable

    with pytest.raises(UnsupportedModelError, match=REFUSED[family]):
        check_servable(_config(family))


REFERENCE_ATTENTION = {"falcon_rw": "sdpa"}
"""transformers' attention implementation each family's reference runs (eager where not listed):
Falcon's eager path adds its ALiBi bias twice (once to the scores, once more through its mask); its
SDPA path adds it once, as Falcon-RW's own modelling code does."""


def _reference_attention(family: str) -> str:
    return REFERENCE_ATTENTION.get(family, "eager")


def _reference_tokens(model, prompts, new_tokens):
    """``new_tokens`` greedy tokens of each prompt, EOS a token like any other (the engine's side has
    no EOS here: min_new_tokens would forbid it instead, and a model whose likeliest token is EOS
    would differ), each prompt generated alone by a fresh copy of ``model``: transformers'
    dynamic-NTK rope keeps the frequencies of the longest sequence it has seen until a short one
    resets them, so a shared model's output for a prompt would depend on the prompts before it
    (server.engine.rope)."""
    import copy

    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = copy.deepcopy(model).generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None,
                                                      max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert generated.shape[1] == len(prompt) + new_tokens
        out.append(generated[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("family", SERVED)
def test_engine_matches_generate(family):
    """Two prompts longer than any window, chunked (16 tokens a step) and decoded together."""
    from transformers import AutoModelForCausalLM

    from tests.test_engine import Harness

    torch.manual_seed(0)
    config = _config(family)
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=_reference_attention(family)).eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.get_text_config().vocab_size, (n,), generator=gen).tolist() for n in (21, 34)]
    expected = _reference_tokens(reference, prompts, 8)
    harness = Harness(model, blocks=64, block_size=4, prefill=16)
    harness.scheduler.eos_token_ids = set()
    outs = [harness.submit(p, 8) for p in prompts]
    harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
    assert [o["error"] for o in outs] == [None, None]
    assert [o["tokens"] for o in outs] == expected


def _sharp(model, projections=("q_proj", "k_proj", "qkv_proj"), factor=12.0):
    """``model`` with its query and key projections scaled up: a random model's attention is nearly
    uniform, so its tokens hardly depend on the rope; sharpened, they do."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f"{proj}." in name for proj in projections):
                p.mul_(factor)
    return model


def _zero_slopes(monkeypatch, model):
    import server.engine.adapters as adapters

    slopes = adapters._slopes
    monkeypatch.setattr(adapters, "_slopes", lambda module, make: slopes(module, make) * 0)
    for module in model.modules():
        module.__dict__.pop("_hsdp_alibi_slopes", None)


def _no_rope(monkeypatch, model):
    import transformers.models.falcon.modeling_falcon as falcon

    monkeypatch.setattr(falcon, "apply_rotary_pos_emb", lambda q, k, cos, sin: (q, k))


def test_mla_chunk_form_follows_the_arithmetic():
    """A prompt chunk of a latent-attention layer is expanded where that costs fewer multiply-adds
    (server.engine.mla.Absorbed.expands): at DeepSeek-V3's dims a chunk that is its whole context,
    or a long chunk over a longer context, is; a decode or a few queries over a long context are not."""
    from types import SimpleNamespace

    from server.engine.mla import Absorbed

    v3 = SimpleNamespace(num_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    form = Absorbed(v3)
    assert form.expands(512, 512) and form.expands(512, 4096) and form.expands(2048, 2048)
    assert not form.expands(1, 4096) and not form.expands(16, 4096)
    narrow = Absorbed(SimpleNamespace(**{**vars(v3), "kv_lora_rank": 64}))  # 2 x rank < nope + v: never
    assert not narrow.expands(512, 512)


@pytest.mark.parametrize("gqa", [False, True])
def test_cpu_attention_with_values_narrower_than_keys_equals_torchs(gqa):
    """kernels.sdpa widens values narrower than their keys with zeros on CPU (torch's flash kernel
    takes one head dim) and cuts the output back: equal to torch's own result for those shapes."""
    import torch.nn.functional as F

    from server.engine.kernels import sdpa

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 24, 160, generator=gen)
    k = torch.randn(1, 1 if gqa else 8, 40, 160, generator=gen)
    v = k[..., :128] if gqa else torch.randn(1, 8, 40, 96, generator=gen)
    mask = torch.ones(24, 40, dtype=torch.bool).tril(16)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1, enable_gqa=gqa)
    got = sdpa(q, k, v, mask, 0.1, enable_gqa=gqa)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_heads_expanded_for_a_masked_chunk_equal_enable_gqa():
    """What kernels.sdpa does on CUDA for a masked prompt chunk of grouped heads (no fused kernel takes
    a mask with enable_gqa): the keys and values repeated to the query heads give enable_gqa's
    result, widened values too; on CPU it never expands."""
    from server.engine.kernels import expands_heads, sdpa

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 24, 64, generator=gen)
    k, v = torch.randn(2, 2, 40, 64, generator=gen), torch.randn(2, 2, 40, 48, generator=gen)
    mask = torch.ones(24, 40, dtype=torch.bool).tril(16)
    want = sdpa(q, k, v, mask, 0.125, enable_gqa=True, expand_heads=False)
    got = sdpa(q, k, v, mask, 0.125, enable_gqa=True, expand_heads=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not expands_heads(q, k, mask, True)  # a CPU tensor


@pytest.mark.parametrize("heads, head_dim", [(16, 16), (32, 64), (71, 64)])  # 71: Falcon-RW-7B's
def test_falcon_rw_bias_is_the_models_own(heads, head_dim):
    """The engine's ALiBi bias for Falcon-RW's bfloat16 slopes equals, bit for bit, the bias the
    model adds to its scaled scores (its ``build_alibi_tensor`` divided by sqrt(head_dim)) at every
    position up to 4096; computed without the model's bf16 rounding it would not."""
    import transformers.models.falcon.modeling_falcon as falcon

    from server.engine.kernels import alibi_bias

    length = 4096
    model_bias = falcon.build_alibi_tensor(torch.ones(1, length, dtype=torch.long), heads, torch.float32)
    model_bias = model_bias.view(heads, length) / head_dim ** 0.5
    slopes = falcon.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.bfloat16)[:, 0, 1]
    positions = torch.arange(length)
    bias = alibi_bias(slopes, positions, None, (heads, 1), torch.float32, head_dim ** -0.5)
    assert torch.equal(bias, model_bias)
    unrounded = alibi_bias(slopes.float(), positions, None, (heads, 1), torch.float32, 1.0) * head_dim ** -0.5
    assert not torch.equal(unrounded, model_bias)


@pytest.mark.parametrize("family, without", [("bloom", _zero_slopes), ("mpt", _zero_slopes), ("falcon", _no_rope),
                                             ("falcon_40b", _no_rope), ("falcon_rw", _zero_slopes)])
def test_adapted_attention_is_each_sequences_own(family, without, monkeypatch):
    """Bloom's, MPT's and Falcon-RW's ALiBi and Falcon's rope through their adapters (server.engine.adapters):
    prompts of several lengths chunked (8 tokens a step) and packed together, one preempted and
    recomputed (a small pool), a prefix hit; greedy tokens equal transformers' eager generate of
    each prompt alone. The model's attention projections are scaled up so that its tokens depend
    on the attention: with the slopes zeroed, or Falcon's rope skipped, the tokens differ."""
    from transformers import AutoModelForCausalLM

    from tests.test_engine import Harness

    torch.manual_seed(0)
    config = _config(family)
    model = _sharp(AutoModelForCausalLM.from_config(config), ("query_key_value", "dense", "Wqkv", "out_proj"),
                   8.0).eval()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=_reference_attention(family)).eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 13, 40)]
    prompts.append(prompts[1] + prompts[2])  # starts with a prompt computed before it: a prefix hit
    expected = _reference_tokens(reference, prompts, 12)

    def served(blocks: int):
        harness = Harness(model, blocks=blocks, block_size=4, prefill=8)
        harness.scheduler.eos_token_ids = set()
        outs = [harness.submit(p, 12) for p in prompts]
        harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
        assert [o["error"] for o in outs] == [None] * len(prompts)
        return [o["tokens"] for o in outs], harness.scheduler.preemptions, harness.scheduler.pools[0].hits

    tokens, _, hits = served(64)
    assert tokens == expected and hits > 0
    tokens, preemptions, _ = served(24)
    assert preemptions > 0 and tokens == expected
    without(monkeypatch, model)
    assert served(64)[0] != expected  # the test can tell


@pytest.mark.parametrize("family", STATEFUL)
def test_recurrent_state_is_each_sequences_own(family, monkeypatch):
    """A hybrid's per-sequence state (server.engine.state): prompts of several lengths chunked
    (8 tokens a step: the state carried across chunks) and packed together with decodes, one
    preempted and recomputed from its prompt (a small pool), 1-token prompts; greedy tokens equal
    transformers' eager generate of each prompt alone. With every sequence given the same slot
    (states shared), the tokens differ."""
    from transformers import AutoModelForCausalLM

    from server.engine.state import StatePool, bytes_per_sequence, state_shapes
    from tests.test_engine import Harness

    torch.manual_seed(0)
    config = _config(family)
    # the short convolutions' projections scaled up: a random model's tokens then depend on its states
    model = _sharp(AutoModelForCausalLM.from_config(config),
                   ("in_proj", "out_proj", "conv", "conv1d", "conv_1d", "linear_x", "linear_out"), 4.0).eval()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.get_text_config().vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 13, 40, 1, 21)]
    expected = _reference_tokens(reference, prompts, 12)

    def served(blocks: int):
        harness = Harness(model, blocks=blocks, block_size=4, prefill=8, max_running=8)
        harness.scheduler.eos_token_ids = set()
        outs = [harness.submit(p, 12) for p in prompts]
        harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
        assert [o["error"] for o in outs] == [None] * len(prompts)
        pool = harness.engines[0].states
        # a slot for each sequence the rank may run, each of the states the model's code writes (the probe's)
        assert pool is not None and pool.capacity == 8
        assert pool.nbytes == 8 * bytes_per_sequence(state_shapes(model)) > 0
        return [o["tokens"] for o in outs], harness.scheduler.preemptions

    tokens, _ = served(64)
    assert tokens == expected
    tokens, preemptions = served(20)
    assert preemptions > 0 and tokens == expected
    monkeypatch.setattr(StatePool, "add", lambda self, seq_id: self.slot_of.setdefault(seq_id, 0))
    assert served(64)[0] != expected  # the test can tell


def test_xlstm_with_half_width_keys_equals_its_own_forward():
    """xLSTM-7B's shape (keys half as wide as values): transformers' generate fails on it (its cache
    allocates a square matrix memory), so the reference is the model's own forward over the whole
    sequence, without a cache, a token at a time. The engine sizes each state by what the layer
    writes (the probe): chunked prompts (8 tokens a step), one sequence preempted and recomputed."""
    import transformers as T

    from tests.test_engine import Harness

    torch.manual_seed(0)
    config = T.xLSTMConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_heads=4, qk_dim_factor=0.5,
                           chunk_size=8, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (9, 30, 13, 40, 1, 21)]
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(12):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        expected.append(ids[len(prompt):])
    harness = Harness(model, blocks=20, block_size=4, prefill=8, max_running=8)
    harness.scheduler.eos_token_ids = set()
    outs = [harness.submit(p, 12) for p in prompts]
    harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
    assert [o["error"] for o in outs] == [None] * len(prompts)
    assert harness.scheduler.preemptions > 0
    assert [o["tokens"] for o in outs] == expected


@pytest.mark.parametrize("family, small_pool", [("llama_dynamic_rope", 26), ("phi3_longrope", 28)])
def test_length_dependent_rope_is_each_sequences_own(family, small_pool):
    """Dynamic NTK and longrope take each sequence's frequencies from its own length, as generate does
    for the sequence alone: prompts below and past the switch, one crossing it while it decodes
    (Phi-3's generate then recomputes it whole with the long factors, and so does the engine),
    chunked (8 tokens a step) and packed together, one preempted and recomputed (``small_pool``
    blocks). Without the per-sequence rope (frequencies from the row's longest position), or
    without Phi-3's recompute, the tokens differ."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    import server.engine.rank as rank_module
    from tests.test_engine import Harness

    torch.manual_seed(0)
    config = _config(family)
    model = _sharp(AutoModelForCausalLM.from_config(config)).eval()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 13, 40)]
    expected = _reference_tokens(reference, prompts, 12)

    def served(per_sequence: bool, blocks: int, recompute: bool = True):
        install = rank_module.install_rope
        rank_module.install_rope = install if per_sequence else (lambda m: None)
        try:
            harness = Harness(model, blocks=blocks, block_size=4, prefill=8)
        finally:
            rank_module.install_rope = install
        if not recompute:
            harness.scheduler.rope = harness.engines[0]._rope = dataclasses.replace(harness.scheduler.rope,
                                                                                  recompute=False)
        harness.scheduler.eos_token_ids = set()
        outs = [harness.submit(p, 12) for p in prompts]
        harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
        assert [o["error"] for o in outs] == [None] * len(prompts)
        return [o["tokens"] for o in outs], harness.scheduler.preemptions

    assert served(True, 64)[0] == expected
    tokens, preemptions = served(True, small_pool)
    assert preemptions > 0 and tokens == expected
    assert served(False, 64)[0] != expected  # the test can tell
    if family == "phi3_longrope":
        assert served(True, 64, recompute=False)[0] != expected
    # prefix caching: a prompt past the switch never takes blocks computed below it (other
    # frequencies), and takes those computed as it would compute them: the same prompt's; and with
    # Phi-3's recompute, the 12 tokens the short prompt computed again with the long factors
    short, long = prompts[2], prompts[2] + prompts[1]  # 13 tokens, then 43 starting with them
    [short_expected, long_expected] = _reference_tokens(reference, [short, long], 12)
    harness = Harness(model, blocks=64, block_size=4, prefill=8)
    harness.scheduler.eos_token_ids = set()
    pool = harness.scheduler.pools[0]
    recomputed = 12 if family == "phi3_longrope" else 0
    for prompt, want, hits in ((short, short_expected, 0), (long, long_expected, recomputed),
                               (long, long_expected, 40)):
        before = pool.hits
        out = harness.submit(prompt, 12)
        harness.run(lambda: out["finish"] is not None or out["error"])
        assert out["tokens"] == want, (family, len(prompt), pool.hits - before)
        assert pool.hits - before == hits, (family, len(prompt), pool.hits - before)


def _write(family: str, path) -> str:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tests.checkpoints import tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if family in IMAGE_TEXT_LAYOUT else AutoModelForCausalLM
    model = auto.from_config(_config(family, vocab=len(tok)))
    model.save_pretrained(path, max_shard_size="200KB")
    tok.save_pretrained(path)
    return str(path)


PROMPTS = ["Once upon a time there was a server that never hung, and it served every request",
           "The quick brown fox jumps over the lazy dog while the ranks gather their shards"]
NEW_TOKENS = 10
THROUGH_THE_SERVER = ["llama", "gemma2", "qwen3_moe", "deepseek_v3", "bloom", "falcon_rw", "lfm2", "qwen3_next", "jamba",
                      "xlstm", "rwkv"]
NO_KEYS_OR_VALUES = {
    "xlstm": 2 * 4 * (16 * 16 + 16 + 1) * 4,  # 2 layers x 4 heads x (a 16 x 16 memory, a normaliser, a stabiliser)
    "rwkv": 4 * 5 * 64 * 4,  # 4 layers x 5 states of 64 (two previous inputs, numerator, denominator, maximum)
}
"""Families of the server test whose layers keep no keys or values: their state bytes a sequence (float32)."""
"""The families also served through HTTP: plain attention; soft-capping with alternating windows;
experts; multi-head latent attention (its latents cached: /info says what a token costs); ALiBi
through an adapter (server.engine.adapters), Bloom's and Falcon-RW's bf16-rounded bias; a hybrid's per-sequence state (server.engine.state:
only its attention layers cache keys and values) (Qwen3.5-MoE's through the server: tests/test_vision_qwen.py). The server adds nothing per family (the same load, residency and engine as the 2-rank
test below), so the others are checked below the HTTP layer, in one process group."""


def _expected(path, family: str) -> list[list[int]]:
    """Greedy generate of the unsharded model (eager attention but where REFERENCE_ATTENTION says;
    the image-text model for IMAGE_TEXT_LAYOUT) for PROMPTS, stopping at EOS 0."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import tokenizer

    import copy

    from transformers import AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if family in IMAGE_TEXT_LAYOUT else AutoModelForCausalLM
    reference = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=_reference_attention(family)).eval()
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer()(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] > WINDOW
        with torch.no_grad():  # a fresh copy for each prompt: see _reference_tokens
            out = copy.deepcopy(reference).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, eos_token_id=0, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    return expected


def _checkpoint_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _serve_each_family(rank, world_size, paths):
    """Each checkpoint as the server holds it on CPU ranks (streamed and sharded over both ranks,
    every unit resident in one shared copy, each rank a step group of its own), both prompts
    decoded together by this rank's engine."""
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig, set_resident_units
    from tests.checkpoints import tokenizer
    from tests.test_engine import Harness

    tok = tokenizer()
    out = {}
    for family, path in paths.items():
        loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32)
        residency = set_resident_units(loaded.model, -1, shared=True)
        harness = Harness(loaded.model, blocks=64, block_size=4, prefill=16)
        harness.scheduler.eos_token_ids = {0}
        outs = [harness.submit(tok(p).input_ids, NEW_TOKENS) for p in PROMPTS]
        harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
        out[family] = {"tokens": [o["tokens"] for o in outs], "errors": [o["error"] for o in outs],
                       "read": loaded.stats.bytes_read, "shared": residency.shared_bytes > 0}
        set_resident_units(loaded.model, 0)  # the shared copy goes (collective)
    return out


def test_every_family_sharded_over_two_ranks_matches_generate(tmp_path):
    """Every served family but Cohere (the same code path as Llama), from a checkpoint
    save_pretrained wrote (the Hub's layout, per-expert tensors included): each rank reads about
    its share of the bytes, and greedy decoding on the sharded model equals generate's."""
    from tests.dist import run_ranks, values

    families = [f for f in SERVED if f != "cohere"]
    paths = {family: _write(family, tmp_path / family) for family in families}
    expected = {family: _expected(path, family) for family, path in paths.items()}
    results = values(run_ranks(_serve_each_family, 2, tmp_path, paths, timeout=400))
    for rank, by_family in enumerate(results):
        for family in families:
            got = by_family[family]
            assert got["errors"] == [None, None], (rank, family, got)
            assert got["tokens"] == expected[family], (rank, family)
            assert got["shared"], (rank, family)
            share = TIED_ACROSS_UNITS.get(family, 0.6)
            assert 0 < got["read"] < share * _checkpoint_bytes(paths[family]), (rank, family, got["read"])


@pytest.mark.slow
@pytest.mark.parametrize("family", THROUGH_THE_SERVER)
def test_server_on_two_ranks_matches_generate(family, tmp_path):
    """The real server, weights sharded over 2 ranks, two requests at once, prompts past the window."""
    import concurrent.futures

    path = _write(family, tmp_path / family)
    expected = _expected(path, family)
    with ServerProcess(path, nproc=2, extra_args=("--dtype", "float32"), log_path=tmp_path / "server.log") as server:
        def generate(prompt):
            r = server.client.post("/generate", json={"inputs": prompt,
                                                      "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}})
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(generate, PROMPTS))
        info = server.client.get("/info").json()
        reads = [r["load_bytes_read"] for r in info["ranks"]]
    assert got == expected
    config = _config(family).get_text_config()
    if family == "deepseek_v3":  # the latent and the rope key, float32: (16 + 8) x 4 bytes a token a layer
        assert info["kv_cache"]["layout"] == "latent" and info["kv_cache"]["bytes_per_token_per_layer"] == 96
    elif family == "lfm2":  # its 2 attention layers of 4 cache keys and values; the conv layers keep a state
        assert info["kv_cache"]["layers"] == 2 and info["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
        assert info["kv_cache"]["state_bytes_per_sequence"] == 2 * 64 * 3 * 4  # 2 conv layers x [64, 3 taps]
    elif family in NO_KEYS_OR_VALUES:
        assert info["kv_cache"]["layers"] == 0
        assert info["kv_cache"]["state_bytes_per_sequence"] == NO_KEYS_OR_VALUES[family]
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # Bloom: all heads
        assert info["kv_cache"]["bytes_per_token_per_layer"] == 2 * kv_heads * head_dim * 4
    checkpoint = _checkpoint_bytes(path)
    assert all(0 < read < 0.6 * checkpoint for read in reads), (reads, checkpoint)  # each rank its share


def _load_and_compare(rank, world_size, path):
    from transformers import AutoModelForCausalLM

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 11, 4]]) + rank
    with torch.no_grad():
        exact = torch.equal(loaded.model(input_ids=ids).logits, reference(input_ids=ids).logits)
    stats = loaded.stats
    return {"exact": exact, "bytes_read": stats.bytes_read, "checkpoint_bytes": stats.checkpoint_bytes,
            "converted": stats.tensors_converted, "whole": stats.converted_whole_bytes}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_moe_checkpoint_in_hub_layout_loads_with_a_share_of_the_bytes(family, tmp_path):
    """save_pretrained writes one tensor per expert (the Hub's layout); the model fuses them. Each
    of 2 ranks reads only its experts' tensors: about half the checkpoint, and the same logits."""
    import transformers as T
    from transformers import AutoModelForCausalLM

    from tests.dist import run_ranks, values

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    config = {"mixtral": lambda: T.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2),
              "qwen3_moe": lambda: T.Qwen3MoeConfig(**common, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32),
              "olmoe": lambda: T.OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2),
              "qwen2_moe": lambda: T.Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=32),
              }[family]()
    torch.manual_seed(0)
    path = str(tmp_path / family)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="100KB")
    from safetensors import safe_open

    keys = set()
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                keys |= set(f.keys())
    assert any(".experts.0." in k for k in keys)  # per-expert tensors, not the model's fused ones
    results = values(run_ranks(_load_and_compare, 2, tmp_path, path, timeout=240))
    for r in results:
        assert r["exact"] and r["converted"] > 0 and r["whole"] == 0
        assert abs(r["bytes_read"] / r["checkpoint_bytes"] - 0.5) < 0.02, r


def test_refused_before_anything_is_read(tmp_path):
    """A hybrid checkpoint still refused (its config alone: there are no weights to read) fails in one line."""
    path = tmp_path / "qwen4_exp"
    _config("qwen4_exp").save_pretrained(path)
    proc = subprocess.run([sys.executable, "-m", "server", "--model", str(path), "--device", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hsdp-serve: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("hsdp-serve: Qwen4ExpForCausalLM is not served: layer types ['indexed_attention'")


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_soft_capping_and_sinks_in_query_blocks_stay_exact(family, monkeypatch):
    """Chunks without SDPA take their queries a few at a time (bounded float32 scores)."""
    import server.engine.attention as attention

    monkeypatch.setattr(attention, "EXPLICIT_SCORES_BYTES", 4 * 4 * 40 * 3)  # ~3 queries per block here
    test_engine_matches_generate(family)


def test_converted_tensors_the_model_skips_are_skipped(tmp_path):
    """GLM-4.5's checkpoints carry an extra prediction layer (model.layers.46, per-expert tensors)
    that from_pretrained skips by the model's own pattern; routed to a conversion, it is skipped
    too, and everything else still loads exactly."""
    import transformers as T
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.dist import run_ranks, values

    config = T.Glm4MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
                             num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                             max_position_embeddings=512)
    torch.manual_seed(0)
    path = str(tmp_path / "glm4_moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    extra = {k.replace("model.layers.1.", "model.layers.46."): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.1.mlp.experts.")}
    assert extra
    save_file({**tensors, **extra}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    results = values(run_ranks(_load_and_compare, 2, tmp_path, path, timeout=240))
    assert all(r["exact"] and r["converted"] > 0 for r in results)


@pytest.mark.slow
def test_hybrid_answers_32_concurrent_requests_exactly_under_a_small_kv_budget(tmp_path):
    """LFM2 (short convolutions beside attention) through the real server on 2 ranks, 32 requests at
    once under a budget (``--kv-cache-memory``) of the state slots of the 16 sequences a rank runs at
    most and 4 KV blocks (a few sequences at a time: the rest wait; preempted sequences and their
    states are recomputed in test_recurrent_state_is_each_sequences_own): every one answered with
    transformers' greedy tokens; /info and /metrics (``state_pool``) report the states' arithmetic,
    2 layers x [64 channels, 3 taps] float32 a sequence, and the budget holds both."""
    import concurrent.futures

    from transformers import AutoModelForCausalLM

    from tests.checkpoints import tokenizer

    path = _write("lfm2", tmp_path / "lfm2")
    prompts = [f"request {i}: " + PROMPTS[i % 2][: 20 + 3 * (i % 7)] for i in range(32)]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    expected = []
    for prompt in prompts:
        ids = tokenizer()(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, eos_token_id=0, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    # each rank steps alone (every unit resident: 2 step groups) and runs at most 16 of the 32 sequences: 16 state
    # slots of 2 conv layers x [64 channels, 3 taps] x 4 bytes = 24 KiB, then 4 KV blocks of 16 tokens at 512 bytes a
    # token (2 attention layers x 2 kv heads x 16 x (key + value) x 4) = 32 KiB: 56 KiB a rank in all
    extra = ("--dtype", "float32", "--kv-cache-memory", "56KiB", "--max-batch-prefill-tokens", "16",
             "--max-concurrent-requests", "32")
    with ServerProcess(path, nproc=2, extra_args=extra, log_path=tmp_path / "server.log") as server:
        def generate(prompt):
            r = server.client.post("/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": NEW_TOKENS, "details": True}}, timeout=300)
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            got = list(pool.map(generate, prompts))
        info = server.client.get("/info").json()
        metrics = server.client.get("/metrics").text
    assert got == expected
    per_sequence = 2 * 64 * 3 * 4
    kv = info["kv_cache"]
    assert kv["bytes_per_token"] == 512 and kv["state_bytes_per_sequence"] == per_sequence
    assert kv["state_slots_per_rank"] == 16
    assert [r["kv_blocks"]["total"] for r in info["ranks"]] == [4, 4]
    pools = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith("hsdp_rank_memory_bytes") and 'kind="state_pool"' in line]
    assert pools == [16 * per_sequence] * 2, pools
    assert 16 * per_sequence + 4 * 16 * 512 <= 56 * 1024


def test_a_checkpoint_in_the_models_own_names_is_planned_without_conversion_tables(tmp_path, monkeypatch):
    """Every tensor under a model tensor's name and shape: nothing to convert, and transformers'
    conversion tables (about a thousand patterns compiled at their first use) are not consulted;
    the Hub's per-expert layout still goes through them and converts."""
    import transformers.conversion_mapping as mapping
    from transformers import AutoModelForCausalLM

    from loaders.checkpoint import list_checkpoint_files, load_config
    from loaders.conversion import plan_conversions
    from loaders.skeleton import build_skeleton, describe_layout

    llama, moe = _write("llama", tmp_path / "llama"), _write("qwen3_moe", tmp_path / "qwen3_moe")
    consulted = []
    real = mapping.get_model_conversion_mapping
    monkeypatch.setattr(mapping, "get_model_conversion_mapping",
                        lambda model, *a, **k: consulted.append(type(model).__name__) or real(model, *a, **k))
    plans = {}
    for name, path in (("llama", llama), ("qwen3_moe", moe)):
        files = list_checkpoint_files(path)
        model = build_skeleton(load_config(path), AutoModelForCausalLM, torch.float32)
        plans[name] = plan_conversions(model, files.tensors, describe_layout(model).expected)
    assert not plans["llama"].targets and all(k == v for k, v in plans["llama"].renamed.items())
    assert plans["qwen3_moe"].targets  # per-expert tensors fused as from_pretrained fuses them
    assert consulted == ["Qwen3MoeForCausalLM"]


def test_local_reads_go_ahead_only_where_the_host_has_idle_cores(monkeypatch):
    """``--load-concurrency`` reads of a local file ahead of the tensor being sharded where the host
    has more cores than local ranks (measured faster there), none where the ranks fill them."""
    import os as _os

    from loaders.streaming import local_read_ahead

    monkeypatch.setattr(_os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_read_ahead(8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert local_read_ahead(8) == 0
    monkeypatch.setattr(_os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert local_read_ahead(4) == 4
