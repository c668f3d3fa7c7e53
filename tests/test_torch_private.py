"""shard_engine.torch_private: what it relies on exists on this torch, a missing name is named,
and no other product file reaches torch's private API."""

import ast
import os

import pytest

from tests.dist import run_ranks, values

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("server", "loaders", "shard_engine", "benchmarks")
ALLOWED = os.path.join("shard_engine", "torch_private.py")


def _check(rank, world_size, remove=None):
    """check() on a 1-rank gloo group; ``remove``: (dotted class, attribute) taken away first."""
    import importlib

    from shard_engine.torch_private import check

    if remove is not None:
        module, _, name = remove[0].rpartition(".")
        delattr(getattr(importlib.import_module(module), name), remove[1])
    try:
        check()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_check_passes_on_this_torch(tmp_path):
    assert values(run_ranks(_check, 1, tmp_path, timeout=90)) == [None]


@pytest.mark.timeout(120)
def test_a_missing_name_fails_check_naming_it_and_the_torch_version(tmp_path):
    import torch

    owner = "torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler"
    [error] = values(run_ranks(_check, 1, tmp_path, (owner, "_create_tcp_store_server"), timeout=90))
    assert error is not None and torch.__version__ in error, error
    assert error.rsplit(": ", 1)[1] == f"{owner}._create_tcp_store_server", error  # that one, and only it


def _private_names() -> set[str]:
    from shard_engine.torch_private import RELIED_ON

    return {name for names in RELIED_ON.values() for name in names if name.startswith("_")}


def _is_private_torch_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts[1:])


def _findings(path: str, private: set[str]) -> list[str]:
    """Where ``path`` names a private torch module or one of ``private`` (attribute, import, override)."""
    tree = ast.parse(open(path).read(), path)
    found = []
    for node in ast.walk(tree):
        names, modules = [], []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            names = [a.name for a in node.names]
        found += [f"{path}:{node.lineno}: {n}" for n in names if n in private]
        found += [f"{path}:{node.lineno}: import {m}" for m in modules if _is_private_torch_module(m)]
    return found


def test_the_scan_sees_a_private_use(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGather\n"
                    "x = p._local_tensor\n")
    assert len(_findings(str(path), _private_names())) == 2


def test_no_other_product_file_reaches_torch_private_api():
    private = _private_names()
    assert {"_local_tensor", "_fsdp_param_group", "_create_tcp_store_server"} <= private
    found = []
    for folder in SCANNED:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                path = os.path.join(root, name)
                if name.endswith(".py") and os.path.relpath(path, REPO) != ALLOWED:
                    found += _findings(path, private)
    assert not found, "\n".join(found)


def _scaled_rows(x, scale):
    return (x * scale).sum(dim=1) + x.shape[0]


def test_a_graph_traced_ahead_runs_as_plain_code_at_every_size_and_survives_a_save():
    """CompiledCall: a graph of a symbolic batch, called as plain code (dynamo's helpers reached
    without their ``_disable_dynamo`` wrappers: nothing of dynamo's frame hook runs), computes what
    eager does at sizes it was not traced at, and so does the same graph saved and loaded."""
    import torch

    from shard_engine import torch_private

    x = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(_scaled_rows, fullgraph=True, dynamic=False)
    graph = torch_private.CompiledCall.trace(compiled, (x, 2.0), {})
    # (its code reads the batch through torch._dynamo.utils.call_size)
    assert isinstance(graph.call.__globals__[torch_private._DYNAMO_UTILS], torch_private._DynamoHelpers)
    loaded = torch_private.CompiledCall.load(graph.save(), _scaled_rows)
    calls = []
    frames = torch._dynamo.eval_frame  # where a _disable_dynamo wrapper reads the stance from, at every call
    real = frames._callback_from_stance
    frames._callback_from_stance = lambda *a: (calls.append(a), real(*a))[1]
    try:
        for rows in (3, 5, 9):
            y = torch.randn(rows, 4)
            for g in (graph, loaded):
                torch.testing.assert_close(g.call(y, 2.0), _scaled_rows(y, 2.0))
    finally:
        frames._callback_from_stance = real
    # at most the compiled function's own entry, once a call; none of the helpers the code before it
    # calls (three a call here: its batch's size and the profiler's marks), each a _disable_dynamo wrapper
    assert len(calls) <= 6, len(calls)
    assert not loaded.traced and graph.fits(torch.randn(7, 4), 2.0)


def _bump_and_scale(x, buffer, w):
    import torch

    buffer.index_copy_(0, torch.tensor([0]), x[:1])  # an input written in the graph (as the KV pools are)
    return (x @ w).relu() + buffer.sum()


def _scaled_view(x):
    x.mul_(2)
    return x.view(-1)  # aliases its input: AOTAutograd's wrapper regenerates it


def test_a_graph_goes_direct_past_aot_wrappers_where_they_have_nothing_to_do():
    """CompiledCall.go_direct: a graph whose only input mutation is in the graph and whose output is
    its own enters inductor's code directly and computes what the wrapped call did, writing its
    input too (a loaded graph as well); one whose output aliases its input keeps the wrapper, says
    why, and still computes the same. With grad enabled a direct graph goes through the wrapper."""
    import torch

    from shard_engine import torch_private

    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    compiled = torch.compile(_bump_and_scale, fullgraph=True, dynamic=False)
    traced = torch_private.CompiledCall.trace(compiled, (x, torch.zeros(2, 4), w), {})
    loaded = torch_private.CompiledCall.load(traced.save(), _bump_and_scale)
    for graph in (traced, loaded):
        buffer = torch.zeros(2, 4)
        with torch.no_grad():
            output = graph.call(x, buffer, w)
            assert graph.go_direct((x, buffer, w), {}, output) is None and graph.wrapped is None
            buffer = torch.zeros(2, 4)
            y = torch.randn(3, 4)
            got = graph.call(y, buffer, w)
        torch.testing.assert_close(buffer[0], y[0])
        torch.testing.assert_close(got, _bump_and_scale(y, torch.zeros(2, 4), w), rtol=0, atol=1e-6)
        direct = graph.call.__globals__[next(n for n in graph.call.__code__.co_names if n.startswith("__compiled_fn"))]
        assert direct.__name__ == "direct"
        with torch.enable_grad():  # through the wrapper, which turns grad off
            torch.testing.assert_close(graph.call(y, torch.zeros(2, 4), w.requires_grad_()), got)
        w.requires_grad_(False)

    aliasing = torch_private.CompiledCall.trace(torch.compile(_scaled_view, fullgraph=True, dynamic=False),
                                                (torch.ones(2, 2),), {})
    z = torch.ones(2, 2)
    with torch.no_grad():
        output = aliasing.call(z)
        why = aliasing.go_direct((z,), {}, output)
        assert why and "aliasing" in why, why
        assert aliasing.go_direct((z,), {}, output) == why  # decided once
        z = torch.ones(2, 2)
        out = aliasing.call(z)
    assert out.data_ptr() == z.data_ptr() and torch.equal(z, torch.full((2, 2), 2.0))
