"""``--compile decode``: FSDP2's hooks out of resident forwards, the compiled decode forward equal
to eager token for token, no compilation after the warm-up, refusals named."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from server.engine import linears
from tests.dist import run_ranks, values
from tests.server_process import REPO
from tests.test_families import SERVED, STATEFUL

SERVED_FAMILIES = [f for f in SERVED if f not in STATEFUL]
"""The family matrix's: every served family (DeepSeek-V2's complex rope as real pairs inside the
layers' graphs); the stateful families have tests of their own (their steps with prompt chunks run
eagerly)."""


def _hooks_out_and_back(rank, world_size, path):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig, set_resident_units
    from shard_engine.direct import DirectForward, direct_forward_refusal
    from shard_engine.units import fsdp_units

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32)
    model = loaded.model
    set_resident_units(model, 0)
    refused = direct_forward_refusal(model)
    set_resident_units(model, -1)
    hooks = [(list(u._forward_pre_hooks), list(u._forward_hooks)) for u in fsdp_units(model)]
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        hooked = model(input_ids=ids).logits
        direct = DirectForward(model)
        with direct():
            inside = [(len(u._forward_pre_hooks), len(u._forward_hooks)) for u in fsdp_units(model)]
            unhooked = model(input_ids=ids).logits
    after = [(list(u._forward_pre_hooks), list(u._forward_hooks)) for u in fsdp_units(model)]
    # the engine's eager steps: without FSDP2's hooks while every unit is resident, with them once not
    from tests.test_engine import Harness

    unit = fsdp_units(model)[-1]
    base = len(unit._forward_pre_hooks)  # FSDP2's, and any other
    seen = []
    spy = unit.register_forward_pre_hook(lambda module, args: seen.append(len(module._forward_pre_hooks)))
    harness = Harness(model)
    engine_steps = {}
    for resident in (-1, 0):  # the same engine throughout: residency changed under it
        set_resident_units(model, resident)
        seen.clear()
        out = harness.submit([5, 9, 2, 7, 1, 3], 4)  # the same on both ranks: matched all-gathers when sharded
        harness.run(lambda: out["finish"] is not None or out["error"] is not None)
        engine_steps[resident] = {"hooks_seen": [n - base for n in sorted(set(seen))], "tokens": out["tokens"],
                                  "error": out["error"]}
    spy.remove()
    set_resident_units(model, -1)
    return {"refused": refused, "hooks_before": [tuple(map(len, h)) for h in hooks], "inside": inside,
            "restored": after == hooks, "equal": torch.equal(hooked, unhooked), "engine_steps": engine_steps}


def test_direct_forward_takes_fsdp_hooks_out_and_puts_them_back(tmp_path):
    """DirectForward removes FSDP2's forward hooks for a call and restores them; the rank engine's
    eager steps run without them while every unit is resident and with them once a unit gathers
    again, with the same greedy tokens."""
    from tests.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "llama", "llama")
    for r in values(run_ranks(_hooks_out_and_back, 2, tmp_path, path, timeout=240)):
        assert r["refused"] is not None and "not resident" in r["refused"], r
        assert all(pre >= 1 and post >= 1 for pre, post in r["hooks_before"]), r
        assert all(pre == before[0] - 1 and post == before[1] - 1
                   for (pre, post), before in zip(r["inside"], r["hooks_before"])), r
        assert r["restored"] and r["equal"], r
        resident, sharded = r["engine_steps"][-1], r["engine_steps"][0]
        assert resident["hooks_seen"] == [0] and sharded["hooks_seen"] == [1], r  # the spy's, + FSDP2's
        assert resident["error"] is None and resident["tokens"] == sharded["tokens"] and len(resident["tokens"]) == 4, r


def _sizes():
    """Two static graphs and an open one from 4 (`1,2,4+`): a rank's 3 sequences are padded to 4,
    its 4 and 5 run in the open graph unpadded, one sequence and two in static ones."""
    from server.config import CompileSizes

    return CompileSizes((1, 2), open_from=4)


def _decode_eager_and_compiled(rank, world_size, paths, region):
    """Each model through the engine twice, eagerly and compiled: four sequences of different
    lengths (the batch shrinks to one), a fifth arriving mid-decode (steps with a prompt chunk: the
    layers' open graph takes them whole, the model's graph leaves them to eager)."""
    import torch._dynamo.utils

    from loaders import load_hsdp_model
    from server.engine.compiled import WARM_UP_CONTEXTS
    from shard_engine import HSDPInferenceConfig, set_resident_units
    from tests.test_engine import Harness

    out = {}
    for family, path in paths.items():
        loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32)
        set_resident_units(loaded.model, -1, shared=True)
        got = {}
        for mode in ("eager", "compiled"):
            harness = Harness(loaded.model, blocks=128, block_size=4, prefill=16)
            harness.scheduler.eos_token_ids = set()
            graphs = None
            if mode == "compiled":
                own = torch.get_num_threads()
                harness.engines[0].compile_decode(sizes=_sizes(), region=region, graph_dir="")
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            gen = torch.Generator().manual_seed(rank)
            prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 21, 5)]
            outs = [harness.submit(p, 6 + 5 * i) for i, p in enumerate(prompts)]
            harness.run(lambda: harness.steps >= 4)
            outs.append(harness.submit(prompts[0][:7], 8))
            harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
            got[mode] = [o["tokens"] for o in outs]
            if graphs is not None:
                got["compiled_after_warm_up"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
                got["errors"] = [o["error"] for o in outs]
                compiled = harness.engines[0].compiled
                warm_up_calls = len(WARM_UP_CONTEXTS) * _sizes().graphs
                got["compiled_steps"] = compiled.calls - warm_up_calls
                got["padded_rows"] = compiled.padded_rows - compiled.warm_up_padded_rows
                got["batches"] = sorted(compiled.batches)
                got["graphs_compiled"] = compiled.graphs_compiled
                got["every_step_fit_a_graph"] = compiled.skip_guards  # off after a step that fit none
                got["steps"] = harness.steps
                if harness.engines[0].states is not None:  # the probes' steps by hand carry no state slots
                    continue
                got["at_plan_threads"] = _a_call_at(harness.engines[0], compiled, own + 1)
                got["fallback"] = _a_call_no_graph_fits(harness.engines[0], compiled)
                last = harness.submit(prompts[3], 3)  # the engine's compiled steps put the graphs' count back
                harness.run(lambda: last["finish"] is not None or last["error"])
                got["threads_put_back"] = torch.get_num_threads() == compiled.threads
        set_resident_units(loaded.model, 0)
        out[family] = got
    return out


def _a_call_at(engine, compiled, threads: int) -> dict:
    """A compiled call whose plan carries ``threads``, entered at it as the engine enters it: the
    thread counts switched inside, and the graphs compiled, during it."""
    import torch._dynamo.utils

    from server.engine.attention import PagedLayout

    switches = []
    real = torch.set_num_threads
    torch.set_num_threads(compiled.entry_threads(threads))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    layout = PagedLayout.build([(4, 1, [0, 1]), (6, 1, [2, 3])], engine.block_size, engine.device)
    engine.cache.layout = layout
    torch.set_num_threads = lambda n: (switches.append(n), real(n))
    try:
        with torch.no_grad():
            compiled.forward(threads=threads, input_ids=torch.ones(1, 2, dtype=torch.long),
                             position_ids=torch.tensor([[4, 6]]), cache=engine.cache, use_cache=True,
                             logits_to_keep=torch.tensor([0, 1]), hsdp_paged=layout)
    finally:
        torch.set_num_threads = real
        engine.cache.layout = None
        real(compiled.threads)
    return {"entered_at": compiled.entry_threads(threads), "switches": len(switches),
            "compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
            "every_step_fit_a_graph": compiled.skip_guards}


def _a_call_no_graph_fits(engine, compiled) -> dict:
    """A compiled call with another thread count than the graphs' (a guard of each): it runs
    (eagerly) instead of raising, and guards are evaluated in full after it; an engine step puts the
    graphs' thread count back before its compiled forward (checked by the caller)."""
    from server.engine.attention import PagedLayout

    threads = compiled.threads
    torch.set_num_threads(threads + 1)
    layout = PagedLayout.build([(4, 1, [0, 1])], engine.block_size, engine.device)
    engine.cache.layout = layout
    try:
        with torch.no_grad():
            out = compiled.forward(input_ids=torch.ones(1, 1, dtype=torch.long), position_ids=torch.tensor([[4]]),
                                   cache=engine.cache, use_cache=True, logits_to_keep=torch.tensor([0]),
                                   hsdp_paged=layout)
    finally:
        engine.cache.layout = None
    return {"ran": out.logits.shape[1] == 1, "skip_guards_after": compiled.skip_guards}


