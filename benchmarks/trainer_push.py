"""Benchmark a trainer's push (``server.trainer.push``) against one copy of the same bytes over the
same kind of transfer group, in one run.

    python -m benchmarks.trainer_push [--model DIR] [--repeats 3] [--server-args "..."] [--out FILE]

A server of 2 CPU ranks on the checkpoint (default: the 1.5 GB bf16 Llama of ``benchmarks.load``),
and a "trainer" of 2 CPU ranks (spawned processes, gloo): the same checkpoint loaded by
``from_pretrained`` in its dtype, ``fully_shard`` per decoder layer and the root on a 1-D mesh of
2 (matching the server's shards: one sender per tensor), which pushes ``--repeats`` times. Per
push: the trainer's seconds from the call to its return (the rendezvous, the transfer, the
server's update step and the wait for ``GET /admin/weights``) and the server's own seconds, the
bytes each serving rank received and each trainer rank sent.

The floor (issue 29's target: a push <= 1.5x it): one copy of the bytes each serving rank received,
sent by 2 processes to 2 others at once over a fresh gloo group on this host (loopback TCP), as the
push's transfer group moves them, median of ``--repeats``. On a 2-core host the 4 ranks of the push
(and the floor's 4 processes) share 2 cores. Prints one JSON document; the dtype is printed with
every figure.
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

TARGET = 1.5


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _train_and_push(rank, world_size, path, url, repeats):
    """A trainer rank: the checkpoint sharded by FSDP2 over the trainer's ranks, pushed ``repeats``
    times; (seconds of each push here, the server's outcome of each)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from server.trainer import push

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seconds, outcomes = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        outcomes.append(push(model, url, version=f"push-{i}", timeout_s=600))
        seconds.append(time.perf_counter() - t0)
    return {"seconds": seconds, "outcomes": outcomes, "dtype": str(next(model.parameters()).dtype)}


def _copy_floor(rank, world_size, nbytes, repeats):
    """Ranks 0 and 1 each send ``nbytes`` to rank 2 and 3 at once (one tensor each, gloo): the
    seconds of each round, timed on the receivers from a barrier to the last byte."""
    import torch
    import torch.distributed as dist

    half = world_size // 2
    data = torch.ones(nbytes, dtype=torch.uint8) if rank < half else torch.empty(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats + 1):  # the first round connects the pairs
        dist.barrier()
        t0 = time.perf_counter()
        if rank < half:
            dist.send(data, rank + half)
        else:
            dist.recv(data, rank - half)
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
    return seconds[1:]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.load import DEFAULT_OUT_DIR, generate_checkpoint, warm_page_cache
    from benchmarks.peer_load import KV, serving_dir
    from tests.dist import run_ranks, values
    from tests.server_process import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local safetensors checkpoint (default: benchmarks.load's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-args", default="", help="more server arguments (e.g. '--packed-linears off')")
    parser.add_argument("--out", help="also write the summary JSON here")
    args = parser.parse_args(argv)
    model_dir = os.path.abspath(args.model or generate_checkpoint(DEFAULT_OUT_DIR))
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        os.mkdir(os.path.join(tmp, "a"))
        served = serving_dir(model_dir, os.path.join(tmp, "a"))
        log(f"warmed {warm_page_cache(model_dir) / 1e9:.2f} GB of page cache")
        extra = (*KV, *args.server_args.split())
        with ServerProcess(served, nproc=2, extra_args=extra, log_path=os.path.join(tmp, "server.log")) as s:
            dtype = s.client.get("/info").json()["model_dtype"]
            trainer = values(run_ranks(_train_and_push, 2, pathlib.Path(tmp), served, s.url, args.repeats,
                                       timeout=1800, pg_timeout_s=600))
        received = trainer[0]["outcomes"][0]["bytes_received_per_rank"]
        log(f"pushes: {[round(t, 3) for t in trainer[0]['seconds']]} s; floor next")
        floor = values(run_ranks(_copy_floor, 4, pathlib.Path(tmp), max(received), args.repeats, timeout=600))
    push_s = [max(t["seconds"][i] for t in trainer) for i in range(args.repeats)]
    floor_s = [max(f[i] for f in floor) for i in range(args.repeats)]
    outcomes = trainer[0]["outcomes"]
    summary = {"server_dtype": dtype, "trainer_dtype": trainer[0]["dtype"], "checkpoint": model_dir,
               "server_args": extra, "server_ranks": 2, "trainer_ranks": 2,
               "bytes_received_per_serving_rank": received,
               "bytes_sent_per_trainer_rank": [t["outcomes"][0]["bytes_sent_by_this_rank"] for t in trainer],
               "push_s": [round(t, 3) for t in push_s], "push_s_median": round(statistics.median(push_s), 3),
               "server_update_s": [o["seconds"] for o in outcomes],
               "server_rank_update_s": [o["update_seconds_per_rank"] for o in outcomes],
               "copy_floor_s": [round(t, 3) for t in floor_s], "copy_floor_s_median": round(statistics.median(floor_s), 3)}
    summary["push_gb_per_s_per_serving_rank"] = round(max(received) / summary["push_s_median"] / 1e9, 3)
    summary["push_over_floor"] = round(summary["push_s_median"] / summary["copy_floor_s_median"], 3)
    summary[f"target_push_le_{TARGET}x_floor"] = summary["push_over_floor"] <= TARGET
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
