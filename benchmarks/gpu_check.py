"""The GPU check: streaming load, greedy parity and decode throughput on one CUDA device.

    python -m benchmarks.gpu_check --out DIR          # one GPU; about 2 minutes on one H200
    python -m benchmarks.gpu_check --dry-run --out DIR  # the same logic on CPU, a tiny model (tests)
    make gpu-check ARGS="--out DIR"

One process, world size 1, the product's code paths: ``server.group.process_group.init_rank("cuda")`` (NCCL),
``load_hsdp_model`` (page-locked reads, asynchronous copies), ``set_resident_units``, and the
engine the server runs (``server.engine``: scheduler, paged KV cache, batched sampling), and in
phase ``serve`` the server itself. Phases, each timed and recorded; a failure is recorded with its traceback and the phases
that do not need its result still run:

In the order they run (the correctness checks before the compiles, whose cold caches take longest):

1. ``env``         torch, CUDA, GPU, transformers
2. ``checkpoint``  a Llama-shaped model of about 1.1B parameters (GQA, untied head), random bf16
                   weights, written by ``save_pretrained`` in 1 GB files
3. ``load``        the streaming loader against ``from_pretrained(device_map=GPU)``, page cache
                   dropped before each where the machine allows it: seconds, GB/s, peak GPU memory
4. ``residency``   every unit resident, then none: the memory each takes
5. ``parity_bf16`` greedy tokens of the engine against ``generate`` on the same GPU, bf16; where
                   they part, transformers' own top-2 logit margin there (bf16 ties are expected)
6. ``decode``      output tokens/s at 1, 32 and 128 concurrent sequences (128-token prompts, 128
                   new tokens), the engine with every unit resident and with none, against
                   ``generate`` with the same batch: the whole run, and decode steps alone
7. ``prefetch``    the server's default (nothing resident, prefetch depth 2) at the same loads
8. ``step_profile`` cProfile of one-sequence decode steps (``step_profile.txt``)
9. ``sampling_syncs`` host syncs a step: greedy, top log-probabilities, sampled (with a logit bias)
10. ``serve``      ``python -m server --device cuda`` started as users start it: time to ready,
                   greedy tokens over HTTP equal to the in-process engine's, 32 streaming clients,
                   /info, SIGTERM and its exit code (``server.log``)
11. ``parity_fp32`` the engine against ``generate`` in float32 (TF32 off), where the tokens must be equal
12. ``cpu_offload`` ``HSDPInferenceConfig(cpu_offload=True)``: shards in host memory, same tokens
13. ``quantized``   FP8-block, W4A16 and W8A8 tiny checkpoints, and a tiny Qwen3-MoE's FP8 and W4A16
                   experts, loaded on the device (float32): greedy tokens equal to transformers'
                   (``loaders.quantization``'s device path)
14. ``compiled``   decode steps through compiled graphs (``--compile decode``), each region (a
                   layer's graph, the whole forward's) at a static graph a load (1, 32, 128; the
                   device's default in ``--dry-run``): warm-up seconds and graphs (the layers' again,
                   loaded from disk as a second start does), greedy tokens against eager's, tokens/s
                   at each load
15. ``families``   tiny checkpoints of the families whose code paths only CPU tests have run (latent
                   attention's absorbed decodes and expanded chunks, Falcon-RW's and Bloom's ALiBi,
                   soft-capping, sinks, hybrids' per-sequence state) on the device in float32, prompts
                   chunked: greedy tokens equal to transformers' (``GPU_FAMILIES``)
16. ``peer_transfer`` ``shard_engine.transfer`` over NCCL between two processes on cuda:0 and cuda:1
                   (``--load-from-peer``'s path between GPU groups): rows from a 2-shard sender into a
                   1-shard receiver, values and device checksums checked; skipped with one GPU (NCCL
                   takes one rank per GPU); on gloo between two CPU processes in ``--dry-run``

A phase that would start after ``--budget-s`` is recorded as skipped (not failed), and the run is
ok where no phase failed.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` after every phase, so a run cut
short still leaves what it measured.

The device image this was written for has torch 2.11 and transformers 5.17; this project needs
transformers >= 5.24. Carry the wheels (from the repository root, on a machine with pip access):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \\
        transformers==5.24.0 regex==2026.11.19 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \\
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \\
        annotated-doc==0.0.7 typing_extensions==4.16.0 setproctitle==1.3.8 opentelemetry-api==1.45.2 \\
        compressed-tensors==0.20.1 loguru==0.7.3
    # there:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 -m benchmarks.gpu_check --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch

from server.config import CompileSizes, ServeConfig

PROMPT_TOKENS = 128
NEW_TOKENS = 128
CONCURRENCY = (1, 32, 128)
PARITY_PROMPT_LENGTHS = (7, 16, 40, 100)
PARITY_NEW_TOKENS = 32
BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llama_config(dry_run: bool):
    from transformers import LlamaConfig

    if dry_run:
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    # Llama-3.2-1B's shape with a 32k vocabulary: 1.1B parameters
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                       rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id (``w3`` ... ``wN``; 0-2 special): any id the
    random model picks decodes, and a prompt written as words encodes to exactly those ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>")


def as_words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


class PastBudget(Exception):
    """A phase not started before ``--budget-s``: recorded as skipped, not as a failure."""


class Report:
    """Phases and figures, written as JSON and Markdown after every phase."""

    def __init__(self, out: pathlib.Path, meta: dict):
        self.out, self.doc = out, {"meta": meta, "phases": {}}
        out.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def phase(self, name: str):
        log(f"{name} ...")
        entry = self.doc["phases"].setdefault(name, {})
        start = time.perf_counter()
        try:
            yield entry
            entry["ok"] = True
        except PastBudget as e:
            entry["ok"] = None
            entry["skipped"] = str(e)
            log(f"{name} skipped: {e}")
        except Exception as e:  # noqa: BLE001 - recorded; the phases after it still run
            entry["ok"] = False
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()
            log(f"{name} FAILED: {entry['error']}\n{entry['traceback']}")
        finally:
            entry["seconds"] = round(time.perf_counter() - start, 2)
            log(f"{name}: {json.dumps({k: v for k, v in entry.items() if k != 'traceback'})}")
            self.write()

    def write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.doc, indent=2))
        (self.out / "gpu_check.md").write_text(render_markdown(self.doc))


def render_markdown(doc: dict) -> str:
    meta, phases = doc["meta"], doc["phases"]
    lines = ["# GPU check", "", " ".join(f"{k}: {v};" for k, v in meta.items()), ""]
    lines += ["| phase | ok | seconds | figures |", "| --- | --- | --- | --- |"]
    for name, p in phases.items():
        figures = {k: v for k, v in p.items() if k not in ("ok", "seconds", "traceback", "runs", "prompts")}
        ok = "skipped" if p.get("ok") is None and "skipped" in p else "yes" if p.get("ok") else "NO"
        lines.append(f"| {name} | {ok} | {p.get('seconds')} | "
                     f"{json.dumps(figures)[:600]} |")
    decode = phases.get("decode", {}).get("runs")
    if decode:
        lines += ["", "| concurrency | system | output tok/s (whole run) | decode tok/s (decode steps) | "
                  "ratio to generate (whole) | ratio (decode) |", "| --- | --- | --- | --- | --- | --- |"]
        for run in decode:
            lines.append(f"| {run['concurrency']} | {run['system']} | {run['tokens_per_s']} | "
                         f"{run.get('decode_tokens_per_s')} | {run.get('ratio_whole', '')} | "
                         f"{run.get('ratio_decode', '')} |")
    for name in ("parity_bf16", "parity_fp32"):
        prompts = phases.get(name, {}).get("prompts")
        if prompts:
            lines += ["", f"{name}:", ""] + [f"- {json.dumps(p)}" for p in prompts]
    return "\n".join(lines) + "\n"


def drop_page_cache() -> bool:
    """Empty the kernel's page cache so a load reads the disk (root only; False where refused)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def init_world_one(device_type: str) -> torch.device:
    """World size 1 through the server's own ``init_rank`` on a free loopback port."""
    from server.group.process_group import init_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                  "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    os.environ.update(rendezvous)
    try:
        return init_rank(device_type, timeout_s=120)
    finally:
        for key in rendezvous:  # the server started later must not take them for torchrun's
            os.environ.pop(key, None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(count: int, length, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [length] * count if isinstance(length, int) else list(length)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_engine(engine, prompts: list[list[int]], new_tokens: int, *, kv_blocks: int, prefill_tokens: int) -> dict:
    """Greedy generation of ``new_tokens`` per prompt (no end-of-sequence stop) by the server's
    scheduler and this rank engine, stepped as the control loop steps them. Returns the tokens and
    the time of the whole run and of the steps that only decoded."""
    from server.engine import BlockPool, RequestHandle, SamplingParams, Scheduler

    scheduler = Scheduler(pools=[BlockPool(kv_blocks, BLOCK_SIZE, prefix_caching=True)], replicas=[[0]],
                          max_running=max(256, len(prompts)), max_total_tokens=max(map(len, prompts)) + new_tokens,
                          eos_token_ids=set(), max_prefill_tokens=prefill_tokens, max_queued=10_000,
                          idle_wait_s=0.001)
    outs = [[] for _ in prompts]
    finished = [0]

    def deliver_to(i):
        def deliver(event):
            if hasattr(event, "message"):
                raise RuntimeError(f"request {i} failed: {event.message}")
            outs[i].append(event.token_id)
            if event.finish is not None:
                finished[0] += 1
        return deliver

    sync(engine.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        scheduler.submit(RequestHandle(list(prompt), SamplingParams(max_new_tokens=new_tokens), deliver=deliver_to(i)))
    decode_s, decode_tokens, steps, decode_steps = 0.0, 0, 0, 0
    while finished[0] < len(prompts):
        plan = scheduler.next_plan()
        step_start = time.perf_counter()
        result = engine.step(plan)  # its tokens come back to the host: the step has finished
        elapsed = time.perf_counter() - step_start
        scheduler.on_results([result])
        steps += 1
        work = [w for ws in plan.work.values() for w in ws]
        if work and all(w.count == 1 for w in work):
            decode_s += elapsed
            decode_tokens += len(result.tokens)
            decode_steps += 1
        if steps > 100_000:
            raise RuntimeError("the engine does not finish")
    total_s = time.perf_counter() - start
    scheduler.on_results([engine.step(scheduler.next_plan())])  # finished sequences leave the rank
    return {"tokens": outs, "seconds": total_s, "steps": steps, "decode_seconds": decode_s,
            "decode_tokens": decode_tokens, "decode_steps": decode_steps}


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[list[list[int]], float]:
    """transformers' greedy ``generate`` over the prompts as one batch (equal lengths: no padding)."""
    assert len({len(p) for p in prompts}) == 1, "one batch needs prompts of one length"
    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - start


@torch.no_grad()
def compare_greedy(engine, reference_model, prompts, new_tokens, *, kv_blocks: int, prefill_tokens: int) -> dict:
    """The engine's greedy tokens against ``generate``'s, prompt by prompt; where they part, the
    reference's top-2 logit margin at that position (a near tie flips under rounding)."""
    device = engine.device
    ours = run_engine(engine, prompts, new_tokens, kv_blocks=kv_blocks, prefill_tokens=prefill_tokens)["tokens"]
    report = []
    for prompt, got in zip(prompts, ours):
        want, _ = hf_generate(reference_model, [prompt], new_tokens, device)
        want = want[0]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        entry = {"prompt_tokens": len(prompt), "equal": got == want, "first_difference": first}
        if first is not None:
            ids = torch.tensor([prompt + want[:first]], device=device)
            logits = reference_model(input_ids=ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            entry["reference_margin"] = round(float(top.values[0] - top.values[1]), 5)
            entry["logit_scale"] = round(float(logits.abs().max()), 5)
            entry["ours_vs_reference"] = [got[first], want[first]]
        report.append(entry)
    return {"equal": sum(e["equal"] for e in report), "of": len(report), "prompts": report}


def check_server(path: str, device: torch.device, state: dict, prompt_tokens: int, new_tokens: int,
                 prefill_tokens: int, dry: bool, out: pathlib.Path) -> dict:
    """The product as users start it (``python -m server``: launcher, rank process, NCCL, HTTP) on
    this checkpoint: time to ready, greedy tokens over HTTP against the in-process engine's for
    the same prompt alone, 32 concurrent streaming clients, /info, and a clean SIGTERM."""
    import asyncio

    import httpx

    from tests.server_process import ServerProcess, free_port

    figures: dict = {}
    prompt = random_prompts(1, 24, state["vocab"], seed=11)[0]
    expected = run_engine(state["engine"], [prompt], 32, kv_blocks=state["kv_blocks"],
                          prefill_tokens=prefill_tokens)["tokens"][0]
    argv = [sys.executable, "-m", "server", "--model", path, "--device", device.type, "--nproc-per-node", "1",
            "--host", "127.0.0.1"]
    if dry:
        argv += ["--dtype", "float32"]
    port = free_port()
    start = time.perf_counter()
    server = ServerProcess(None, argv=[*argv, "--port", str(port)], port=port, log_path=out / "server.log")
    with server:
        figures["ready_seconds"] = round(time.perf_counter() - start, 2)
        r = server.client.post("/generate", json={"inputs": as_words(prompt),
                                                  "parameters": {"max_new_tokens": 32, "details": True}})
        r.raise_for_status()
        got = [t["id"] for t in r.json()["details"]["tokens"]]
        figures["greedy_equal_to_engine"] = got == expected[:len(got)]
        figures["greedy_tokens"] = len(got)
        if not figures["greedy_equal_to_engine"]:
            figures["greedy"] = {"http": got, "engine": expected}

        async def one(client, prompt_ids):
            sent = time.perf_counter()
            first, count = None, 0
            async with client.stream("POST", "/generate_stream", json={
                    "inputs": as_words(prompt_ids), "parameters": {"max_new_tokens": new_tokens}}) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data:") and '"token"' in line:
                        count += 1
                        first = first or time.perf_counter() - sent
            return first, count

        async def burst(prompts):
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        clients = 4 if dry else 32
        prompts = random_prompts(clients, prompt_tokens, state["vocab"], seed=12)
        begin = time.perf_counter()
        results = asyncio.run(burst(prompts))
        wall = time.perf_counter() - begin
        tokens = sum(c for _, c in results)
        ttfts = sorted(t for t, _ in results if t is not None)
        figures["clients"] = clients
        figures["output_tokens_per_s"] = round(tokens / wall, 1)
        figures["ttft_median_ms"] = round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None
        info = server.client.get("/info").json()
        figures["info_kv_cache"] = info.get("kv_cache")
        figures["info_rank0_memory"] = (info.get("ranks") or [{}])[0].get("memory")
        stop_at = time.perf_counter()
        figures["exit_code"] = server.stop()
        figures["stop_seconds"] = round(time.perf_counter() - stop_at, 2)
    if figures["exit_code"] != 0 or not figures["greedy_equal_to_engine"]:
        raise AssertionError(f"server: exit {figures['exit_code']}, greedy equal {figures['greedy_equal_to_engine']}")
    return figures


def load_ours(path: str, device: torch.device, dtype):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    sync(device)
    loaded = load_hsdp_model(path, HSDPInferenceConfig(), device=device, dtype=dtype)
    sync(device)
    return loaded


def load_reference(path: str, device: torch.device, dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {"device_map": str(device)} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    sync(device)
    return model


def make_engine(model, device: torch.device, kv_blocks: int):
    from server.engine import RankEngine

    return RankEngine(model, device, 0, num_blocks=kv_blocks, block_size=BLOCK_SIZE)


def _phase_env(p: dict, run: Run) -> None:
    dry, state = run.dry, run.state
    p["cuda"] = torch.version.cuda
    if not dry:
        props = torch.cuda.get_device_properties(0)
        p["gpu"] = props.name
        p["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        p["multiprocessors"] = props.multi_processor_count
        with contextlib.suppress(Exception):
            p["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
    p["cpus"] = os.cpu_count()
    # torch's private names the engine relies on, checked on torch 2.13 (the device image may carry another):
    # what is missing is named here, and the phases it breaks fail with it
    from shard_engine.torch_private import check

    try:
        check()  # (over a 1-rank gloo group of its own: before the run's own group)
        p["torch_private"] = "ok"
    except (RuntimeError, ValueError) as e:
        p["torch_private"] = str(e)
    state["device"] = init_world_one("cpu" if dry else "cuda")
    p["device"] = str(state["device"])
    p["threads"] = torch.get_num_threads()


def _phase_checkpoint(p: dict, run: Run) -> None:
    dry, state, path = run.dry, run.state, run.path
    from transformers import AutoModelForCausalLM

    config = llama_config(dry)
    torch.manual_seed(0)
    build_on = torch.device("cuda") if not dry else torch.device("cpu")
    with build_on:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    p["parameters"] = sum(t.numel() for t in model.parameters())
    model.save_pretrained(path, max_shard_size="1GB")
    word_tokenizer(config.vocab_size).save_pretrained(path)  # the server needs one
    del model
    torch.cuda.empty_cache() if not dry else None
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    p["files"], p["bytes"] = len(files), sum(f.stat().st_size for f in files)
    state["vocab"] = config.vocab_size


def _phase_load(p: dict, run: Run) -> None:
    dry, dtype, state, device = run.dry, run.dtype, run.state, run.device
    path = run.path
    p["page_cache_dropped"] = not dry and drop_page_cache()
    start = time.perf_counter()
    loaded = load_ours(path, device, dtype)
    ours_s = time.perf_counter() - start
    stats = loaded.stats
    p["ours_seconds"] = round(ours_s, 3)
    p["ours_gb_per_s"] = round(stats.checkpoint_bytes / ours_s / 1e9, 2)
    p["ours_phases"] = {k: round(v, 3) for k, v in stats.phase_seconds.items()}
    if device.type == "cuda":
        p["ours_peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    p["model_bytes"] = sum(t.numel() * t.element_size() for t in loaded.model.parameters())
    state["ours"] = loaded.model
    if not dry:
        drop_page_cache()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    state["reference"] = load_reference(path, device, dtype)
    ref_s = time.perf_counter() - start
    p["transformers_seconds"] = round(ref_s, 3)
    p["transformers_gb_per_s"] = round(stats.checkpoint_bytes / ref_s / 1e9, 2)
    p["ratio_ours_to_transformers_seconds"] = round(ours_s / ref_s, 3)


def _phase_residency(p: dict, run: Run) -> None:
    kv_bytes, state, device = run.kv_bytes, run.state, run.device
    from server.engine import KVGeometry, size_kv_pool
    from shard_engine import set_resident_units

    residency = set_resident_units(state["ours"], -1)
    p["resident_units"], p["extra_bytes"] = len(residency.units), residency.extra_bytes
    geometry = KVGeometry.of(state["ours"])
    p["kv_bytes_per_token"] = geometry.bytes_per_token
    p["auto_kv_blocks"] = size_kv_pool(None, geometry, BLOCK_SIZE, device)  # what --kv-cache-memory auto takes
    state["kv_blocks"] = size_kv_pool(kv_bytes, geometry, BLOCK_SIZE, device)
    p["kv_blocks"] = state["kv_blocks"]
    state["engine"] = make_engine(state["ours"], device, state["kv_blocks"])


def _phase_parity_bf16(p: dict, run: Run) -> None:
    parity_new, prefill_tokens, state = run.parity_new, run.prefill_tokens, run.state
    prompts = random_prompts(len(PARITY_PROMPT_LENGTHS), PARITY_PROMPT_LENGTHS, state["vocab"], seed=1)
    p.update(compare_greedy(state["engine"], state["reference"], prompts, parity_new,
                            kv_blocks=state["kv_blocks"], prefill_tokens=prefill_tokens))


def _phase_decode(p: dict, run: Run) -> None:
    deadline, concurrency, prompt_tokens, new_tokens = run.deadline, run.concurrency, run.prompt_tokens, run.new_tokens
    prefill_tokens, state, device = run.prefill_tokens, run.state, run.device
    runs = p["runs"] = []
    ours, reference, engine = state["ours"], state["reference"], state["engine"]
    warm = random_prompts(2, prompt_tokens, state["vocab"], seed=2)
    run_engine(engine, warm, 4, kv_blocks=state["kv_blocks"], prefill_tokens=prefill_tokens)  # warm-up
    hf_generate(reference, warm, 4, device)
    for c in concurrency:
        if time.monotonic() > deadline:
            p["skipped"] = f"concurrency {c} and above: past --budget-s"
            break
        prompts = random_prompts(c, prompt_tokens, state["vocab"], seed=100 + c)
        _, prefill_s = hf_generate(reference, prompts, 1, device)
        _, hf_s = hf_generate(reference, prompts, new_tokens, device)
        hf = {"concurrency": c, "system": "transformers generate",
              "tokens_per_s": round(c * new_tokens / hf_s, 1),
              "decode_tokens_per_s": round(c * (new_tokens - 1) / max(hf_s - prefill_s, 1e-9), 1)}
        runs.append(hf)
        for mode, units in (("engine, all resident", -1), ("engine, none resident", 0)):
            from shard_engine import set_resident_units

            set_resident_units(ours, units)
            r = run_engine(engine, prompts, new_tokens, kv_blocks=state["kv_blocks"],
                           prefill_tokens=prefill_tokens)
            entry = {"concurrency": c, "system": mode, "tokens_per_s": round(c * new_tokens / r["seconds"], 1),
                     "decode_tokens_per_s": round(r["decode_tokens"] / max(r["decode_seconds"], 1e-9), 1),
                     "steps": r["steps"]}
            entry["ratio_whole"] = round(entry["tokens_per_s"] / hf["tokens_per_s"], 3)
            entry["ratio_decode"] = round(entry["decode_tokens_per_s"] / hf["decode_tokens_per_s"], 3)
            runs.append(entry)
            log(json.dumps(entry))
        set_resident_units(ours, -1)
    if device.type == "cuda":
        p["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)


def _phase_prefetch(p: dict, run: Run) -> None:
    concurrency, prompt_tokens, new_tokens = run.concurrency, run.prompt_tokens, run.new_tokens
    prefill_tokens = run.prefill_tokens
    state = run.state
    # the server's default: nothing resident, each unit starting the next two units' all-gathers
    from shard_engine import disable_forward_prefetch, enable_forward_prefetch, set_resident_units

    p["links"] = enable_forward_prefetch(state["ours"], depth=2)
    set_resident_units(state["ours"], 0)
    runs = p["runs"] = []
    try:
        for c in concurrency:
            prompts = random_prompts(c, prompt_tokens, state["vocab"], seed=100 + c)
            r = run_engine(state["engine"], prompts, new_tokens, kv_blocks=state["kv_blocks"],
                           prefill_tokens=prefill_tokens)
            runs.append({"concurrency": c, "tokens_per_s": round(c * new_tokens / r["seconds"], 1),
                         "decode_tokens_per_s": round(r["decode_tokens"] / max(r["decode_seconds"], 1e-9), 1)})
            log(json.dumps(runs[-1]))
    finally:
        disable_forward_prefetch(state["ours"])
        set_resident_units(state["ours"], -1)


def _phase_step_profile(p: dict, run: Run) -> None:
    args, prompt_tokens, prefill_tokens, state = run.args, run.prompt_tokens, run.prefill_tokens, run.state
    # where a one-sequence decode step's time goes (all resident): the engine's own overhead
    import cProfile
    import io
    import pstats

    prompts = random_prompts(1, prompt_tokens, state["vocab"], seed=7)
    profiler = cProfile.Profile()
    profiler.enable()
    r = run_engine(state["engine"], prompts, 32, kv_blocks=state["kv_blocks"], prefill_tokens=prefill_tokens)
    profiler.disable()
    p["ms_per_step"] = round(1000 * r["seconds"] / r["steps"], 2)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    (pathlib.Path(args.out) / "step_profile.txt").write_text(text.getvalue())


def _phase_sampling_syncs(p: dict, run: Run) -> None:
    """The host syncs of one sampling call (issue 25, item 3): greedy rows, rows asking for
    alternatives, and sampled rows with every warper and penalty should each cost one (the step's
    single device-to-host copy; the sampled rows' parameters go up from pinned memory,
    ``sampling.to_device``). Counted with torch's CUDA sync debug mode; on CPU (dry run) the calls
    run and nothing is counted. The sampled rows' tokens are checked against the same sampler on
    the CPU (the same uniform draws; a near-tie in the GPU's float order could tell them apart:
    counted, not asserted)."""
    import warnings

    from server.engine.sampling import BatchSampler, Row, SamplingParams

    device = run.device or torch.device("cpu")
    logits = torch.randn(16, 32000, device=device)
    sampler = BatchSampler()
    sampled = SamplingParams(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, min_p=0.02,
                             repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
                             logit_bias={5: 1.5}, seed=7)
    cases = {"greedy": [Row(SamplingParams(max_new_tokens=4), [1, 2], 0) for _ in range(16)],
             "top_logprobs": [Row(SamplingParams(max_new_tokens=4, top_logprobs=5 if i % 4 == 0 else 0), [1, 2], 0)
                              for i in range(16)],
             "sampled": [Row(sampled if i % 2 else SamplingParams(max_new_tokens=4), [1, 2, 3, 2], 2)
                         for i in range(16)]}
    expected = logits.argmax(-1).tolist()
    on_cpu = [t for t, _, _ in BatchSampler().sample(logits.cpu().clone(), cases["sampled"])]
    for name, rows in cases.items():
        copy = logits.clone()  # sample() masks in place
        if device.type != "cuda":
            out = sampler.sample(copy, rows)
            p[f"{name}_syncs"] = None
        else:
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = sampler.sample(copy, rows)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            p[f"{name}_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        tokens = [t for t, _, _ in out]
        if name == "sampled":
            assert tokens[::2] == expected[::2], name  # its greedy rows
            p["sampled_tokens_unlike_cpu"] = sum(a != b for a, b in zip(tokens, on_cpu))
        else:
            assert tokens == expected, name
    if device.type == "cuda":
        assert p["greedy_syncs"] <= 1 and p["top_logprobs_syncs"] <= 1 and p["sampled_syncs"] <= 1, p


def _phase_compiled(p: dict, run: Run) -> None:
    """Decode steps through compiled graphs (``--compile decode``, issue 25), each
    ``--compile-region`` (a decoder layer's graph shared by every layer; the whole forward's), at
    the loads' sizes (:func:`_compile_sizes`): the warm-up's seconds and graphs, the greedy
    tokens against the eager engine's (equal in float32; in bf16 near ties may part), output
    tokens/s at each concurrency against the same engine eager in this phase."""
    state, device = run.state, run.device
    kv, prefill = state["kv_blocks"], run.prefill_tokens
    sizes = _compile_sizes(run, run.concurrency)
    p["sizes"] = str(sizes)
    prompts = random_prompts(len(PARITY_PROMPT_LENGTHS), PARITY_PROMPT_LENGTHS, state["vocab"], seed=1)
    eager_tokens = run_engine(state["engine"], prompts, run.parity_new, kv_blocks=kv, prefill_tokens=prefill)["tokens"]
    loads = {c: random_prompts(c, run.prompt_tokens, state["vocab"], seed=100 + c) for c in run.concurrency}

    def throughput(engine, c):
        r = run_engine(engine, loads[c], run.new_tokens, kv_blocks=kv, prefill_tokens=prefill)
        return {"concurrency": c, "tokens_per_s": round(c * run.new_tokens / r["seconds"], 1),
                "decode_tokens_per_s": round(r["decode_tokens"] / max(r["decode_seconds"], 1e-9), 1),
                "ms_per_decode_step": round(1000 * r["decode_seconds"] / max(1, r["decode_steps"]), 2)}

    p["eager"] = [throughput(state["engine"], c) for c in run.concurrency]
    regions = p["regions"] = {}
    # the layers' graphs kept beside this run's checkpoint: the first warm-up traces, the second loads
    graph_dir = os.path.join(os.path.dirname(run.path), f"layer-graphs-{os.getpid()}")
    for region in ("layer", "model"):
        if time.monotonic() > run.deadline:
            p["skipped"] = f"region {region} and after: past --budget-s"
            break
        engine = make_engine(state["ours"], device, kv)
        r = regions[region] = {"warm_up_s": round(engine.compile_decode(sizes=sizes, region=region,
                                                                        graph_dir=graph_dir), 1),
                               "graphs": engine.compiled.graphs_compiled}
        if region == "layer":  # a second start's warm-up: the layers' graphs loaded from disk; it serves below
            del engine
            engine = make_engine(state["ours"], device, kv)
            r["warm_up_loaded_s"] = round(engine.compile_decode(sizes=sizes, region=region, graph_dir=graph_dir), 2)
            r["graphs_loaded"] = engine.compiled.graphs_loaded
        tokens = run_engine(engine, prompts, run.parity_new, kv_blocks=kv, prefill_tokens=prefill)["tokens"]
        r["tokens_equal_eager"] = sum(a == b for a, b in zip(tokens, eager_tokens))
        r["of"] = len(prompts)
        r["runs"] = [throughput(engine, c) for c in run.concurrency]
        r["compiled_steps"] = engine.compiled.calls
        for got, eager in zip(r["runs"], p["eager"]):
            got["ratio_to_eager"] = round(got["tokens_per_s"] / eager["tokens_per_s"], 3)
        log(json.dumps({region: r}))
        del engine
        if run.dry and r["tokens_equal_eager"] != r["of"]:  # float32: compiled steps are exact
            raise AssertionError(f"--compile-region {region}: {r['tokens_equal_eager']} of {r['of']} prompts' greedy "
                                 "tokens equal to eager's in float32")


def _compile_sizes(run: Run, loads) -> CompileSizes:
    """The decode graphs a compiled phase warms up: the device's default in ``--dry-run`` (CPU: one
    graph for one sequence, one open graph); on a GPU one static graph a load of the phase, not
    the default's 8 (each a cold Triton compile: minutes of a lent device's 15)."""

    if run.dry:
        return ServeConfig().compile_batch_sizes_for(run.device.type)
    return CompileSizes(tuple(sorted(set(loads))))


def _phase_serve(p: dict, run: Run) -> None:
    args, dry, prompt_tokens, new_tokens = run.args, run.dry, run.prompt_tokens, run.new_tokens
    prefill_tokens, state, device, path = run.prefill_tokens, run.state, run.device, run.path
    p.update(check_server(path, device, state, prompt_tokens, new_tokens, prefill_tokens, dry,
                          pathlib.Path(args.out)))


def _phase_parity_fp32(p: dict, run: Run) -> None:
    parity_new, prefill_tokens, state = run.parity_new, run.prefill_tokens, run.state
    device, path = run.device, run.path
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours32 = load_ours(path, device, torch.float32)
    from shard_engine import set_resident_units

    set_resident_units(ours32.model, -1)
    reference32 = load_reference(path, device, torch.float32)
    engine32 = make_engine(ours32.model, device, max(64, state.get("kv_blocks", 64) // 4))
    prompts = random_prompts(len(PARITY_PROMPT_LENGTHS), PARITY_PROMPT_LENGTHS, state["vocab"], seed=1)
    p.update(compare_greedy(engine32, reference32, prompts, parity_new, kv_blocks=engine32.cache.num_blocks,
                            prefill_tokens=prefill_tokens))
    if p["equal"] != p["of"]:
        raise AssertionError(f"float32 greedy tokens differ from transformers' on {p['of'] - p['equal']} prompts")


def _phase_cpu_offload(p: dict, run: Run) -> None:
    dtype, prefill_tokens, state = run.dtype, run.prefill_tokens, run.state
    device, path = run.device, run.path
    # FSDP's CPU offload: shards in host memory, copied in for each unit's forward
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    offloaded = load_hsdp_model(path, HSDPInferenceConfig(cpu_offload=True), device=device, dtype=dtype)
    p["parameter_device"] = str(next(offloaded.model.parameters()).device)
    engine = make_engine(offloaded.model, device, 1024)
    r = run_engine(engine, state["offload_prompts"], 16, kv_blocks=1024, prefill_tokens=prefill_tokens)
    p["tokens_per_s"] = round(2 * 16 / r["seconds"], 1)
    p["equal_to_resident_engine"] = r["tokens"] == state["offload_expected"]
    if not p["equal_to_resident_engine"]:
        raise AssertionError(f"offloaded {r['tokens']} != resident {state['offload_expected']}")


def _phase_quantized(p: dict, run: Run) -> None:
    """Quantized checkpoints (``loaders.quantization``) computed on the device: a tiny Llama as FP8 16x16
    blocks, compressed-tensors W4A16 and W8A8, a tiny Qwen3-MoE's experts as FP8 blocks and W4A16
    (transformers' own load the reference), loaded resident in float32 (TF32 off), greedy tokens
    against transformers in float32 on the same device: for FP8 (experts too) and W4A16 the dense
    checkpoint of the weights transformers' dequantization gives (on a GPU of compute capability
    8.9 or more its FP8 path quantizes activations and multiplies in FP8, which the engine's
    dequantized weights do not), for W8A8 and the W4A16 experts transformers' own load."""
    import tests.quantized_checkpoints as qc
    from shard_engine import set_resident_units
    from tests.checkpoints import write_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    device, root = run.device, pathlib.Path(run.path).parent / "quantized"
    base = write_checkpoint(root / "base", "llama")
    moe = write_checkpoint(root / "moe", "qwen3_moe")
    formats = {"fp8-block-16": (qc.write_fp8_block(root / "fp8", base=base, block=(16, 16)), True),
               "w4a16": (qc.write_compressed_w4a16(root / "w4a16", base=base, group_size=16), True),
               "w8a8": (qc.write_compressed_w8a8(root / "w8a8", base=base), False),
               # MoE experts, the routed ones dequantized a forward (loaders.quantization.experts)
               "fp8-experts": (qc.write_fp8_block(root / "fp8-experts", base=moe, block=(16, 16), experts=True), True),
               "w4a16-experts": (qc.write_compressed_experts(root / "w4a16-experts", base=moe), False)}
    failures = []
    for name, (path, dense_reference) in formats.items():
        ours = load_ours(path, device, torch.float32)
        set_resident_units(ours.model, -1)
        reference_path = qc.write_dequantized(root / f"{name}-dense", path) if dense_reference else path
        reference = load_reference(reference_path, device, torch.float32)
        # these checkpoints' end-of-sequence id is a token like any other: generate's min_new_tokens
        # would forbid it where the engine (no eos here) may choose it
        reference.generation_config.eos_token_id = None
        engine = make_engine(ours.model, device, 64)
        vocab = ours.config.vocab_size
        prompts = random_prompts(3, (5, 9, 14), vocab, seed=5)
        _greedy_case(p, name, failures, engine, reference, prompts, run.parity_new, run.prefill_tokens,
                     layers=ours.stats.quantized_layers)
        del ours, reference, engine
    if failures:
        raise AssertionError(f"quantized greedy tokens differ from transformers' in {failures}")


def _greedy_case(p: dict, name: str, failures: list, engine, reference, prompts, new_tokens: int,
                 prefill_tokens: int, **extra) -> None:
    """One checkpoint's greedy tokens against the reference's (:func:`compare_greedy`, 64 KV
    blocks), timed, recorded as ``p[name]``; ``name`` added to ``failures`` where any differ."""
    start = time.perf_counter()
    entry = compare_greedy(engine, reference, prompts, new_tokens, kv_blocks=64, prefill_tokens=prefill_tokens)
    p[name] = dict(entry, seconds=round(time.perf_counter() - start, 3), **extra)
    if entry["equal"] != entry["of"]:
        failures.append(name)


GPU_FAMILIES = ("deepseek_v3", "falcon_rw", "bloom", "gemma2", "gpt_oss", "qwen3_next", "mamba2", "jamba")
"""Phase families: latent attention (decodes absorbed, chunks expanded), ALiBi through adapters
(Falcon-RW's bf16-rounded bias, Bloom's), soft-capping with windows, sinks with experts, and
hybrids' per-sequence state (gated delta-net, Mamba2, Mamba-1 with attention): the engine's
code paths that only its CPU tests have run."""


COMPILED_FAMILIES = ("bloom", "qwen3_next", "mamba2")
"""Of :data:`GPU_FAMILIES`, those phase families also decodes through compiled layers (``--compile
decode``, the device's default sizes): an adapter's attention, and stateful layers whose states are
their graphs' inputs (with mamba-ssm / flash-linear-attention's kernels where installed). The dry
run compiles the first only."""


def _phase_families(p: dict, run: Run) -> None:
    """tests.test_families' tiny checkpoints of :data:`GPU_FAMILIES` on the device, resident in
    float32 (TF32 off), prompts of 21, 34 and 9 tokens in chunks of 16 and decoded together:
    greedy tokens against transformers' ``generate`` on the same device (eager attention, or
    the family's REFERENCE_ATTENTION; on CUDA transformers finds the stateful layers' kernels
    where they are installed, and so does the engine, which runs the modules' own dispatch)."""
    from shard_engine import set_resident_units
    from transformers import AutoModelForCausalLM

    from tests.test_families import _reference_attention, _write

    torch.backends.cuda.matmul.allow_tf32 = False
    device, root = run.device, pathlib.Path(run.path).parent / "families"
    failures = []
    for family in GPU_FAMILIES:
        path = _write(family, root / family)
        ours = load_ours(path, device, torch.float32)
        set_resident_units(ours.model, -1)
        kwargs = {"device_map": str(device)} if device.type == "cuda" else {}
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         attn_implementation=_reference_attention(family),
                                                         **kwargs).eval()
        reference.generation_config.eos_token_id = None  # (as phase quantized: no end of sequence)
        engine = make_engine(ours.model, device, 64)
        prompts = random_prompts(3, (21, 34, 9), ours.config.get_text_config().vocab_size, seed=11)
        _greedy_case(p, family, failures, engine, reference, prompts, 8, 16)
        if family in (COMPILED_FAMILIES[:1] if run.dry else COMPILED_FAMILIES):
            engine = make_engine(ours.model, device, 64)
            warm_up_s = engine.compile_decode(sizes=_compile_sizes(run, (1, 4)), region="layer", graph_dir="")
            warm_up_calls = engine.compiled.calls
            _greedy_case(p, f"{family}-compiled", failures, engine, reference, prompts, 8, 16,
                         warm_up_s=round(warm_up_s, 1))
            p[f"{family}-compiled"]["compiled_steps"] = engine.compiled.calls - warm_up_calls
        del ours, reference, engine
    if failures:
        raise AssertionError(f"greedy tokens differ from transformers' in {failures}")


def _peer_rank(index: int, port: int, backend: str, out: str) -> None:
    """One side of phase peer_transfer: transfer rank 0 sends (two shards' rows in one process: its
    held rows are both shards'), rank 1 receives; each writes what it saw."""
    import datetime

    import torch.distributed as dist

    from shard_engine import transfer

    device = torch.device("cuda", index) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=index == 0, timeout=datetime.timedelta(seconds=60))
    slots = [transfer.Slot("w", (1000, 512), "bfloat16", True), transfer.Slot("b", (7,), "float32", False)]
    gen = torch.Generator().manual_seed(0)
    whole = {"w": torch.randn(1000, 512, generator=gen).to(torch.bfloat16), "b": torch.randn(7, generator=gen)}
    group = transfer.open_transfer_group(store, "gpu-check", index, 2, backend, 60, device if backend == "nccl" else None)
    plan = transfer.transfer_plan(slots, (1, 1), (1, 1))
    if index == 0:
        held = {name: (t.to(device), 0) for name, t in whole.items()}
        result = {"sent": transfer.send_pieces(group, 0, slots, plan, held)}
    else:
        got = {name: t.cpu() for name, t in transfer.receive_pieces(group, 1, slots, plan, device)}
        result = {"equal": all(torch.equal(got[n], whole[n]) for n in whole)}
    with open(f"{out}/peer-{index}.json", "w") as f:
        json.dump(result, f)


def _phase_peer_transfer(p: dict, run: Run) -> None:
    import torch.multiprocessing as mp

    from tests.server_process import free_port

    backend = "gloo" if run.dry else "nccl"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        p["skipped"] = f"needs 2 GPUs (NCCL takes one rank per GPU); {torch.cuda.device_count()} visible"
        return
    out = tempfile.mkdtemp(prefix="gpu-check-peer-")
    start = time.perf_counter()
    mp.start_processes(_peer_rank, args=(free_port(), backend, out), nprocs=2, join=True, start_method="spawn")
    p["backend"], p["seconds"] = backend, round(time.perf_counter() - start, 3)
    with open(f"{out}/peer-0.json") as f0, open(f"{out}/peer-1.json") as f1:
        p["sender"], p["receiver"] = json.load(f0), json.load(f1)
    if not p["receiver"]["equal"]:
        raise AssertionError("the rows received differ from those sent")


@dataclass
class Run:
    """What the phases share: this run's settings, and what earlier phases leave in ``state``."""

    args: argparse.Namespace
    dry: bool
    deadline: float
    concurrency: tuple
    prompt_tokens: int
    new_tokens: int
    parity_new: int
    dtype: torch.dtype
    kv_bytes: int
    prefill_tokens: int
    report: Report
    state: dict = field(default_factory=dict)
    device: torch.device | None = None
    path: str = ""


def _settings(args: argparse.Namespace) -> Run:
    import transformers

    dry = args.dry_run
    dtype = torch.float32 if dry else torch.bfloat16
    prefill_tokens = ServeConfig().prefill_tokens_for("cpu" if dry else "cuda")  # the server's default there
    report = Report(pathlib.Path(args.out), {
        "dry_run": dry, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "dtype": str(dtype).removeprefix("torch."),
        "prefill_tokens_per_step": prefill_tokens, "kv_block_size": BLOCK_SIZE,
    })
    return Run(args=args, dry=dry, deadline=time.monotonic() + args.budget_s,
               concurrency=(1, 4) if dry else CONCURRENCY,
               prompt_tokens=16 if dry else PROMPT_TOKENS, new_tokens=8 if dry else NEW_TOKENS,
               parity_new=8 if dry else PARITY_NEW_TOKENS, dtype=dtype,
               kv_bytes=(64 << 20) if dry else (16 << 30), prefill_tokens=prefill_tokens, report=report)


def _offload_expectation(run: Run) -> None:
    """What the CPU-offloaded model must answer (phase cpu_offload), from the resident engine."""
    state = run.state
    with contextlib.suppress(Exception):
        state["offload_prompts"] = random_prompts(2, run.prompt_tokens, state["vocab"], seed=9)
        expected = run_engine(state["engine"], state["offload_prompts"], 16, kv_blocks=state["kv_blocks"],
                              prefill_tokens=run.prefill_tokens)
        state["offload_expected"] = expected["tokens"]


def _run_phase(report: Report, name: str, phase, run: Run) -> None:
    """One phase, recorded; skipped where ``--budget-s`` has passed before it starts."""
    with report.phase(name) as p:
        if time.monotonic() > run.deadline:
            raise PastBudget("past --budget-s")
        phase(p, run)


def _empty_cache(run: Run) -> None:
    if run.device is not None and run.device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, few tokens: the logic only")
    parser.add_argument("--budget-s", type=float, default=480, help="phases not started by then are skipped")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run to check the logic on CPU")
    faulthandler.dump_traceback_later(args.budget_s + 120, exit=True)  # never hang the lease
    run = _settings(args)
    report = run.report
    with report.phase("env") as p:
        _phase_env(p, run)
    run.device = run.state.get("device")
    run.path = str(pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-")) / "llama-1b")
    phases = [("checkpoint", _phase_checkpoint), ("load", _phase_load), ("residency", _phase_residency),
              ("parity_bf16" if not run.dry else "parity_dtype", _phase_parity_bf16), ("decode", _phase_decode),
              ("prefetch", _phase_prefetch), ("step_profile", _phase_step_profile),
              ("sampling_syncs", _phase_sampling_syncs)]
    for name, phase in phases:
        _run_phase(report, name, phase, run)
    _offload_expectation(run)
    _run_phase(report, "serve", _phase_serve, run)
    run.state.pop("reference", None)
    _empty_cache(run)
    # the correctness checks before the compiles, whose cold caches take the longest (the bf16 model and its
    # eager engine are kept for phase compiled)
    for name, phase in (("parity_fp32", _phase_parity_fp32), ("cpu_offload", _phase_cpu_offload),
                        ("quantized", _phase_quantized), ("compiled", _phase_compiled)):
        _run_phase(report, name, phase, run)
    for key in ("engine", "ours"):
        run.state.pop(key, None)
    _empty_cache(run)
    for name, phase in (("families", _phase_families), ("peer_transfer", _phase_peer_transfer)):
        _run_phase(report, name, phase, run)

    report.doc["ok"] = all(ph.get("ok") is not False for ph in report.doc["phases"].values())
    report.doc["skipped"] = [name for name, ph in report.doc["phases"].items() if ph.get("ok") is None]
    report.doc["complete"] = not report.doc["skipped"]  # (ok with phases skipped checked less: say so)
    report.write()
    log(f"wrote {args.out}/gpu_check.json and gpu_check.md; ok={report.doc['ok']}, complete={report.doc['complete']}"
        + (f" (skipped past --budget-s: {', '.join(report.doc['skipped'])})" if report.doc["skipped"] else ""))
    with contextlib.suppress(Exception):
        from server.group.process_group import close_rank

        close_rank()
    faulthandler.cancel_dump_traceback_later()
    return 0 if report.doc["ok"] else 1

if __name__ == "__main__":
    sys.exit(main())
