"""A burst of long prompts, and repeated long prefixes, against the real server.

    python -m benchmarks.long_prompts [--model DIR] [--requests 32] [--prompt-tokens 4000]
                                      [--kv-cache-memory SIZE] [--check 4] [--prefix-tokens 1500]

1. Burst: ``--requests`` streamed requests of about ``--prompt-tokens`` tokens each, all at once,
   on 2 CPU ranks with ``--max-input-tokens 4096 --max-total-tokens 4200`` and the given KV
   budget (default: the server's own, auto). Reports every status (200, or 429/503 with
   Retry-After, counted apart), whether the group is alive afterwards (/health), the process
   tree's peak RSS and PSS sampled every 0.25 s, what each rank reports of its memory (/info),
   and, for the first ``--check`` requests, whether the tokens equal transformers' greedy
   ``generate`` on the same checkpoint.
2. Prefix: requests that share a ``--prefix-tokens`` prefix (different tails), one after the
   other: time to first token of the first and of the repeats, and their ratio.

Default model: the embedded default (SmolLM2-135M-Instruct, 8192 positions). Prints one JSON
document; the dtype is the server's (`--dtype auto`) and is printed with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time

import httpx

from tests.server_process import ServerProcess, session_pids

WORDS = ("river mountain quiet ledger orbit copper garden signal harbor lantern meadow thunder velvet "
         "pioneer crystal summit canyon ember glacier horizon island jungle kernel lattice marble nectar "
         "oasis prism quartz rhythm saddle timber umbrella vortex willow yonder zephyr").split()


def make_prompt(tokenizer, tokens: int, seed: int, prefix: str = "") -> str:
    rng = random.Random(seed)
    words = []
    while True:
        words += [rng.choice(WORDS) for _ in range(256)]
        text = prefix + " ".join(words)
        if len(tokenizer(text, add_special_tokens=False).input_ids) >= tokens:
            ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
            return tokenizer.decode(ids)


class TreeSampler:
    """Peak RSS and PSS of every process of a session, sampled on a thread."""

    def __init__(self, sid: int, period: float = 0.25):
        self.sid, self.period = sid, period
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            rss = pss = 0
            for pid in session_pids(self.sid):
                try:
                    with open(f"/proc/{pid}/smaps_rollup") as f:
                        for line in f:
                            if line.startswith("Rss:"):
                                rss += int(line.split()[1]) * 1024
                            elif line.startswith("Pss:"):
                                pss += int(line.split()[1]) * 1024
                except OSError:
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        return {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss}


async def stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    out = {"status": None, "ttft_s": None, "text": "", "retry_after": None}
    try:
        async with client.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
            out["status"] = r.status_code
            out["retry_after"] = r.headers.get("retry-after")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out["error"] = str(event["error"])[:200]
                    continue
                text = event["choices"][0]["text"] if event.get("choices") else ""
                if text and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - start
                out["text"] += text
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["e2e_s"] = time.perf_counter() - start
    return out


async def burst(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        return await asyncio.gather(*[stream_one(client, p, max_tokens) for p in prompts])


async def one_by_one(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        return [await stream_one(client, p, max_tokens) for p in prompts]


def reference_texts(model_dir: str, prompts: list[str], max_tokens: int, dtype) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--check", type=int, default=4, help="requests whose tokens are compared with transformers")
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--prefix-repeats", type=int, default=4)
    parser.add_argument("--skip-burst", action="store_true")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bf16 where the CPU has native bf16, else float32 (exactness is only "
                             "meaningful in float32: bf16 rounding depends on how a prompt is chunked)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks.models import compute_dtype
    from loaders.sources import resolve_model

    model_dir = args.model or resolve_model(None).path
    dtype = compute_dtype(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    report: dict = {"model": model_dir, "dtype": dtype, "cpu_count": os.cpu_count()}
    extra = ["--max-input-tokens", "4096", "--max-total-tokens", "4200", "--dtype", dtype, "--log-level", "warning"]
    if args.kv_cache_memory:
        extra += ["--kv-cache-memory", args.kv_cache_memory]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(model_dir, extra_args=tuple(extra), log_path=os.path.join(tmp, "server.log"))
        try:
            server.poll_ready(timeout=600)
            if not args.skip_burst:
                prompts = [make_prompt(tokenizer, args.prompt_tokens, seed) for seed in range(args.requests)]
                sampler = TreeSampler(server.proc.pid)
                start = time.perf_counter()
                results = asyncio.run(burst(server.url, prompts, args.max_tokens))
                elapsed = time.perf_counter() - start
                memory = sampler.stop()
                statuses: dict = {}
                for r in results:
                    statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
                health = server.client.get("/health").status_code
                info = server.client.get("/info").json()
                report["burst"] = {
                    "requests": args.requests, "prompt_tokens": args.prompt_tokens, "seconds": round(elapsed, 1),
                    "statuses": statuses, "errors": [r["error"] for r in results if r.get("error")][:5],
                    "refused_without_retry_after": sum(1 for r in results if r["status"] in (429, 503)
                                                       and not r["retry_after"]),
                    "health_after": health, **memory,
                    "ranks": [{"rank": r["rank"], "memory": r.get("memory"), "kv_blocks": r.get("kv_blocks")}
                              for r in info["ranks"]],
                    "preemptions": info["kv_cache"]["preemptions"],
                    "ttft_p50_s": sorted(r["ttft_s"] or 0 for r in results)[len(results) // 2],
                }
                print(f"[long] burst: {statuses} in {elapsed:.0f} s, health {health}", file=sys.stderr, flush=True)
                if args.check:
                    import torch

                    expected = reference_texts(model_dir, prompts[: args.check], args.max_tokens, getattr(torch, dtype))
                    report["burst"]["exact"] = [r["text"] == e for r, e in zip(results, expected)]
            if args.prefix_tokens:
                prefix = make_prompt(tokenizer, args.prefix_tokens, 999) + " "
                tails = [f"question {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(8))
                         for i in range(args.prefix_repeats + 1)]
                results = asyncio.run(one_by_one(server.url, [prefix + t for t in tails], args.max_tokens))
                first, repeats = results[0]["ttft_s"], [r["ttft_s"] for r in results[1:]]
                report["prefix"] = {"prefix_tokens": args.prefix_tokens, "first_ttft_s": round(first, 3),
                                    "repeat_ttft_s": [round(t, 3) for t in repeats],
                                    "ratio": round(sorted(repeats)[len(repeats) // 2] / first, 3)}
                print(f"[long] prefix: first {first:.2f} s, repeats {repeats}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
