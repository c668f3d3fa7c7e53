"""Every load error is a named exception, raised on every rank, within a bounded time."""

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dist import run_ranks, values

INDEX = "model.safetensors.index.json"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _index(path):
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)


def _rewrite(path, key, change):
    """Apply ``change(tensors)`` to the file holding ``key``; keep the index in step."""
    index = _index(path)
    fname = index["weight_map"][key]
    tensors = load_file(os.path.join(path, fname))
    change(tensors)
    save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname}
    index["weight_map"].update({k: fname for k in tensors})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f)
    return fname


def make_broken_checkpoints(good, root):
    """{case: (directory, expected error class name, expected file basename, expected tensor)}."""
    cases = {}
    key = "model.layers.1.mlp.down_proj.weight"

    d = _copy(good, root / "missing")
    f = _rewrite(d, key, lambda t: t.pop(key))
    cases["missing_tensor"] = (d, "MissingTensorError", None, key)

    d = _copy(good, root / "unexpected")
    f = _rewrite(d, key, lambda t: t.update({"model.layers.1.mlp.extra.weight": torch.zeros(3)}))
    cases["unexpected_tensor"] = (d, "UnexpectedTensorError", f, "model.layers.1.mlp.extra.weight")

    d = _copy(good, root / "shape")
    f = _rewrite(d, key, lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    cases["shape_mismatch"] = (d, "ShapeMismatchError", f, key)

    d = _copy(good, root / "dtype")
    f = _rewrite(d, key, lambda t: t.update({key: t[key].half()}))
    cases["dtype_mismatch"] = (d, "DTypeMismatchError", f, key)

    d = _copy(good, root / "truncated")
    f = _index(d)["weight_map"][key]
    with open(os.path.join(d, f), "r+b") as fh:
        fh.truncate(os.path.getsize(os.path.join(d, f)) - 100)
    cases["truncated_file"] = (d, "CorruptFileError", f, None)

    d = _copy(good, root / "header")
    with open(os.path.join(d, f), "r+b") as fh:
        fh.seek(8)
        fh.write(b"{not json at all")
    cases["corrupt_header"] = (d, "CorruptFileError", f, None)

    d = _copy(good, root / "noconfig")
    os.remove(os.path.join(d, "config.json"))
    cases["missing_config"] = (d, "MissingConfigError", "config.json", None)

    d = _copy(good, root / "pickle")
    for name in os.listdir(d):
        if name.endswith(".safetensors") or name == INDEX:
            os.remove(os.path.join(d, name))
    open(os.path.join(d, "pytorch_model.bin"), "wb").close()
    cases["pickle_only"] = (d, "CheckpointError", None, None)
    return cases


def _try_loads(rank, world_size, dirs, dtype=None):
    from loaders import CheckpointError, load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    outcomes = {}
    for case, path in dirs.items():
        if isinstance(path, list):  # a different directory per rank
            path = path[rank]
        start = time.monotonic()
        try:
            load_hsdp_model(path, HSDPInferenceConfig(), dtype=dtype)
            outcomes[case] = ("ok", None, None, time.monotonic() - start)
        except CheckpointError as e:
            outcomes[case] = (type(e).__name__, e.path, e.tensor, time.monotonic() - start)
    return outcomes


def test_each_error_is_named_and_raised_on_every_rank(tmp_path, checkpoints):
    cases = make_broken_checkpoints(checkpoints["llama"], tmp_path)
    results = values(run_ranks(_try_loads, 2, tmp_path, {c: v[0] for c, v in cases.items()}, timeout=240))
    for rank, outcomes in enumerate(results):
        for case, (_, cls, fname, tensor) in cases.items():
            got_cls, path, got_tensor, elapsed = outcomes[case]
            assert got_cls == cls, (rank, case, outcomes[case])
            if fname:
                assert path and os.path.basename(path) == fname, (rank, case, path)
            if tensor:
                assert got_tensor == tensor, (rank, case, got_tensor)
            assert elapsed < 30, (rank, case, elapsed)


def test_dtype_argument_casts_instead_of_failing(tmp_path, checkpoints):
    cases = make_broken_checkpoints(checkpoints["llama"], tmp_path)
    results = values(run_ranks(_try_loads, 2, tmp_path, {"dtype": cases["dtype_mismatch"][0]}, torch.float32))
    assert all(r["dtype"][0] == "ok" for r in results)


def test_stale_buffers_of_older_checkpoints_are_skipped(tmp_path, checkpoints):
    """As from_pretrained: a per-layer rotary_emb.inv_freq (no longer saved) is skipped, while
    position_ids, which a Llama never had, is still an unexpected tensor."""
    key = "model.layers.1.mlp.down_proj.weight"
    stale = _copy(checkpoints["llama"], tmp_path / "stale")
    _rewrite(stale, key, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                             for i in range(3)}))
    foreign = _copy(checkpoints["llama"], tmp_path / "foreign")
    _rewrite(foreign, key, lambda t: t.update({"model.embed_tokens.position_ids": torch.arange(8)}))
    results = values(run_ranks(_try_loads, 2, tmp_path, {"stale": stale, "foreign": foreign}, timeout=180))
    for r in results:
        assert r["stale"][0] == "ok"
        assert r["foreign"][:3:2] == ("UnexpectedTensorError", "model.embed_tokens.position_ids")


