"""Output throughput while an update rolls across a group's replicas, against steady state, in one run.

    python -m benchmarks.roll_throughput [--model DIR] [--concurrency 16] [--new-tokens 48]
                                         [--steady-s 8] [--rounds 2] [--out FILE]

A server of 2 CPU ranks as 2 replicas of 1 rank each (``--replicate-size 2 --shard-size 1``: each
rank holds the whole model, and an update rolls: one replica at a time, ``server.weights``) on the
benchmark Llama (``benchmarks.models.bench_checkpoint``: 78.5M parameters, bf16). ``--concurrency``
closed-loop clients stream ``/generate_stream`` requests of ``--new-tokens`` tokens (no stop)
without pause; every token's arrival time is kept. Each round: ``--steady-s`` seconds of load
alone, then ``POST /admin/weights`` (mode ``wait``: running sequences finish on the old weights)
to the same checkpoint's files under another directory, alternating. Throughput during the roll
(output tokens/s from the update's request to its answer) against the steady window before it.
Every request must succeed (a lost or failed one is counted). Issue 29's target: >= 0.45x.
Prints one JSON document; the dtype is printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

TARGET = 0.45


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


async def _load(url: str, concurrency: int, new_tokens: int, stop: asyncio.Event, arrivals: list[float],
                failures: list[str]) -> int:
    """Closed-loop streaming clients until ``stop``; returns the requests completed."""
    import httpx

    done = 0

    async def client_loop(i: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while not stop.is_set():
                body = {"inputs": f"client {i} request {done}: once upon a time",
                        "parameters": {"max_new_tokens": new_tokens, "stop": [], "decoder_input_details": False}}
                try:
                    async with client.stream("POST", "/generate_stream", json=body) as r:
                        if r.status_code != 200:
                            failures.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                            continue
                        async for line in r.aiter_lines():
                            if line.startswith("data:"):
                                event = json.loads(line[5:])
                                if "error" in event:
                                    failures.append(event["error"])
                                    break
                                arrivals.append(time.perf_counter())
                    done += 1
                except httpx.HTTPError as e:
                    failures.append(f"{type(e).__name__}: {e}")

    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return done


def _rate(arrivals: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in arrivals) / (end - start)


async def _run(url: str, sources: list[str], args) -> dict:
    import httpx

    arrivals: list[float] = []
    failures: list[str] = []
    stop = asyncio.Event()
    load = asyncio.create_task(_load(url, args.concurrency, args.new_tokens, stop, arrivals, failures))
    rounds = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as admin:
        await asyncio.sleep(3)  # every client in flight
        for i in range(args.rounds):
            steady_start = time.perf_counter()
            await asyncio.sleep(args.steady_s)
            began = time.perf_counter()
            r = await admin.post("/admin/weights", json={"source": sources[i % 2], "version": f"v{i}"})
            ended = time.perf_counter()
            r.raise_for_status()
            steady = _rate(arrivals, steady_start, began)
            during = _rate(arrivals, began, ended)
            rounds.append({"steady_tok_s": round(steady, 1), "during_roll_tok_s": round(during, 1),
                           "roll_s": round(ended - began, 3), "ratio": round(during / steady, 3),
                           "update": r.json()})
            log(f"round {i}: steady {steady:.1f} tok/s, during the roll {during:.1f} tok/s over {ended - began:.2f} s")
    stop.set()
    completed = await load
    return {"rounds": rounds, "requests_completed": completed, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.models import bench_checkpoint
    from benchmarks.peer_load import serving_dir
    from tests.server_process import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local safetensors checkpoint (default: benchmarks.models.bench_checkpoint)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steady-s", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    model_dir = os.path.abspath(args.model or bench_checkpoint())
    with tempfile.TemporaryDirectory(prefix="bench-roll-") as tmp:
        dirs = []
        for name in ("a", "b"):
            os.mkdir(os.path.join(tmp, name))
            dirs.append(serving_dir(model_dir, os.path.join(tmp, name)))
        extra = ("--replicate-size", "2", "--shard-size", "1", "--kv-cache-memory", "256MiB")
        with ServerProcess(dirs[0], nproc=2, extra_args=extra, log_path=os.path.join(tmp, "server.log")) as s:
            dtype = s.client.get("/info").json()["model_dtype"]
            result = asyncio.run(_run(s.url, [dirs[1], dirs[0]], args))
    ratios = [r["ratio"] for r in result["rounds"]]
    summary = {"dtype": dtype, "checkpoint": model_dir, "server_args": extra, "concurrency": args.concurrency,
               "new_tokens": args.new_tokens, **result, "ratio_median": statistics.median(ratios),
               "failed_requests": len(result["failures"])}
    summary[f"target_during_roll_ge_{TARGET}x_steady"] = summary["ratio_median"] >= TARGET and not result["failures"]
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
