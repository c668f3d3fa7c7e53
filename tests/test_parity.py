"""Greedy generation on the sharded model equals transformers' unsharded model, token for token."""

import pytest
import torch

from tests.checkpoints import PROMPTS, generate_ids
from tests.conftest import ARCHS
from tests.dist import run_ranks, values

MESHES = {1: (1, 1), 2: (1, 2), 3: (1, 3), 4: (2, 2)}


def _generate_all(rank, world_size, checkpoints, mesh):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    replicate, shard = mesh
    out = {}
    for arch in ARCHS:
        local = {}
        for mode in ("sliced", "full"):
            loaded = load_hsdp_model(
                checkpoints[arch], HSDPInferenceConfig(replicate_size=replicate, shard_size=shard), read_mode=mode
            )
            out[arch, mode] = [generate_ids(loaded.model, loaded.tokenizer, p, 16) for p in PROMPTS]
            local[mode] = {
                n: (p._local_tensor if isinstance(p, DTensor) else p).detach().clone()
                for n, p in loaded.model.named_parameters()
            }
        # Both read modes must leave bit-identical shards on this rank.
        assert local["sliced"].keys() == local["full"].keys()
        for name, tensor in local["sliced"].items():
            assert torch.equal(tensor, local["full"][name]), f"{arch} {name}: sliced != full"
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_greedy_generate_matches_transformers(tmp_path, checkpoints, references, world_size):
    results = values(
        run_ranks(_generate_all, world_size, tmp_path, checkpoints, MESHES[world_size], timeout=420)
    )
    for rank, out in enumerate(results):
        for arch in ARCHS:
            for mode in ("sliced", "full"):
                assert all(len(ids) == 16 for ids in out[arch, mode])
                assert out[arch, mode] == references[arch], f"rank {rank} {arch} {mode} world {world_size}"
