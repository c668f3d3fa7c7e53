"""Units are sharded as soon as their last tensor arrives, in whatever order files come."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from tests.dist import run_ranks, values


def _shuffled_copy(src, dst, seed):
    """Link ``src``'s files into ``dst`` with the index's entries (and so its files) reordered."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors.index.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    items = list(index["weight_map"].items())
    random.Random(seed).shuffle(items)
    index["weight_map"] = dict(items)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return [name for name in dict.fromkeys(v for _, v in items)]


def _load_and_gather(rank, world_size, path, read_mode):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), read_mode=read_mode)
    full = {}
    for name, p in loaded.model.named_parameters():
        full[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()  # all-gather on every rank
    return full, loaded.stats.events


def _unit_of(name, units):
    owners = [u for u in units if u and (name == u or name.startswith(u + "."))]
    return max(owners, key=len) if owners else ""


def _in_subtree(owner, unit):
    return not unit or owner == unit or owner.startswith(unit + ".")


@pytest.mark.parametrize("arch,seed", [("llama", 1), ("qwen2", 2)])
def test_shuffled_files_give_identical_weights_and_shard_on_last_tensor(tmp_path, checkpoints, arch, seed):
    path = str(tmp_path / "shuffled")
    _shuffled_copy(checkpoints[arch], path, seed)
    reference = {}
    for name in os.listdir(checkpoints[arch]):
        if name.endswith(".safetensors"):
            reference.update(load_file(os.path.join(checkpoints[arch], name)))

    results = values(run_ranks(_load_and_gather, 2, tmp_path, path, "sliced", timeout=180))
    for full, events in results:
        for name, tensor in reference.items():
            assert torch.equal(full[name], tensor), name
        if "lm_head.weight" not in reference:  # tied: the head is the embedding
            assert torch.equal(full.get("lm_head.weight", full["model.embed_tokens.weight"]),
                               reference["model.embed_tokens.weight"])

        shards = [name for kind, name in events if kind == "shard"]
        assert len(shards) == len(set(shards)), "a unit was sharded twice"
        assert shards[-1] == "", "the root must be sharded last"
        assert len(shards) > 2
        tensors = [(i, name) for i, (kind, name) in enumerate(events) if kind == "tensor"]
        assert sorted(n for _, n in tensors) == sorted(n for n in reference if n in full)
        for unit in shards:
            shard_at = events.index(("shard", unit))
            # A unit completes with its own tensors and those of the units nested in it (the
            # root's subtree is every tensor).
            own = [i for i, name in tensors if _in_subtree(_unit_of(name, shards), unit)]
            last = max(own) if own else -1
            # Nothing but the completion of nested units may come between that last tensor and its shard.
            between = events[last + 1 : shard_at]
            assert all(kind == "shard" for kind, _ in between), (unit, between)
            assert all(i < shard_at for i in own), f"{unit} sharded before all its tensors arrived"


def test_files_are_read_in_index_order(tmp_path, checkpoints):
    path = str(tmp_path / "shuffled")
    file_order = _shuffled_copy(checkpoints["llama"], path, 7)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    _, events = values(run_ranks(_load_and_gather, 1, tmp_path, path, "full", timeout=120))[0]
    seen = [weight_map[name] for kind, name in events if kind == "tensor"]
    assert list(dict.fromkeys(seen)) == file_order