@pytest.mark.parametrize("region", ["layer", "model"])
def test_compiled_decode_equals_eager_token_for_token(tmp_path, region):
    """Gemma 2 (soft-capping, windows on alternate layers, its own scaling: the most variants of
    one family; a compile costs a minute on CI's cores, so one family here, the plain path in
    benchmarks/step.py's compiled mode), sharded over 2 ranks, one shared resident copy (the CPU
    default): greedy tokens equal to eager's, most steps compiled (some padded to their bucket),
    nothing compiled after the warm-up: the open graph (`N+`) served several batches as one."""
    from tests.test_families import _write

    paths = {family: _write(family, tmp_path / family) for family in ("gemma2",)}
    # a graph per size (1, 2 and the open one from 4), of each kind of layer (Gemma 2: windowed or not)
    graphs = {"model": 3, "layer": 6}[region]
    for by_family in values(run_ranks(_decode_eager_and_compiled, 2, tmp_path, paths, region, timeout=600)):
        for family, got in by_family.items():
            assert got["errors"] == [None] * 5, (family, got)
            assert got["compiled"] == got["eager"], family
            assert got["compiled_after_warm_up"] == 0, (family, got)
            assert got["compiled_steps"] > got["steps"] // 2, (family, got)
            assert got["padded_rows"] > 0, (family, got)  # a batch of 3 ran in the open graph at 4
            assert {1, 2, 4, 5} <= set(got["batches"]), (family, got)
            assert got["graphs_compiled"] == graphs and got["every_step_fit_a_graph"], (family, got)  # 4, 5: one
            # a call at another thread count: the model's graph fits none (guards evaluated from then on);
            # each layer is entered at its graphs' count, so the layers' fit
            assert got["fallback"] == {"ran": True, "skip_guards_after": region == "layer"}, (family, got)
            assert got["threads_put_back"], (family, got)
            # a plan's count other than the warm-up's: the layers' graphs entered at it (their kernels take the
            # count when they run), no switch inside (a switch resizes OpenMP's pool: two a layer cost 5 ms a
            # step at 30 layers); the model's graph: entered at its own count, its opaque ops at the plan's
            own = got["at_plan_threads"]["entered_at"] - (region == "layer")
            assert got["at_plan_threads"] == {"entered_at": own + (region == "layer"), "switches": region == "model",
                                              "compiled": 0, "every_step_fit_a_graph": True}, (family, got)