def test_failure_on_one_rank_reaches_every_rank(tmp_path, checkpoints):
    """One rank's files are bad (early, at the header; late, a missing tensor): both ranks raise."""
    good = checkpoints["llama"]
    cases = make_broken_checkpoints(good, tmp_path)
    dirs = {
        "header_on_rank1": [good, cases["corrupt_header"][0]],
        "missing_on_rank0": [cases["missing_tensor"][0], good],
    }
    results = values(run_ranks(_try_loads, 2, tmp_path, dirs, timeout=180))
    assert [r["header_on_rank1"][0] for r in results] == ["CorruptFileError"] * 2
    assert [r["missing_on_rank0"][0] for r in results] == ["MissingTensorError"] * 2


def _bad_mesh(rank, world_size, path):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    try:
        load_hsdp_model(path, HSDPInferenceConfig(replicate_size=3))
    except ValueError as e:
        return str(e)
    return None


def test_mesh_that_does_not_fit_fails_before_reading(tmp_path):
    # The directory does not exist: a ValueError (not a missing-config error) shows no file was read.
    messages = values(run_ranks(_bad_mesh, 2, tmp_path, str(tmp_path / "nowhere"), timeout=60))
    assert all(m and "replicate_size=3" in m and "world_size=2" in m for m in messages), messages


def test_config_validation():
    from shard_engine import HSDPInferenceConfig

    assert HSDPInferenceConfig(replicate_size=2, shard_size=4).resolve_mesh_shape(8) == (2, 4)
    # the server's auto: per node under torchrun with several nodes, else from the shard size, else 1
    from server.config import ServeConfig

    def mesh(world, local, **flags):
        return ServeConfig(**flags).mesh_config(world, local).resolve_mesh_shape(world)

    assert mesh(8, 4) == (2, 4) and mesh(8, 8) == (1, 8) and mesh(2, 1) == (2, 1)
    assert mesh(8, 4, shard_size=8) == (1, 8) and mesh(8, 4, shard_size=2) == (4, 2)
    assert mesh(8, 4, replicate_size=1) == (1, 8) and mesh(8, 8, replicate_size=2) == (2, 4)
    assert HSDPInferenceConfig(replicate_size=2).resolve_mesh_shape(6) == (2, 3)
    with pytest.raises(ValueError, match="2 x shard_size=4 = 8 does not match world_size=6"):
        HSDPInferenceConfig(replicate_size=2, shard_size=4).resolve_mesh_shape(6)
    with pytest.raises(ValueError, match="replicate_size"):
        HSDPInferenceConfig(replicate_size=0)
    with pytest.raises(ValueError, match="shard_size"):
        HSDPInferenceConfig(shard_size=-2)
    with pytest.raises(ValueError, match="param_dtype"):
        HSDPInferenceConfig(param_dtype=torch.int8)
    with pytest.raises(TypeError):
        HSDPInferenceConfig(2, 4)  # kw_only


