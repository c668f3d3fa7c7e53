"""Benchmark ``POST /admin/weights`` against the same server's own load, in one run.

    python -m benchmarks.weights_update [--model DIR] [--nproc 2] [--repeats 3] [--out FILE]

A server of ``--nproc`` CPU ranks on the checkpoint (default: the 1.5 GB bf16 Llama of
``benchmarks.load``, with the test tokenizer beside it), page cache warm. Its startup load's
streaming phase (``/info`` ``weights.phase_seconds.stream``: the rows read and every unit
sharded) against ``--repeats`` updates to the same checkpoint's files under another directory
(the bytes read and written are those of any checkpoint of this model: the time does not depend on
the values): each update's seconds from the request to every group serving again, and each rank's
own. Issue 29's target: an update <= 1.2x a fresh load's streaming time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

TARGET = 1.2


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.load import DEFAULT_OUT_DIR, generate_checkpoint, warm_page_cache
    from benchmarks.peer_load import KV, serving_dir
    from tests.server_process import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local safetensors checkpoint (default: benchmarks.load's)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the summary JSON here")
    parser.add_argument("--server-args", default="", help="more server arguments (e.g. '--packed-linears off')")
    args = parser.parse_args(argv)
    model_dir = os.path.abspath(args.model or generate_checkpoint(DEFAULT_OUT_DIR))
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for name in ("a", "b"):
            os.mkdir(os.path.join(tmp, name))
        served, again = (serving_dir(model_dir, os.path.join(tmp, name)) for name in ("a", "b"))
        log(f"warmed {warm_page_cache(model_dir) / 1e9:.2f} GB of page cache")
        extra = (*KV, *args.server_args.split())
        with ServerProcess(served, nproc=args.nproc, extra_args=extra, log_path=os.path.join(tmp, "server.log")) as s:
            info = s.client.get("/info").json()
            load = info["weights"]["phase_seconds"]
            updates = []
            for i in range(args.repeats):
                r = s.client.post("/admin/weights", json={"source": again if i % 2 == 0 else served,
                                                           "version": f"v{i}"}, timeout=600)
                r.raise_for_status()
                updates.append(r.json())
                log(f"update {i}: {updates[-1]['seconds']:.2f} s (ranks {updates[-1]['update_seconds_per_rank']})")
    summary = {"dtype": info["model_dtype"], "nproc": args.nproc, "checkpoint": model_dir, "server_args": extra,
               "load_stream_s": load["stream"], "load_total_s": load["total"],
               "update_s": [u["seconds"] for u in updates],
               "update_s_median": statistics.median(u["seconds"] for u in updates),
               "bytes_read_per_rank": updates[0]["bytes_read_per_rank"]}
    summary["update_over_load_stream"] = round(summary["update_s_median"] / load["stream"], 3)
    summary[f"target_update_le_{TARGET}x_load"] = summary["update_over_load_stream"] <= TARGET
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "updates": updates, "load_phase_seconds": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