def test_compiled_decode_of_a_stateful_model_equals_eager_on_2_ranks(tmp_path):
    """LFM2 (short convolutions beside attention layers: a state slot per sequence) sharded over 2
    ranks, the layers' graphs (the default region) under ``1,2,4+``: greedy tokens equal eager's,
    most decode steps compiled (a batch of 3 padded to 4, its padding row's states in the pool's
    scratch slot, nobody's), a graph per size of each kind of layer (convolution, attention) shared
    by the layers of the kind (each layer's states its graph's input), nothing compiled after the
    warm-up; the steps that carry a prompt chunk, or a sequence's first state, run eagerly. RWKV-4
    too, whose stateful modules are its blocks, FSDP2's units: the engine's classes go under
    FSDP2's (``shard_engine.torch_private.mix_into_class``), where dynamo's guards look a unit's
    class up; a graph each for its first block, and for each factor of its eval rescaling."""
    from tests.test_families import _write

    paths = {family: _write(family, tmp_path / family) for family in ("lfm2", "rwkv")}
    for by_family in values(run_ranks(_decode_eager_and_compiled, 2, tmp_path, paths, "layer", timeout=600)):
        for family, graphs in (("lfm2", 6), ("rwkv", 9)):
            got = by_family[family]
            assert got["errors"] == [None] * 5 and got["compiled"] == got["eager"], (family, got)
            assert got["compiled_after_warm_up"] == 0 and got["graphs_compiled"] == graphs, (family, got)
            assert got["compiled_steps"] > got["steps"] // 2 and got["padded_rows"] > 0, (family, got)
            assert {1, 2, 4, 5} <= set(got["batches"]) and got["every_step_fit_a_graph"], (family, got)


STATEFUL_COMPILED = ["qwen3_next", "falcon_h1", "mamba", "jamba@model", "kimi_linear", "minimax", "zamba2",
                     "recurrent_gemma", "zaya"]
"""Stateful families compiled in process, by layer (``family@model``: the model's graph):
gated delta-net beside attention and experts; attention and Mamba2 in one layer; Mamba-1 alone,
and beside attention and experts; Kimi delta attention beside latent attention (its latents
written through :class:`~server.engine.attention.LayerPools`); MiniMax's lightning attention (its
module returns its state beside its output; its model called with ``use_cache=False``); Zamba2's
hybrid layers, each holding a Mamba layer (compiled as one graph) and a shared block tied across
layers (kept out of FSDP); RecurrentGemma's layers, which take their cache by position (and its
blocks their states through their own attributes); ZAYA's attention, whose projection takes its
cache by position and returns queries, keys and values. LFM2 on 2 ranks above; every
served stateful family was checked once by hand by layer, those before Qwen3.5 in both regions."""


