"""The sharded decode step against its floor, on CPU ranks (gloo).

    python -m benchmarks.step [--model DIR|deep-tiny|mla-tiny|gqa-tiny|moe-fp8|moe-w4a16] [--nproc 2] [--batches 1,16] [--context 48] [--steps 24]
                              [--modes sharded,prefetch1,prefetch,shm,resident] [--repeats 3] [--profile DIR]

Each rank loads the checkpoint sharded (load_hsdp_model), owns ``batch`` sequences of ``context``
prompt tokens, prefills them, and times ``steps`` decode steps of the real engine
(server.engine: the scheduler's plan, one packed forward over the paged KV cache, batched token
selection), median per step,
best of --repeats interleaved rounds:

  sharded    every unit gathers its parameters in its own pre-forward (FSDP2's default)
  prefetch1  each unit's pre-forward starts the next unit's all-gather (asynchronous on gloo)
  prefetch   ... the next two units' (depth 2), all-gathers over gloo
  shm        prefetch depth 2, all-gathers through shared memory, the leaf units through its two-slot
             unit ring (no copy-out): the server's CPU setting with --resident-units 0
  resident   every unit keeps its gathered parameters (set_resident_units(model, -1))
  shared     every unit resident in one shared copy per host, each rank's shards views of it
             (set_resident_units(model, -1, shared=True): the server's CPU default)
  compiled   shared, and decode steps through compiled decoder layers (--compile decode,
             server.engine.compiled, its default region); its compile seconds are reported beside it
  compiled-model  ... through one compiled forward of the whole model (--compile-region model)

The floor of a sharded step is the larger of
  memcpy      one copy of the bytes a forward gathers, on every rank at once (gathering them
              through shared memory cannot cost less); gloo's raw all_gather_into_tensor of the
              same bytes is reported beside it
  unsharded   the same decode step on the unsharded model (from_pretrained on every rank, the
              same per-rank batch, both ranks computing at once as they do when sharded)
and each mode is reported as its ratio to the floor; ``resident``, ``shared`` and ``compiled`` (nothing
gathered) as their ratio to the unsharded step. Targets: 1.1x resident, 1.3x the others. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.models import (bench_checkpoint, compute_dtype, deep_tiny_bloom_checkpoint, deep_tiny_checkpoint,
                               deep_tiny_lfm2_checkpoint, deep_tiny_qwen3_5_checkpoint, deep_tiny_rwkv_checkpoint,
                               deep_tiny_xlstm_checkpoint, gqa_checkpoint, mla_checkpoint,
                               moe_fp8_checkpoint,
                               moe_w4a16_checkpoint, parameter_count)
from tests.dist import run_ranks, values

MODES = ("sharded", "prefetch1", "prefetch", "shm", "resident", "shared", "compiled", "compiled-model")
COMPILED_MODES = {"compiled": "layer", "compiled-model": "model"}  # their --compile-region
RESIDENT_MODES = ("resident", "shared", *COMPILED_MODES)  # nothing gathered: reported against the unsharded step
TARGETS = {"resident": 1.1, "shared": 1.1, "compiled": 1.1, "compiled-model": 1.1}  # of the floor; every other
# mode: DEFAULT_TARGET
DEFAULT_TARGET = 1.3


def log(msg: str) -> None:
    print(f"[step] {msg}", file=sys.stderr, flush=True)


def time_decode(model, rank: int, batch: int, context: int, steps: int, vocab: int, profile_path=None,
                compiled=None, pool_batch: int | None = None) -> dict:
    """Median seconds per decode step of ``batch`` sequences on this rank: the real engine's step
    (a local scheduler's plan, the rank engine's packed forward over the paged KV cache, batched
    sampling, the scheduler taking the tokens back). The KV pool is sized for ``pool_batch``
    sequences (default ``batch``): one size for every batch of a run, as the server's pool is,
    so a compiled forward is not compiled again for a new pool."""
    from server.engine import BlockPool, RankEngine, RequestHandle, SamplingParams, Scheduler

    gen = torch.Generator().manual_seed(1234 + rank)
    block_size = 16
    blocks = (pool_batch or batch) * (-(-(context + steps + 8) // block_size) + 1)
    # every rank runs the same plans on its own (rank 0 of its own one-rank scheduler), so the
    # forwards, hence the collectives inside them, stay matched
    engine = RankEngine(model, torch.device("cpu"), 0, num_blocks=blocks, block_size=block_size)
    # one CompiledDecode per model: compiled by its first warm-up, reused after
    compile_s = engine.compile_decode(compiled) if compiled is not None else None
    scheduler = Scheduler(pools=[BlockPool(blocks, block_size, prefix_caching=False)], replicas=[[0]],
                          max_running=batch, max_total_tokens=context + steps + 16, eos_token_ids=set(),
                          max_prefill_tokens=batch * context, idle_wait_s=0.01)
    for _ in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        scheduler.submit(RequestHandle(prompt, SamplingParams(max_new_tokens=steps + 8), deliver=lambda e: None))

    def step() -> int:
        plan = scheduler.next_plan()
        result = engine.step(plan)
        scheduler.on_results([result])
        return len(result.tokens)

    for _ in range(3):  # prefill, then warm-up decode steps
        step()
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        produced = step()
        times.append(time.perf_counter() - t0)
        assert produced == batch
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    return {"median_s": statistics.median(times), "min_s": min(times), "steps": steps, "compile_s": compile_s}


def time_memcpy(nbytes: int, repeats: int) -> dict:
    """One copy of ``nbytes`` from one buffer into another on this rank, every rank at once
    (median of ``repeats``): what gathering the bytes costs at best when every rank of the host
    reads them from shared memory."""
    import torch.distributed as dist

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "bytes": src.numel() * 2,
            "gb_per_s": src.numel() * 2 / statistics.median(times) / 1e9}


def time_all_gather(nbytes: int, repeats: int) -> dict:
    """One raw all_gather_into_tensor whose output is ``nbytes`` (bf16), median of ``repeats``."""
    import torch.distributed as dist

    world = dist.get_world_size()
    numel = nbytes // 2 // world * world
    out = torch.empty(numel, dtype=torch.bfloat16)
    inp = torch.ones(numel // world, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, inp)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, inp)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "bytes": numel * 2, "gb_per_s": numel * 2 / statistics.median(times) / 1e9}


def _reset_all_gather(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    from shard_engine.torch_private import default_all_gather

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(default_all_gather())


def gathered_bytes(model) -> int:
    """Bytes of every sharded parameter once gathered: what one forward all-gathers."""
    from torch.distributed.tensor import DTensor

    return sum(p.numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor))


def rank_body(rank: int, world: int, model_dir: str, batches: list[int], context: int, steps: int,
              modes: list[str], profile_dir: str | None, repeats: int, dtype: str) -> dict:
    import torch.distributed as dist

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig, disable_forward_prefetch, enable_forward_prefetch
    from shard_engine import enable_shared_memory_all_gather, set_resident_units, slots_for_depth

    from server.group.memory import release_freed_memory, tune_allocator

    tune_allocator()  # as the server's ranks do
    loaded = load_hsdp_model(model_dir, HSDPInferenceConfig(), device=torch.device("cpu"), dtype=dtype)
    release_freed_memory()
    model, vocab = loaded.model, loaded.config.vocab_size
    nbytes = gathered_bytes(model)
    out: dict = {"threads": torch.get_num_threads(), "gathered_bytes": nbytes, "modes": {}}
    pool = None
    compiled = {}  # per compiled mode
    for round_ in range(repeats):
        # rounds interleave the modes, and each figure is the best round's: the machine's noise
        # only ever slows a run down
        for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
            disable_forward_prefetch(model)
            if pool is not None:  # a fresh pool per shm round: its unit ring takes the units sharded then
                _reset_all_gather(model)
                pool.close()
                pool = None
            residency = set_resident_units(model, -1 if mode in RESIDENT_MODES else 0,
                                           shared=mode == "shared" or mode in COMPILED_MODES)
            if mode.startswith("prefetch") or mode == "shm":
                enable_forward_prefetch(model, depth=int(mode.removeprefix("prefetch").removeprefix("shm") or 2))
            if mode == "shm":
                pool = enable_shared_memory_all_gather(model, slots=slots_for_depth(2))
                assert pool is not None, "shared memory all-gather not available"
            if mode in COMPILED_MODES and mode not in compiled:
                from server.config import CompileSizes
                from server.engine.compiled import CompiledDecode

                # each batch its own static graph: nothing padded
                compiled[mode] = CompiledDecode(model, CompileSizes(tuple(sorted(set(batches)))), COMPILED_MODES[mode])
            results = out["modes"].setdefault(mode, {"resident_extra_bytes": residency.extra_bytes})
            for b in batches:
                timing = time_decode(model, rank, b, context, steps, vocab,
                                     profile_dir and os.path.join(profile_dir, f"{mode}-b{b}-rank{rank}.prof"),
                                     compiled=compiled.get(mode), pool_batch=max(batches))
                if b not in results or timing["median_s"] < results[b]["median_s"]:
                    results[b] = timing
                if timing["compile_s"] is not None:  # the first warm-up compiled; later ones found the graphs
                    out.setdefault("warm_up_s", {}).setdefault(mode, timing["compile_s"])
    disable_forward_prefetch(model)
    set_resident_units(model, 0)
    if pool is not None:
        _reset_all_gather(model)
        pool.close()
    out["all_gather"] = time_all_gather(nbytes, repeats=max(steps, 8) * repeats)
    out["memcpy"] = time_memcpy(nbytes, repeats=max(steps, 8) * repeats)
    del model, loaded
    dist.barrier()
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    dist.barrier()
    out["unsharded"] = {}
    for _ in range(repeats):
        for b in batches:
            timing = time_decode(full, rank, b, context, steps, vocab)
            if b not in out["unsharded"] or timing["median_s"] < out["unsharded"][b]["median_s"]:
                out["unsharded"][b] = timing
    return out


def summarize(per_rank: list[dict], batches: list[int], modes: list[str]) -> dict:
    """Per batch: each mode's step (the slowest rank's median: the step waits for it), the floor,
    and the ratios."""
    def slowest(get) -> float:
        return max(get(r) for r in per_rank)

    gather_s = slowest(lambda r: r["all_gather"]["median_s"])
    memcpy_s = slowest(lambda r: r["memcpy"]["median_s"])
    table = {}
    for b in batches:
        unsharded_s = slowest(lambda r: r["unsharded"][b]["median_s"])
        # a sharded step cannot beat moving its gathered bytes once, nor the unsharded step;
        # a resident one has nothing to gather
        floor_s = max(memcpy_s, unsharded_s)
        row = {"floor_s": round(floor_s, 4), "memcpy_s": round(memcpy_s, 4), "gloo_all_gather_s": round(gather_s, 4),
               "unsharded_s": round(unsharded_s, 4)}
        for mode in modes:
            step_s = slowest(lambda r: r["modes"][mode][b]["median_s"])
            row[f"{mode}_s"] = round(step_s, 4)
            row[f"{mode}_ratio"] = round(step_s / (unsharded_s if mode in RESIDENT_MODES else floor_s), 3)
        row["target_met"] = {mode: row[f"{mode}_ratio"] <= TARGETS.get(mode, DEFAULT_TARGET) for mode in modes}
        table[b] = row
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory, or deep-tiny (the 24-layer 1M Llama, "
                        "benchmarks.models.deep_tiny_checkpoint), deep-tiny-bloom (its shape as a Bloom: ALiBi "
                        "through the attention adapter), deep-tiny-lfm2 (as an LFM2 hybrid: a state a sequence), deep-tiny-qwen3_5 (as a Qwen3.5 "
                        "hybrid: gated delta-nets), deep-tiny-xlstm / deep-tiny-rwkv (as an xLSTM or an RWKV-4: a state a layer, no "
                        "attention), mla-tiny / gqa-tiny (DeepSeek-V3-shaped latent "
                        "attention and a Llama of its size: the MLA step against GQA's), moe-fp8 (a Qwen3-MoE of "
                        "64 experts, 8 a token, stored in FP8 blocks), moe-w4a16 (the same as compressed-tensors INT4) (default: the 80M bench Llama; each generated once)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batches", default="1,16", help="per-rank batch sizes (default 1,16)")
    parser.add_argument("--context", type=int, default=48, help="prompt tokens per sequence (default 48)")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps (default 24)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the modes; best kept (default 3)")
    parser.add_argument("--profile", metavar="DIR", help="write a cProfile of each timed run per rank")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bf16 where the CPU has native bf16, else float32")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    named = {"deep-tiny": deep_tiny_checkpoint, "deep-tiny-bloom": deep_tiny_bloom_checkpoint,
             "deep-tiny-lfm2": deep_tiny_lfm2_checkpoint, "deep-tiny-qwen3_5": deep_tiny_qwen3_5_checkpoint,
             "deep-tiny-xlstm": deep_tiny_xlstm_checkpoint, "deep-tiny-rwkv": deep_tiny_rwkv_checkpoint,
             "mla-tiny": mla_checkpoint, "gqa-tiny": gqa_checkpoint,
             "moe-fp8": moe_fp8_checkpoint, "moe-w4a16": moe_w4a16_checkpoint}
    model_dir = named[args.model]() if args.model in named else args.model or bench_checkpoint()
    dtype = compute_dtype(args.dtype)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    log(f"{model_dir}: {parameter_count(model_dir) / 1e6:.1f}M parameters, {dtype}, {args.nproc} ranks, "
        f"batches {batches}")
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = values(run_ranks(rank_body, args.nproc, pathlib.Path(tmp), model_dir, batches, args.context,
                                    args.steps, modes, args.profile, args.repeats, dtype, timeout=3600,
                                    pg_timeout_s=600))
    report = {
        "model": model_dir, "parameters": parameter_count(model_dir), "dtype": dtype, "nproc": args.nproc,
        "threads_per_rank": per_rank[0]["threads"], "context": args.context, "steps": args.steps,
        "repeats": args.repeats,
        "gathered_bytes_per_forward": per_rank[0]["gathered_bytes"],
        "all_gather_gb_per_s": round(min(r["all_gather"]["gb_per_s"] for r in per_rank), 3),
        "memcpy_gb_per_s": round(min(r["memcpy"]["gb_per_s"] for r in per_rank), 3),
        "resident_extra_bytes_per_rank": per_rank[0]["modes"].get("resident", {}).get("resident_extra_bytes"),
        "target_ratios": {**{m: DEFAULT_TARGET for m in modes}, **TARGETS},
        "per_rank_batch": summarize(per_rank, batches, modes),
        # each compiled mode's first warm-up (the graphs compiled), the slowest rank's
        "compile_warm_up_s": {mode: round(max(r["warm_up_s"][mode] for r in per_rank), 1)
                              for mode in modes if mode in COMPILED_MODES},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
