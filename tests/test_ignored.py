"""Ignored parameters (fp32 islands, packed ints, 0-dim) stay whole, in their dtype, on the target device."""

import os

import torch
from safetensors.torch import load_file

from tests.checkpoints import make_config, tokenizer
from tests.dist import run_ranks, values

ISLAND = "model.layers.1.mlp.island"


def _write_island_checkpoint(path):
    from tests.island_model import IslandLlama, randomize_island

    torch.manual_seed(0)
    model = IslandLlama._from_config(make_config("llama", len(tokenizer())), dtype=torch.bfloat16)
    randomize_island(model)
    model.save_pretrained(path, max_shard_size="40KB")
    tokenizer().save_pretrained(path)
    return str(path)


def _reference_logits(path, ids):
    from tests.island_model import IslandLlama

    model = IslandLlama._from_config(make_config("llama", len(tokenizer())), dtype=torch.bfloat16)
    state = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    model.load_state_dict(state, strict=False)  # tied/absent keys aside, copy_ keeps each param's dtype
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(ids).logits


def _describe(model):
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        out[name] = (isinstance(p, DTensor), p.dtype, str(p.device), tuple(p.shape))
    return out


def _load_island(rank, world_size, path, ids):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig
    from tests.island_model import IslandLlama

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), model_class=IslandLlama, read_mode="sliced")
    with torch.no_grad():
        logits = loaded.model(ids).logits
    return _describe(loaded.model), logits


def _apply_to_loaded(rank, world_size, path, ids):
    from shard_engine import HSDPInferenceConfig, apply_hsdp_to_model
    from tests.island_model import IslandLlama

    model = IslandLlama.from_pretrained(path, dtype=torch.bfloat16)
    # from_pretrained casts floating islands to the requested dtype; restore the fp32 island.
    island = model.get_submodule(ISLAND)
    state = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    island.weight.data = state[f"{ISLAND}.weight"].clone()
    island.scale.data = state[f"{ISLAND}.scale"].clone()
    apply_hsdp_to_model(model, HSDPInferenceConfig(), target_device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(ids).logits
    return _describe(model), logits


def _check(described):
    for name, (is_dtensor, dtype, device, shape) in described.items():
        if name.startswith(ISLAND):
            assert not is_dtensor, f"{name} must stay a plain tensor"
            assert device == "cpu"
        else:
            assert is_dtensor and dtype == torch.bfloat16, (name, is_dtensor, dtype)
    assert described[f"{ISLAND}.weight"][1] == torch.float32
    assert described[f"{ISLAND}.scale"][1:] == (torch.float32, "cpu", ())
    assert described[f"{ISLAND}.packed"][1] == torch.int8


def test_islands_stay_whole_and_model_runs(tmp_path):
    path = _write_island_checkpoint(tmp_path / "island")
    ids = tokenizer()("The quick brown fox jumps", return_tensors="pt").input_ids
    reference = _reference_logits(path, ids)
    for fn in (_load_island, _apply_to_loaded):
        for described, logits in values(run_ranks(fn, 2, tmp_path, path, ids, timeout=180)):
            _check(described)
            torch.testing.assert_close(logits, reference, rtol=0, atol=0)


def _root_embedding(rank, world_size, path, ids):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig, hsdp_root_unsharded

    model = load_hsdp_model(path, HSDPInferenceConfig()).model
    try:
        model.get_input_embeddings()(ids)
        outside = None
    except RuntimeError as e:  # aten.embedding: mixed Tensor and DTensor
        outside = str(e)
    with hsdp_root_unsharded(model), torch.no_grad():
        inside = model.get_input_embeddings()(ids)
    return outside, inside


def test_root_unsharded_lets_a_submodule_run_directly(tmp_path, checkpoints):
    """Qwen2's tied embedding is owned by the root: calling it directly needs the root gathered."""
    from transformers import AutoModelForCausalLM

    ids = tokenizer()("hsdp serve", return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"]).get_input_embeddings()(ids)
    for outside, inside in values(run_ranks(_root_embedding, 2, tmp_path, checkpoints["qwen2"], ids)):
        assert outside is not None and "DTensor" in outside
        torch.testing.assert_close(inside, reference, rtol=0, atol=0)