@pytest.fixture(scope="module")
def stateful_compiled() -> dict:
    """{family: what :func:`_layer_region_family` saw} for :data:`STATEFUL_COMPILED`."""
    return _families_in_two_processes(STATEFUL_COMPILED)


@pytest.mark.parametrize("family", STATEFUL_COMPILED)
def test_compiled_decode_equals_eager_for_stateful_families(family, stateful_compiled):
    """A stateful family's decode steps through its layers' graphs (or the model's): each stateful
    module's sequences as one batch of one-token sequences, their states gathered and scattered by
    slot inside the graph; the greedy tokens of 3, 2 and 1 sequences equal eager's, a graph a size
    (of each kind of layer), nothing compiled after the warm-up, and the steps with prompt chunks
    left to eager (none in the open graph)."""
    got = stateful_compiled[family]
    assert "error" not in got, got.get("error")
    assert got["compiled"] == got["eager"], got
    assert got["after_warm_up"] == 0 and {1, 2, 3} <= set(got["batches"]), got
    if family.endswith("@model"):
        assert got["graphs"] == 2 and got["graph_breaks"] == 0, got
    else:
        # a graph a size of each kind of layer: Kimi Linear's 3 (delta attention with a dense MLP, delta attention and
        # latent attention with experts); Zamba2's Mamba layers and its hybrid layers of either shared block; ZAYA's 3
        # (its first layer, without a previous router state, then full and sliding-window layers)
        most = {"kimi_linear": 6, "zamba2": 8, "zaya": 6}.get(family, 4)
        assert got["entries"] == ["1", "2+"] and 2 <= got["graphs"] <= most and got["whole_steps"] == 0, got
        assert got["wrapped"] == [], got  # checked with the states put back between the two calls


def test_a_stateful_models_layer_graphs_are_kept_on_disk_and_loaded(tmp_path):
    """LFM2's layers' graphs (convolution layers', attention layers') saved by a warm-up and loaded
    by the next, each checked against eager from the same states (the check's eager call puts them
    back): nothing traced again, the same tokens."""
    got = _layer_region_family("lfm2", graph_dir=str(tmp_path))
    again = _layer_region_family("lfm2", graph_dir=str(tmp_path))
    assert got["compiled"] == got["eager"] == again["compiled"], (got, again)
    assert (got["graphs"], got["loaded"], again["graphs"], again["loaded"]) == (4, 0, 0, 4), (got, again)
    assert got["wrapped"] == [] == again["wrapped"], (got, again)


def _share_out_warm_up(rank, world_size, path, graph_dir, failing_rank=None):
    """The served model's layers' graphs warmed up by both ranks at once, shared out between them
    (WarmUpPeers over the default group, as server.main does), then greedy tokens eagerly and compiled.
    ``failing_rank``: that rank's warm-up fails before its share (a KV pool too small to warm up in)."""
    import torch.distributed as dist

    from loaders import load_hsdp_model
    from server.engine.compiled import CompileUnavailable, WarmUpPeers
    from shard_engine import HSDPInferenceConfig, set_resident_units
    from tests.test_engine import Harness

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), dtype=torch.float32)
    set_resident_units(loaded.model, -1, shared=True)
    got = {}
    for mode in ("eager", "compiled"):
        harness = Harness(loaded.model, blocks=1 if mode == "compiled" and rank == failing_rank else 64,
                          block_size=4, prefill=32)
        harness.scheduler.eos_token_ids = set()
        if mode == "compiled":
            try:
                harness.engines[0].compile_decode(sizes=_sizes(), region="layer", graph_dir=graph_dir,
                                                  peers=WarmUpPeers(rank, world_size, dist.barrier))
            except CompileUnavailable as e:
                return {"error": str(e)}
            compiled = harness.engines[0].compiled
            got["graphs"] = (compiled.graphs_compiled, compiled.graphs_loaded)
        gen = torch.Generator().manual_seed(rank)
        outs = [harness.submit(torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist(), 6)
                for n in (9, 14, 21, 5, 11)]
        harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
        got[mode] = [o["tokens"] if o["error"] is None else o["error"] for o in outs]
    set_resident_units(loaded.model, 0)
    return got


def test_the_ranks_of_a_host_share_out_the_layers_graphs(tmp_path):
    """Two ranks warming up the same model share out its layers' graphs (three: sizes 1, 2 and the
    open one from 4): each traces its share and saves it, waits for the other, and loads the rest;
    greedy tokens equal eager's on both."""
    from tests.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "llama", "llama")
    graph_dir = str(tmp_path / "graphs")
    got = values(run_ranks(_share_out_warm_up, 2, tmp_path, path, graph_dir, timeout=400))
    for r in got:
        assert r["compiled"] == r["eager"], r
    assert [r["graphs"] for r in got] == [(2, 1), (1, 2)], got  # entries 0 and 2 traced by rank 0, 1 by rank 1
    # a rank whose warm-up fails still reaches the barrier: the other goes on (tracing what it lacks), no hang
    failed, other = values(run_ranks(_share_out_warm_up, 2, tmp_path, path, str(tmp_path / "graphs-2"), 0,
                                     timeout=400))
    assert "too small to warm up in" in failed["error"], failed
    assert other["compiled"] == other["eager"] and other["graphs"] == (3, 0), other


