import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{arch: directory} of small fp32 checkpoints whose layers straddle files."""
    from tests.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {arch: write_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def references(checkpoints):
    """{arch: greedy token ids per prompt} from transformers' own unsharded model."""
    from tests.checkpoints import reference_generate

    return {arch: reference_generate(path) for arch, path in checkpoints.items()}
