"""Linear layers on oneDNN's prepacked weights (server/engine/linears.py, ``--packed-linears``)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.engine import linears

pytestmark = pytest.mark.skipif(linears.packing_refusal(nn.Linear(2, 2).bfloat16(), torch.device("cpu")) is not None,
                                reason="this CPU or torch cannot pack bf16 linears")


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64, bias=False), nn.GELU(), nn.Linear(64, 500))
    return model.to(dtype).eval()


def test_packed_linears_equal_the_plain_ones_in_bf16():
    model = _model()
    xs = [torch.randn(1, 64).bfloat16(), torch.randn(7, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()]
    with torch.no_grad():
        want = [model(x) for x in xs]
        packed = linears.pack_linears(model)
        assert packed == sum(m.weight.numel() * 2 for m in model if isinstance(m, nn.Linear))
        got = [model(x) for x in xs]
    try:
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert all("forward" in m.__dict__ for m in model if isinstance(m, nn.Linear))
    finally:
        linears.unpack_linears(model)
    assert not any("forward" in m.__dict__ for m in model)


def test_a_weight_written_after_packing_is_never_read_stale():
    """An in-place write moves the weight's version: the op computes with the new weight."""
    model = _model()
    linears.pack_linears(model)
    try:
        x = torch.randn(3, 64).bfloat16()
        with torch.no_grad():
            model[0].weight.mul_(2)
            got = model[0](x)
        assert torch.equal(got, F.linear(x, model[0].weight, model[0].bias))
    finally:
        linears.unpack_linears(model)


def test_packed_linears_inside_a_compiled_forward():
    """The op is opaque to torch.compile: a compiled forward calls it and equals eager."""
    model = _model()
    x = torch.randn(4, 64).bfloat16()
    with torch.no_grad():
        want = model(x)
        linears.pack_linears(model)
        try:
            torch.library.opcheck(linears.packed_linear, (x, model[0].weight, model[0].bias))
            got = torch.compile(model, dynamic=False)(x)
        finally:
            linears.unpack_linears(model)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_model_of_another_dtype_or_device_is_refused_with_the_reason():
    assert "float32" in linears.packing_refusal(_model(torch.float32), torch.device("cpu"))
    assert linears.packing_refusal(_model(torch.float32), torch.device("cpu"), (torch.float32,)) is None
    assert "cuda" in linears.packing_refusal(_model(), torch.device("cuda"))


def test_a_bf16_server_packs_its_linears_and_answers_as_without(tmp_path):
    """End to end, 2 CPU ranks, a bf16 checkpoint: ``--packed-linears on`` packs (the log says how
    much) and answers greedy completions token for token as ``off`` does."""
    from tests.checkpoints import write_checkpoint
    from tests.server_process import ServerProcess

    path = write_checkpoint(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    prompts = ["Once upon a time", "The weights are sharded", "a b c d e f"]
    answers = {}
    for mode in ("on", "off"):
        log = tmp_path / f"{mode}.log"
        with ServerProcess(path, log_path=log, extra_args=("--dtype", "bfloat16", "--packed-linears", mode)) as server:
            answers[mode] = []
            for prompt in prompts:
                r = server.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                                "logprobs": 1})
                assert r.status_code == 200, r.text
                answers[mode].append(r.json()["choices"][0]["logprobs"]["tokens"])
        packed = re.findall(r"linears on prepacked weights: ([0-9.]+) MB", log.read_text())
        assert (float(packed[0]) > 0 if packed else False) == (mode == "on"), packed
    assert answers["on"] == answers["off"]