def test_a_decode_step_is_padded_to_its_bucket_or_left_to_eager():
    """``CompiledDecode.pad``: a step's rows padded to the smallest bucket that holds them (padding
    rows at position 0 in the scratch block, the kept rows filled to the bucket's size); none
    where no bucket holds the step, or where its longest context is 1 (compile took it for at
    least 2); with an open size, every larger step at its own batch. Nothing is compiled here (a
    plain module: no FSDP2 hooks to take out)."""
    from server.config import CompileSizes, parse_batch_sizes
    from server.engine.compiled import CompiledDecode

    compiled = CompiledDecode(torch.nn.Linear(1, 1), parse_batch_sizes("4,1,2"), region="model")
    assert compiled.sizes == CompileSizes((1, 2, 4)) and str(compiled.sizes) == "1,2,4"
    assert [compiled.bucket(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    open_sizes = CompiledDecode(torch.nn.Linear(1, 1), parse_batch_sizes("1,4+"), region="model")
    assert [open_sizes.bucket(n) for n in (1, 2, 3, 4, 5, 300)] == [1, 4, 4, 4, 5, 300]
    one_graph = CompiledDecode(torch.nn.Linear(1, 1), parse_batch_sizes("2+"), region="model")  # a sequence alone padded to two
    assert [one_graph.bucket(n) for n in (1, 2, 3)] == [2, 2, 3] and one_graph.sizes.graphs == 1
    ids, positions, items, keep = [7, 8, 9], [4, 10, 2], [(4, 1, [3]), (10, 1, [5]), (2, 1, [6])], [0, 1, 2]
    assert compiled.pad(ids, positions, items, keep, scratch_block=99)
    assert (ids, positions, keep) == ([7, 8, 9, 0], [4, 10, 2, 0], [0, 1, 2, 3])
    assert items[3] == (0, 1, [99]) and compiled.padded_rows == 1
    five = [(4, 1, [3])] * 5
    assert not compiled.pad([1] * 5, [4] * 5, five, [0, 1, 2, 3, 4], scratch_block=99)
    alone = ([1], [0], [(0, 1, [3])], [0])  # a one-token prompt's first step: context 1
    assert not compiled.pad(*alone, scratch_block=99) and alone == ([1], [0], [(0, 1, [3])], [0])
    for static, open_from in (((0, 2), None), ((), 1), ((4,), 4), ((2, 1), None), ((), None)):
        with pytest.raises(ValueError, match="positive batch sizes"):
            CompileSizes(static, open_from)


def _one_row_products() -> int:
    """The products inductor's decompose_mm_pass has made reductions in this process so far."""
    import torch._dynamo.utils

    counters = torch._dynamo.utils.counters["inductor"]
    return counters["decompose_mm"] + counters["decompose_addmm"]


def _layer_region_family(family: str, graph_dir: str, packed: bool = False, region: str = "layer") -> dict:
    """One family's tiny model in process, unsharded: greedy tokens eagerly, then with decode steps
    through compiled layers (``--compile-region layer``, the CPU default sizes ``1,2+``): three
    sequences of different lengths (the batch shrinks 3, 2, 1), the graphs compiled (or loaded from
    ``graph_dir``) at warm-up. ``packed``: both on oneDNN's prepacked linears (``--packed-linears``)."""
    import torch._dynamo.utils
    from transformers import AutoModelForCausalLM

    from server.config import COMPILE_BATCH_SIZES
    from tests.test_engine import Harness
    from tests.test_families import _config

    torch._dynamo.reset()  # each family's graphs alone under the recompile limit
    torch.manual_seed(0)
    config = _config(family)
    model = AutoModelForCausalLM.from_config(config).eval()
    if packed:
        linears.pack_linears(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.get_text_config().vocab_size, (n,), generator=gen).tolist() for n in (21, 9, 14)]
    got = {}
    for mode in ("eager", "compiled"):
        harness = Harness(model, blocks=64, block_size=4, prefill=64)
        harness.scheduler.eos_token_ids = set()
        if mode == "compiled":
            decomposed = _one_row_products()
            harness.engines[0].compile_decode(sizes=COMPILE_BATCH_SIZES["cpu"], region=region, graph_dir=graph_dir)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            # one-row products made inductor's own reductions (none where every graph was loaded)
            got["one_row_products"] = _one_row_products() - decomposed
        outs = [harness.submit(p, 4 + 4 * i) for i, p in enumerate(prompts)]
        harness.run(lambda: all(o["finish"] is not None or o["error"] for o in outs))
        got[mode] = [o["tokens"] if o["error"] is None else o["error"] for o in outs]
    compiled = harness.engines[0].compiled
    got["after_warm_up"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    got["graphs"], got["batches"] = compiled.graphs_compiled, sorted(compiled.batches)
    got["padded_rows"] = compiled.padded_rows
    if region == "model":
        got["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        return got
    got["entries"] = sorted(compiled._layers.calls)  # graph -> each layer's graph
    got["loaded"] = compiled.graphs_loaded
    got["whole_steps"] = compiled.whole_steps  # steps carrying prompt chunks, through the open graph
    # why any layer's graph is still called through AOTAutograd's wrapper (CompiledCall.go_direct)
    got["wrapped"] = sorted({g.wrapped for graphs in compiled._layers.assigned.values() for g in graphs if g.wrapped})
    head = compiled._layers.head
    got["head"] = "plain" if head.head is None else "graph" if head.graph is not None and not head.graph.wrapped else "wrapped"
    if packed:
        linears.unpack_linears(model)
    return got


@pytest.mark.skipif(linears.packing_refusal(torch.nn.Linear(2, 2), torch.device("cpu"), (torch.float32,)) is not None,
                    reason="this torch cannot pack linears")
def test_compiled_layers_on_packed_linears_equal_eager_and_are_kept_on_disk(tmp_path):
    """``--compile decode`` beside ``--packed-linears`` (bf16's default where the CPU has bf16; float32
    here, which every CPU packs): each linear's forward, replaced on its instance, is one opaque op in
    the open graph's layers, and the plain product in the one-sequence graph's; the graphs (and
    their guards, which name those forwards) are saved and loaded again, and decode the tokens the
    packed eager steps decode."""
    got = _layer_region_family("llama", graph_dir=str(tmp_path), packed=True)
    assert got["compiled"] == got["eager"] and (got["graphs"], got["loaded"]) == (2, 0), got
    assert got["head"] == "plain" and got["wrapped"] == [], got  # the head is a packed linear too
    # a sequence alone's graph traced on the plain forwards: its products inductor's reductions
    assert got["one_row_products"] >= 5, got
    again = _layer_region_family("llama", graph_dir=str(tmp_path), packed=True)
    assert again["compiled"] == got["eager"] and (again["graphs"], again["loaded"]) == (0, 2), again


def test_compiled_layers_are_kept_on_disk_loaded_and_retraced_where_broken(tmp_path, caplog):
    """The layers' graphs of a warm-up are saved (server.engine.graph_store); the next start loads
    them instead of tracing (Gemma 2: two kinds of layer, each layer mapped to its kind's graph) and
    decodes the same tokens; an entry whose graph does not load, or loads and fails its check
    against eager, is dropped with a warning and traced again; a model of another configuration
    does not find them."""
    got = _layer_region_family("gemma2", graph_dir=str(tmp_path))
    assert got["compiled"] == got["eager"] and (got["graphs"], got["loaded"]) == (4, 0), got
    [key] = os.listdir(tmp_path)
    entries = sorted(os.listdir(tmp_path / key))
    assert entries == [f"{graph}-{torch.get_num_threads()}" for graph in ("1", "2+")], entries  # static, open
    again = _layer_region_family("gemma2", graph_dir=str(tmp_path))
    assert again["compiled"] == got["eager"] and (again["graphs"], again["loaded"]) == (0, 4), again
    assert got["wrapped"] == again["wrapped"] == [], again  # loaded graphs go past the wrapper too
    broken = tmp_path / key / entries[0] / "graph-0.bin"
    broken.write_bytes(b"not a graph")
    with caplog.at_level("WARNING", logger="server.engine.graph_store"):
        third = _layer_region_family("gemma2", graph_dir=str(tmp_path))
    assert third["compiled"] == got["eager"] and (third["graphs"], third["loaded"]) == (2, 2), third
    assert any("traced again: it does not load" in r.getMessage() for r in caplog.records), caplog.text
    assert broken.read_bytes() != b"not a graph"  # saved anew
    for graph in (tmp_path / key / entries[0]).glob("graph-*.bin"):  # the one-sequence graphs as the open ones:
        (tmp_path / key / entries[1] / graph.name).write_bytes(graph.read_bytes())  # they load, and miss its batch
    caplog.clear()
    with caplog.at_level("WARNING", logger="server.engine.graph_store"):
        fourth = _layer_region_family("gemma2", graph_dir=str(tmp_path))
    assert fourth["compiled"] == got["eager"] and (fourth["graphs"], fourth["loaded"]) == (2, 2), fourth
    # (its code, without inductor's size asserts, computes one row of the two: the check against eager sees it)
    assert any("decoder layer 0's graph computes (1, 1, " in r.getMessage() for r in caplog.records), caplog.text
    from transformers import AutoModelForCausalLM

    from server.engine.graph_store import store_key
    from tests.test_families import _config

    cpu, keys = torch.device("cpu"), []
    for eps in (1e-6, 1e-5):
        config = _config("gemma2")
        config.rms_norm_eps = eps
        model = AutoModelForCausalLM.from_config(config)
        keys.append(store_key(model, list(model.model.layers), cpu, block_size=4))
    layers = list(model.model.layers)
    assert keys[0] != keys[1] and keys[1] == store_key(model, layers, cpu, block_size=4)
    assert keys[1] != store_key(model, layers, cpu, block_size=8)
    linear = layers[0].mlp.down_proj  # a forward replaced on an instance (--packed-linears): other code
    object.__setattr__(linear, "forward", functools.partial(torch.nn.functional.linear, weight=linear.weight))
    assert keys[1] != store_key(model, layers, cpu, block_size=4)


def _families_in_process(families: list[str]) -> dict:
    """:func:`_layer_region_family` of each of ``families`` in this process, one thread (one of the
    matrix's two processes); a family that raises gives its traceback, not the others' results."""
    import traceback

    torch.set_num_threads(1)
    out = {}
    for family in families:
        try:
            name, _, region = family.partition("@")  # family@model: the model's graph
            out[family] = _layer_region_family(name, graph_dir="", region=region or "layer")
        except Exception:  # noqa: BLE001 - that family's test reports it
            out[family] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def every_family_compiled() -> dict:
    """{family: what :func:`_layer_region_family` saw} for every served family, computed in two
    processes at once, half the families each (forks of tests.dist's fork server): a family's
    graphs cost seconds of Python (dynamo, AOT autograd, inductor's lowering) on one core, so two
    processes on CI's two cores take about half the time of one."""
    return _families_in_two_processes(SERVED_FAMILIES)


def _families_in_two_processes(families: list[str]) -> dict:
    """:func:`_families_in_process` of half of ``families`` in each of two processes at once (forks
    of tests.dist's fork server)."""
    import concurrent.futures
    import multiprocessing

    from tests.dist import PRELOAD

    multiprocessing.set_forkserver_preload(PRELOAD)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver")) as pool:
        futures = [pool.submit(_families_in_process, half) for half in (families[0::2], families[1::2])]
        results = {}
        for future in futures:
            results.update(future.result(timeout=900))
    return results


@pytest.mark.parametrize("family", SERVED_FAMILIES)
def test_compiled_layers_equal_eager_for_every_family(family, every_family_compiled):
    """``--compile-region layer`` (the default) on every family the engine serves: the greedy
    tokens of compiled decode steps equal eager's (float32), the steps of 3, 2 and 1 sequences ran
    in the warm-up's graphs (the open one and the one-sequence one) and nothing compiled after
    it. A layer's graph is shared by the model's layers of its kind: two graphs a kind (one per
    size), at most two kinds (alternating windows) in these families. Every layer's graph is
    called past AOTAutograd's wrapper (its KV writes are in the graph, its output its own). The
    one-sequence steps' products of one row (the layers' and the head's) are inductor's own
    reductions, and their tokens still equal eager's. The step of the three prompts' chunks ran in
    the open graph too (its attention one op over the step: ``attention.whole_step_op``)."""
    got = every_family_compiled[family]
    assert "error" not in got, got.get("error")
    assert got["compiled"] == got["eager"], got
    assert got["after_warm_up"] == 0 and got["entries"] == ["1", "2+"], got
    assert {1, 2, 3} <= set(got["batches"]), got
    assert 2 <= got["graphs"] <= 4, got
    assert got["wrapped"] == [], got
    # a sequence alone: its layers' and its head's products of one row are inductor's reductions
    # (5 in the families of fused projections, Phi-3's, GPT-2's; the MoE experts' are not products)
    assert got["head"] == "graph" and got["one_row_products"] >= 5, (got["head"], got["one_row_products"])
    assert got["whole_steps"] >= 1, got


def test_compile_decode_with_nothing_resident_is_refused_before_launch(tmp_path):
    from tests.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "llama", "llama")
    proc = subprocess.run([sys.executable, "-m", "server", "--model", str(path), "--device", "cpu", "--compile",
                           "decode", "--resident-units", "0"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hsdp-serve: ")]
    assert proc.returncode == 2 and errors == [
        "hsdp-serve: --compile decode needs every unit resident: --resident-units 0 gathers them every step"], \
        proc.stderr[-2000:]


def _decode_by_hand(q_HSd, k_HNd, v_HNd, slots_SL, contexts_S, scale, window, softcap, sinks_H):
    """The decode attention one sequence and one head at a time, as the models' eager attention
    computes it."""
    heads, num_seqs, _ = q_HSd.shape
    groups = heads // k_HNd.shape[0]
    out = torch.empty(num_seqs, heads, v_HNd.shape[-1])
    for s in range(num_seqs):
        context = int(contexts_S[s])
        first = max(0, context - window) if window else 0
        slots = slots_SL[s, first:context]
        for h in range(heads):
            keys, vals = k_HNd[h // groups, slots], v_HNd[h // groups, slots]
            scores = (keys @ q_HSd[h, s]) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks_H is not None:
                scores = torch.cat([scores, sinks_H[h:h + 1]])
            probs = torch.softmax(scores, dim=0)[:len(slots)]
            out[s, h] = probs @ vals
    return out


@pytest.mark.parametrize("contexts", [[5, 17, 9], [3, 700, 40, 300, 650], [9], [12, 12, 12], [300, 300, 650, 650]],
                         ids=["one-group", "spread", "one-sequence", "one-context", "spread-one-context-each"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_paged_decode_op_is_well_formed_and_computes_each_variant(heads, kv_heads, contexts):
    """``torch.ops.hsdp.paged_decode``: its schema, fake implementation and compile's view of it
    (strides included) agree with what it computes (torch.library.opcheck), and it equals
    attention by hand for plain, windowed, soft-capped and sinks layers, grouped query heads or
    not, values of another dim; contexts far apart computed in groups; a group whose sequences
    all have one context (no padded slot) computed without a mask."""
    from server.engine import kernels

    g = torch.Generator().manual_seed(0)
    dim, value_dim, slots = 8, 6, 4096
    num_seqs = len(contexts)
    assert (kernels.context_groups(contexts) is None) == (max(contexts) < 256)
    contexts = torch.tensor(contexts)
    longest = int(contexts.max())
    slots_SL = torch.randperm(slots, generator=g)[:num_seqs * longest].view(num_seqs, longest)
    valid_SL = torch.arange(longest)[None, :] < contexts[:, None]
    q = torch.randn(heads, num_seqs, dim, generator=g)
    k, v = torch.randn(kv_heads, slots, dim, generator=g), torch.randn(kv_heads, slots, value_dim, generator=g)
    variants = ((kernels.NO_WINDOW, kernels.NO_SOFTCAP, None), (4, kernels.NO_SOFTCAP, None),
                (kernels.NO_WINDOW, 3.0, None), (6, 2.0, torch.randn(heads, generator=g)))
    for window, softcap, sinks in variants:
        args = (q, k, v, slots_SL, valid_SL, torch.arange(longest), contexts, 0.3, window, softcap, sinks)
        torch.library.opcheck(torch.ops.hsdp.paged_decode.default, args)
        got = torch.ops.hsdp.paged_decode(*args)
        want = _decode_by_hand(q, k, v, slots_SL, contexts, 0.3, window, softcap, sinks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"window {window}, softcap {softcap}")
        assert got.is_contiguous(), got.stride()  # what the fake implementation promises


def test_decode_groups_gather_at_most_twice_their_contexts():
    """One long sequence among short ones: each group gathers at most GROUP_SPREAD x its own
    contexts (or the floor), never the longest context for every sequence."""
    from server.engine.kernels import GROUP_FLOOR, GROUP_SPREAD, context_groups

    contexts = [60] * 63 + [1000]
    groups = context_groups(contexts)
    assert sorted(r for rows in groups for r in rows) == list(range(64))
    gathered = sum(len(rows) * max(contexts[r] for r in rows) for rows in groups)
    assert gathered == 63 * 60 + 1000  # not 64 * 1000
    import random
    rng = random.Random(0)
    for _ in range(200):
        contexts = [rng.choice([rng.randint(1, 50), rng.randint(1, 5000)]) for _ in range(rng.randint(2, 40))]
        groups = context_groups(contexts) or [list(range(len(contexts)))]
        assert sorted(r for rows in groups for r in rows) == list(range(len(contexts)))
        for rows in groups:
            lo, hi = min(contexts[r] for r in rows), max(contexts[r] for r in rows)
            assert hi <= GROUP_SPREAD * max(lo, GROUP_FLOOR), (lo, hi)