def _load_counting_reads(rank, world_size, dirs):
    """Each case's error class and message, and how many tensor reads (or views of a file's
    mapping) happened before it."""
    import loaders.streaming
    from loaders import CheckpointError, load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    reads = []
    for name in ("read_rows", "mapped_rows"):
        original = getattr(loaders.streaming, name)
        setattr(loaders.streaming, name, lambda *a, _original=original, **k: reads.append(a) or _original(*a, **k))
    outcomes = {}
    for case, path in dirs.items():
        reads.clear()
        try:
            load_hsdp_model(path, HSDPInferenceConfig(), require_tokenizer=True)
            outcomes[case] = ("ok", "", len(reads))
        except CheckpointError as e:
            outcomes[case] = (type(e).__name__, str(e), len(reads))
    return outcomes


def test_tokenizer_and_generation_config_are_checked_before_any_weight_is_read(tmp_path, checkpoints):
    good = checkpoints["llama"]
    no_tokenizer = _copy(good, tmp_path / "no_tokenizer")
    for name in os.listdir(no_tokenizer):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            os.remove(os.path.join(no_tokenizer, name))
    bad_generation = _copy(good, tmp_path / "bad_generation")
    with open(os.path.join(bad_generation, "generation_config.json"), "w") as f:
        f.write("{not json")
    dirs = {"no_tokenizer": no_tokenizer, "bad_generation": bad_generation, "good": good}
    for outcomes in values(run_ranks(_load_counting_reads, 2, tmp_path, dirs, timeout=180)):
        cls, message, reads = outcomes["no_tokenizer"]
        assert cls == "MissingTokenizerError" and "tokenizer.json" in message and reads == 0, outcomes
        cls, message, reads = outcomes["bad_generation"]
        assert cls == "CheckpointError" and "generation_config.json" in message and reads == 0, outcomes
        assert outcomes["good"][0] == "ok" and outcomes["good"][2] > 0


def test_prefill_budget_and_compile_sizes_default_per_device():
    """``auto`` (the default) resolves per device: a CPU rank's prefill budget and compiled batch
    sizes fit 2 cores, a GPU's fit a GPU; a value given as a flag or a variable is kept as given on
    either; a nonsense value is refused."""
    from server.config import COMPILE_BATCH_SIZES, PREFILL_TOKENS, CompileSizes, parse_serve_config

    auto = parse_serve_config([], environ={})
    assert auto.max_batch_prefill_tokens is None and auto.compile_batch_sizes is None
    assert auto.prefill_tokens_for("cpu") == 512 == PREFILL_TOKENS["cpu"]
    assert auto.prefill_tokens_for("cuda") == 8192 == PREFILL_TOKENS["cuda"]
    assert auto.compile_batch_sizes_for("cpu") == CompileSizes((1,), open_from=2) == COMPILE_BATCH_SIZES["cpu"]
    assert str(auto.compile_batch_sizes_for("cpu")) == "1,2+"
    cuda = auto.compile_batch_sizes_for("cuda")
    assert cuda.static[-1] == 128 and cuda.open_from is None  # static: what CUDA graphs need
    given = parse_serve_config(["--max-batch-prefill-tokens", "64", "--compile-batch-sizes", "4,1"],
                               environ={"HSDP_MAX_BATCH_PREFILL_TOKENS": "32"})
    for device in ("cpu", "cuda"):
        assert given.prefill_tokens_for(device) == 64 and given.compile_batch_sizes_for(device) == CompileSizes((1, 4))
    assert parse_serve_config([], environ={"HSDP_COMPILE_BATCH_SIZES": "1, 2, 8+"}).compile_batch_sizes == \
        CompileSizes((1, 2), open_from=8)
    assert parse_serve_config([], environ={"HSDP_MAX_BATCH_PREFILL_TOKENS": "auto"}).max_batch_prefill_tokens is None
    assert parse_serve_config(["--compile-batch-sizes", "auto"], environ={}).compile_batch_sizes is None
    for argv in (["--max-batch-prefill-tokens", "0"], ["--compile-batch-sizes", "0,2"],
                 ["--compile-batch-sizes", "1+"], ["--compile-batch-sizes", "8,4+"], ["--compile-batch-sizes", "2+,4"],
                 ["--compile-batch-sizes", "x+"]):
        with pytest.raises(SystemExit):
            parse_serve_config(argv, environ={})
