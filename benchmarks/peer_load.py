"""Benchmark a group that loads its rows from a serving peer (``--load-from-peer``) against the same
group loading them from storage, both as real servers, side by side in one run.

    python -m benchmarks.peer_load [--model DIR] [--nproc 2] [--repeats 3] [--cold] [--out FILE]

A sender (``--share-weights``, ``--nproc`` CPU ranks) serves the checkpoint throughout (default: the
1.5 GB bf16 Llama of ``benchmarks.load``, with the test tokenizer beside it). Each round starts a
receiving server of ``--nproc`` ranks twice, alternating: from storage (page cache warm, or with
``--cold`` dropped before each start: a restarted node's, where the host lets this process drop
it), and from the peer; for each: rank 0's load (``hsdp_load_seconds``: config, skeleton, mesh, then the rows
read or received and every unit sharded), the seconds from starting the process to ``/ready``,
and its greedy tokens for two prompts, which must be the same from both. Prints one JSON line
per start, then the medians and the ratio against issue 28's target (a restarted group ready in
<= 0.5x its time from storage). Sender and receivers share this host's cores: the sender's
ranks send while the receiver's receive and shard.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

PROMPTS = ["The quick brown fox", "Once upon a time"]
TARGET = 0.5
KV = ("--kv-cache-memory", "64MiB")


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def serving_dir(model_dir: str, into: str) -> str:
    """``model_dir``'s files linked into ``into``, with the test tokenizer where it has none."""
    for name in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, name), os.path.join(into, name))
    if not any(n.startswith("tokenizer") for n in os.listdir(model_dir)):
        from tests.checkpoints import tokenizer

        tokenizer().save_pretrained(into)
    return into


def _tokens(server) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = server.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8,
                                                                                    "details": True}})
        r.raise_for_status()
        out.append([t["id"] for t in r.json()["details"]["tokens"]])
    return out


def start(model_dir: str, nproc: int, args: tuple, log_path: str, cold: bool) -> dict:
    from benchmarks.load import drop_page_cache
    from tests.server_process import ServerProcess

    if cold:
        drop_page_cache()
    began = time.perf_counter()
    server = ServerProcess(model_dir, nproc=nproc, extra_args=(*args, *KV), log_path=log_path)
    try:
        server.poll_ready(timeout=600)
        ready = time.perf_counter() - began
        info = server.client.get("/info").json()
        metrics = server.client.get("/metrics").text
        load_s = float(re.search(r"^hsdp_load_seconds (\S+)$", metrics, re.M).group(1))
        return {"ready_s": round(ready, 3), "load_s": round(load_s, 3), "weights": info["weights"], "cold": cold,
                "dtype": info["model_dtype"], "tokens": _tokens(server),
                "bytes_read_per_rank": [r.get("load_bytes_read") for r in info["ranks"]]}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    from benchmarks.load import DEFAULT_OUT_DIR, generate_checkpoint, warm_page_cache

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local safetensors checkpoint (default: benchmarks.load's)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each receiver starts")
    parser.add_argument("--out", help="also write the summary JSON here")
    args = parser.parse_args(argv)
    model_dir = os.path.abspath(args.model or generate_checkpoint(DEFAULT_OUT_DIR))
    from tests.server_process import ServerProcess

    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        os.mkdir(os.path.join(tmp, "model"))
        served = serving_dir(model_dir, os.path.join(tmp, "model"))
        log(f"warmed {warm_page_cache(model_dir) / 1e9:.2f} GB of page cache")
        sender = ServerProcess(served, nproc=args.nproc, extra_args=("--share-weights", *KV),
                               log_path=os.path.join(tmp, "sender.log"))
        runs: dict[str, list[dict]] = {"storage": [], "peer": []}
        with sender:
            log(f"sender ready at {sender.url}")
            for i in range(args.repeats):
                for how, extra in (("storage", ()), ("peer", ("--load-from-peer", sender.url))):
                    run = start(served, args.nproc, extra, os.path.join(tmp, f"{how}-{i}.log"), args.cold)
                    run.update(how=how, round=i)
                    runs[how].append(run)
                    print(json.dumps({k: v for k, v in run.items() if k != "tokens"}), flush=True)
                    log(f"round {i} {how}: load {run['load_s']:.2f} s, ready {run['ready_s']:.2f} s "
                        f"({run['dtype']}, source {run['weights']['source']})")
    tokens = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
    summary = {
        "dtype": runs["storage"][0]["dtype"], "nproc": args.nproc, "checkpoint": model_dir, "cold": args.cold,
        "checkpoint_bytes": sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir)
                                if n.endswith(".safetensors")),
        **{f"{how}_{what}_median": statistics.median(r[what] for r in rs)
           for how, rs in runs.items() for what in ("load_s", "ready_s")},
        "every_peer_load_from_the_peer": all(r["weights"]["source"] == "peer" for r in runs["peer"]),
        "tokens_equal": len(tokens) == 1,
    }
    summary["peer_load_over_storage"] = round(summary["peer_load_s_median"] / summary["storage_load_s_median"], 3)
    summary["peer_ready_over_storage"] = round(summary["peer_ready_s_median"] / summary["storage_ready_s_median"], 3)
    summary[f"target_peer_load_le_{TARGET}x_storage"] = summary["peer_load_over_storage"] <= TARGET
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
    return 0 if summary["tokens_equal"] and summary["every_peer_load_from_the_peer"] else 1


if __name__ == "__main__":
    sys.exit(main())
