"""Which modules become FSDP units, which parameters are ignored, and encoders load too."""

import pytest
import torch

from tests.checkpoints import make_config, tokenizer, write_checkpoint
from tests.dist import run_ranks, values


def _skeleton(arch, **overrides):
    from transformers import AutoModelForCausalLM, BertModel

    from loaders.skeleton import build_skeleton

    config = make_config(arch, len(tokenizer()))
    for key, value in overrides.items():
        setattr(config, key, value)
    return build_skeleton(config, BertModel if arch == "bert" else AutoModelForCausalLM, torch.float32)


def _unit_names(model):
    from shard_engine import default_shard_conditions, select_units

    return [name for name, _ in select_units(model, default_shard_conditions(model))]


@pytest.mark.parametrize(
    "arch,expected",
    [
        ("llama", ["lm_head", "model.layers.2", "model.layers.1", "model.layers.0", "model.embed_tokens"]),
        ("qwen2", ["model.layers.2", "model.layers.1", "model.layers.0"]),  # tied: embeddings stay with the root
        ("gpt2", ["transformer.h.2", "transformer.h.1", "transformer.h.0"]),
        ("bert", ["encoder.layer.1", "encoder.layer.0", "embeddings"]),
    ],
)
def test_default_units(arch, expected):
    model = _skeleton(arch)
    assert all(p.is_meta for p in model.parameters())
    assert _unit_names(model) == expected


def test_skeleton_keeps_buffers_and_ties():
    model = _skeleton("qwen2")
    inv_freq = model.model.rotary_emb.inv_freq
    assert not inv_freq.is_meta and torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_homogeneous_layer_list_is_detected_without_no_split_modules():
    from shard_engine import detect_decoder_layer_names

    model = _skeleton("llama")
    model._no_split_modules = None
    assert detect_decoder_layer_names(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_declared_shard_conditions_win():
    from shard_engine import select_units

    model = _skeleton("llama")
    model._hsdp_shard_conditions = [lambda name, m: name.endswith(".mlp")]
    names = [n for n, _ in select_units(model, model._hsdp_shard_conditions)]
    assert names == ["model.layers.2.mlp", "model.layers.1.mlp", "model.layers.0.mlp"]


def test_ignored_parameter_names():
    from shard_engine import find_ignored_param_names
    from tests.island_model import IslandLlama

    model = IslandLlama._from_config(make_config("llama", len(tokenizer())), dtype=torch.bfloat16)
    island = "model.layers.1.mlp.island"
    assert find_ignored_param_names(model) == {f"{island}.weight", f"{island}.scale", f"{island}.packed"}
    model._hsdp_ignored_modules = ["model.norm"]
    assert "model.norm.weight" in find_ignored_param_names(model)


def test_ignored_modules_need_a_target_device():
    from shard_engine import HSDPInferenceConfig, prepare_hsdp_shard_context

    model = _skeleton("llama")
    model._hsdp_ignored_modules = ["model.norm"]
    with pytest.raises(ValueError, match="target_device"):
        prepare_hsdp_shard_context(model, HSDPInferenceConfig())


def _load_bert(rank, world_size, path, ids, read_mode):
    from transformers import BertModel

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), model_class=BertModel, read_mode=read_mode)
    with torch.no_grad():
        return loaded.model(ids).last_hidden_state


@pytest.mark.parametrize("read_mode", ["sliced", "full"])
def test_encoder_model_loads(tmp_path, read_mode):
    from transformers import BertModel

    path = write_checkpoint(tmp_path / "bert", "bert")
    ids = tokenizer()("an encoder loads too", return_tensors="pt").input_ids
    with torch.no_grad():
        reference = BertModel.from_pretrained(path).eval()(ids).last_hidden_state
    for hidden in values(run_ranks(_load_bert, 3, tmp_path, path, ids, read_mode, timeout=180)):
        torch.testing.assert_close(hidden, reference, rtol=0, atol=0)


def test_a_parameter_held_by_two_units_is_found_and_kept_out_of_fsdp():
    """Zamba's hybrid layers each hold a copy of a shared block whose weights are one set: FSDP2
    shards a parameter in one unit only, so such a parameter stays replicated (ignored)."""
    import torch.distributed as dist
    from torch import nn

    from shard_engine import HSDPInferenceConfig, prepare_hsdp_shard_context, select_units, tied_across_units

    class Block(nn.Module):
        def __init__(self, shared: nn.Linear):
            super().__init__()
            self.own, self.shared = nn.Linear(4, 4), nn.Linear(4, 4)
            self.shared.weight = shared.weight  # tied, as transformers ties Zamba's blocks

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            first = nn.Linear(4, 4)
            self.layers = nn.ModuleList([Block(first), Block(first)])
            self.head = nn.Linear(4, 4)

    model = Model()
    conditions = [lambda name, module: name in ("layers.0", "layers.1")]
    model._hsdp_shard_conditions = conditions
    units = select_units(model, conditions)
    assert tied_across_units(model, units) == {"layers.0.shared.weight"}
    assert tied_across_units(model, []) == set()  # all in the root: FSDP2 shards it there once
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        context = prepare_hsdp_shard_context(model, HSDPInferenceConfig(), torch.device("cpu"))
        assert "layers.0.shared.weight" in context.ignored_param_names
        for layer in model.layers:  # each unit sees it as ignored, whichever name it holds it under
            assert context.ignored_params_in(layer) == {model.layers[0].shared.weight}
    finally:
        dist.destroy_process_group()
