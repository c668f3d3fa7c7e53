"""Benchmark loading a checkpoint into an HSDP-sharded model, on 2 CPU ranks, against two baselines.

    python -m benchmarks.load [--model DIR] [--out-dir DIR] [--nproc 2]
                              [--methods sliced,full,from_pretrained,dcp] [--repeats 2] [--profile DIR]

Methods, each in a fresh set of spawned processes (gloo, FileStore rendezvous):
  sliced           load_hsdp_model(read_mode="sliced"): a warm file's rows are views of a private mapping of it
  sliced-read      the same with map_files=False (--no-load-mmap): the rows read into the rank's own memory
  full             load_hsdp_model(read_mode="full")
  from_pretrained  transformers from_pretrained on every rank, then apply_hsdp_to_model
  dcp              meta skeleton, apply_hsdp_to_model, to_empty, torch DCP HuggingFaceStorageReader
  floor-fresh      one pread of each byte range sliced reads, into fresh memory kept (no model)
  floor-copy       the same into one reused buffer: the copy alone (no model)
  floor-direct     the same with O_DIRECT (aligned reads past the page cache into one reused buffer):
                   what the device gives a rank; with --cold, against floor-copy, whether direct
                   reads of cold files would beat the page cache's

``--cold`` drops the host's page cache before every method's run (root only; the run stops where
the host does not allow it): a restarted node's load; without it the page cache is warmed first.

Per rank: time to ready, peak resident and anonymous memory added over the idle process, bytes read.
Prints one JSON line per method, then one with the ratios to the baselines and whether the targets hold.

With ``--source s3`` the checkpoint is put in an S3 API server this script starts on loopback
(moto's, the test dependency; or any store named by AWS_ENDPOINT_URL with --bucket), and the
methods are
  s3-sliced        load_hsdp_model on the s3:// checkpoint: each rank fetches its rows
  s3-full          the same with read_mode="full": each rank fetches whole tensors
  s3-download      boto3 downloads every file to local disk first (once, rank 0, the others
                   waiting), then load_hsdp_model reads the local copy (sliced)
time to ready counting the fetch of the small files (config, index, tokenizer) and, for
s3-download, the download; ratios to s3-download. moto is one Python process: its throughput,
not the network's, bounds every method here, so read the ratios, not the GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time

import torch

from tests.dist import run_ranks, values

DEFAULT_OUT_DIR = os.path.expanduser("~/.cache/hsdp-serve/bench-llama-1.5g")
METHODS = ("sliced", "sliced-read", "full", "from_pretrained", "dcp", "floor-fresh", "floor-copy", "floor-direct")
FLOORS = ("floor-fresh", "floor-copy", "floor-direct")
S3_METHODS = ("s3-sliced", "s3-full", "s3-download")
RUN_TIMEOUT_S = 600
RSS_SLACK, FP_TIME_TARGET, DCP_TIME_TARGET, FLOOR_TIME_TARGET = 1.1, 0.5, 0.5, 2.5  # issue 28's targets


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- /proc ---------------------------------------------------------------------------------------
def read_status() -> dict[str, int]:
    """The kB fields of /proc/self/status that we need, in bytes."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in wanted:
                out[key] = int(rest.split()[0]) * 1024
    return out


def read_rchar() -> int:
    """Bytes this process got from read()-like calls; pages touched through an mmap do not count."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class PeakSampler(threading.Thread):
    """Polls RssAnon and RssFile every few ms (the kernel keeps a peak only for the total, VmHWM)."""

    def __init__(self, interval_s: float = 0.005):
        super().__init__(daemon=True)
        self.interval_s, self.stopped = interval_s, threading.Event()
        self.peak_anon = self.peak_file = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            s = read_status()
            self.peak_anon, self.peak_file = max(self.peak_anon, s["RssAnon"]), max(self.peak_file, s["RssFile"])
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        s = read_status()  # a peak at the very end would fall between two samples
        self.peak_anon, self.peak_file = max(self.peak_anon, s["RssAnon"]), max(self.peak_file, s["RssFile"])


# -- the checkpoint ------------------------------------------------------------------------------
def generate_checkpoint(out_dir: str) -> str:
    """A random-weight bf16 Llama of about 1.5 GB (13 layers), files of 500 MB; generated once."""
    marker = os.path.join(out_dir, ".complete")
    if os.path.isfile(marker):
        return out_dir
    from transformers import AutoModelForCausalLM, LlamaConfig

    shutil.rmtree(out_dir, ignore_errors=True)
    log(f"generating a checkpoint in {out_dir}")
    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=13,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # built in bf16: ~1.5 GB, not 3
    model.save_pretrained(out_dir, max_shard_size="500MB")
    del model
    open(marker, "w").close()
    return out_dir


def warm_page_cache(model_dir: str) -> int:
    """Read every file once so that every method meets a warm page cache; returns the bytes read."""
    total = 0
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(64 << 20):
                    total += len(chunk)
    return total


def drop_page_cache() -> None:
    """Every clean page of the host's page cache dropped (root only: PermissionError elsewhere)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def describe_checkpoint(model_dir: str) -> dict:
    """Checkpoint bytes and the largest FSDP unit's parameter bytes (its own, not its nested units')."""
    from transformers import AutoModelForCausalLM

    from loaders.checkpoint import list_checkpoint_files, load_config
    from loaders.skeleton import build_skeleton
    from shard_engine import default_shard_conditions, select_units

    files = list_checkpoint_files(model_dir)
    model = build_skeleton(load_config(model_dir), AutoModelForCausalLM, files.dominant_dtype())
    units = [name for name, _ in select_units(model, default_shard_conditions(model))]
    by_depth = sorted(units, key=len, reverse=True)
    unit_bytes: dict[str, int] = {}
    for name, p in model.named_parameters():
        owner = next((u for u in by_depth if name.startswith(u + ".")), "<root>")
        unit_bytes[owner] = unit_bytes.get(owner, 0) + p.numel() * p.element_size()
    largest = max(unit_bytes, key=unit_bytes.get)
    return {
        "checkpoint_bytes": files.total_bytes,
        "file_bytes": sum(os.path.getsize(f) for f in files.files),
        "largest_unit": largest,
        "largest_unit_bytes": unit_bytes[largest],
    }


# -- the methods (run inside a rank) -------------------------------------------------------------
def load_with_loader(model_dir: str, read_mode: str, map_files: bool = True):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(model_dir, HSDPInferenceConfig(), read_mode=read_mode, map_files=map_files)
    stats = loaded.stats.as_dict()
    return loaded.model, {"bytes_read": stats["bytes_read"], "bytes_mapped": stats["bytes_mapped"],
                          "phase_seconds": stats["phase_seconds"]}


def load_from_s3(url: str, read_mode: str, rank: int):
    """``--model s3://...`` as the server does it: the small files once per node (rank 0 here, the
    other ranks waiting), then every rank fetching from the store."""
    import torch.distributed as dist

    from loaders.sources import resolve_model

    box = [resolve_model(url, cache_dir=tempfile.mkdtemp(prefix="bench-s3-")).path if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return load_with_loader(box[0], read_mode)


def load_downloaded(url: str, rank: int):
    """Download every object to local disk first (rank 0; the others wait), then load locally."""
    import boto3
    import torch.distributed as dist

    from loaders.remote import parse_s3_url

    box = [None]
    if rank == 0:
        bucket, prefix = parse_s3_url(url)
        s3 = boto3.client("s3")
        target = tempfile.mkdtemp(prefix="bench-s3-download-")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for obj in page.get("Contents", []):
                s3.download_file(bucket, obj["Key"], os.path.join(target, obj["Key"][len(prefix) + 1:]))
        box[0] = target
    dist.broadcast_object_list(box, src=0)
    try:
        return load_with_loader(box[0], "sliced")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def start_s3(model_dir: str, bucket: str) -> tuple[str, object]:
    """A moto S3 server on loopback holding ``model_dir`` under ``bucket``/model (the AWS_*
    variables set for this process and the ranks it spawns); the URL and the server."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.server_process import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket)
    for name in sorted(os.listdir(model_dir)):
        if os.path.isfile(os.path.join(model_dir, name)):
            s3.upload_file(os.path.join(model_dir, name), bucket, f"model/{name}")
    return f"s3://{bucket}/model", server


def read_floor(model_dir: str, rank: int, world_size: int, fresh: bool, direct: bool = False):
    """The floor of a rank's load: one positioned read of each byte range the sliced load reads
    (each tensor's rows of this rank's shard, in file order), into fresh memory kept to the end
    (``floor-fresh``: what holding the shards costs at least: the kernel's zeroing and page faults
    and the copy) or into one buffer reused (``floor-copy``: the copy alone, the issue's floor);
    ``direct``: with O_DIRECT, each range widened to 4 KiB boundaries, into one page-aligned buffer
    (``floor-direct``: the device's speed, past the page cache)."""
    import mmap

    from loaders.checkpoint import list_checkpoint_files
    from loaders.safetensors_io import row_span
    from loaders.streaming import shard_rows

    files = list_checkpoint_files(model_dir)
    by_file: dict[str, list] = {}
    for path, info in files.tensors.values():
        by_file.setdefault(path, []).append(info)
    kept, total = [], 0
    reused = None
    align = 4096
    for path in files.files:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            for info in sorted(by_file.get(path, []), key=lambda i: i.start):
                start, stop = shard_rows(info.shape[0], world_size, rank) if info.shape else (0, 0)
                _, offset, nbytes = row_span(info, start, stop)
                total += nbytes
                if direct:
                    offset, end = offset // align * align, -(-(offset + nbytes) // align) * align
                    nbytes = end - offset
                if fresh:
                    out = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
                    kept.append(out)
                else:
                    if reused is None or len(reused) < nbytes:
                        size = -(-max(nbytes, 64 << 20) // align) * align
                        reused = mmap.mmap(-1, size) if direct else memoryview(
                            torch.empty(size, dtype=torch.uint8).numpy())
                    out = memoryview(reused)
                view, done = out[:nbytes], 0
                while done < nbytes:
                    n = os.preadv(fd, [view[done:]], offset + done)
                    if n <= 0:
                        if direct and done:  # the file's last block: O_DIRECT reads stop at its end
                            break
                        raise OSError(f"{path}: unexpected end of file at {offset + done}")
                    done += n
        finally:
            os.close(fd)
    return None, {"bytes_read": total}


def load_from_pretrained(model_dir: str):
    from transformers import AutoModelForCausalLM

    from shard_engine import HSDPInferenceConfig, apply_hsdp_to_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    apply_hsdp_to_model(model, HSDPInferenceConfig())
    return model, {}


def load_dcp(model_dir: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from loaders.checkpoint import load_config
    from loaders.skeleton import build_skeleton
    from shard_engine import HSDPInferenceConfig, apply_hsdp_to_model
    from shard_engine.torch_private import set_buffer

    model = build_skeleton(load_config(model_dir), AutoModelForCausalLM, torch.bfloat16)
    buffers = dict(model.named_buffers())  # real; to_empty would wipe the non-persistent ones
    apply_hsdp_to_model(model, HSDPInferenceConfig())
    model.to_empty(device="cpu")
    for name, buf in buffers.items():
        module_name, _, attr = name.rpartition(".")
        set_buffer(model.get_submodule(module_name), attr, buf)
    state_dict = model.state_dict()  # DTensors over this rank's shards: DCP writes into them in place
    dcp.load(state_dict, storage_reader=dcp.HuggingFaceStorageReader(model_dir))
    requested = sum(
        (t.to_local() if isinstance(t, DTensor) else t).nbytes for t in state_dict.values()
    )
    return model, {"bytes_requested": requested}


def checksum_local_shards(model) -> float:
    from torch.distributed.tensor import DTensor

    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).double().sum().item() for p in model.parameters()
    )


def run_rank(rank: int, world_size: int, method: str, model_dir: str, profile_path: str | None,
             run_forward: bool) -> dict:
    """One rank's load with ``method`` (the process group is up, one thread per rank); its figures."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from loaders.stats import reset_peak_rss

    result: dict = {"rank": rank}
    # Import the model's modeling module (Python code only, no weights): a server has it loaded already.
    if not model_dir.startswith("s3://"):
        AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_dir))]
    load = {
        "sliced": lambda: load_with_loader(model_dir, "sliced"),
        "sliced-read": lambda: load_with_loader(model_dir, "sliced", map_files=False),
        "full": lambda: load_with_loader(model_dir, "full"),
        "from_pretrained": lambda: load_from_pretrained(model_dir),
        "dcp": lambda: load_dcp(model_dir),
        "s3-sliced": lambda: load_from_s3(model_dir, "sliced", rank),
        "s3-full": lambda: load_from_s3(model_dir, "full", rank),
        "s3-download": lambda: load_downloaded(model_dir, rank),
        "floor-copy": lambda: read_floor(model_dir, rank, world_size, fresh=False),
        "floor-fresh": lambda: read_floor(model_dir, rank, world_size, fresh=True),
        "floor-direct": lambda: read_floor(model_dir, rank, world_size, fresh=False, direct=True),
    }[method]
    dist.barrier()

    before, rchar_before = read_status(), read_rchar()
    sampler = PeakSampler()
    reset_peak_rss()
    sampler.start()
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start, cpu_start = time.perf_counter(), time.process_time()
    model, extra = load()
    if model is not None:  # (the floors hold bytes, not a model)
        model.eval()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if profiler:
        profiler.disable()
        profiler.dump_stats(f"{profile_path}-rank{rank}.prof")
    hwm = read_status()["VmHWM"]
    sampler.stop()
    rchar = read_rchar() - rchar_before
    dist.barrier()

    result.update(
        time_to_ready_s=round(elapsed, 3),
        cpu_s=round(cpu, 3),  # user + sys of all threads: less sensitive than wall time to a busy machine
        peak_rss_added_bytes=hwm - before["VmRSS"],
        peak_anon_added_bytes=sampler.peak_anon - before["RssAnon"],
        peak_file_added_bytes=sampler.peak_file - before["RssFile"],
        rchar_bytes=rchar,
        bytes_read=extra.pop("bytes_read", rchar),
        checksum=checksum_local_shards(model) if model is not None else None,
        **extra,
    )
    if run_forward and model is not None:
        with torch.no_grad():  # every rank runs the forward: it all-gathers the parameters
            ids = (torch.arange(1, 9) * 997 % model.config.vocab_size).unsqueeze(0)
            logits = model(input_ids=ids).logits.float()
        if rank == 0:
            result["logits"] = logits
    dist.barrier()
    return result


# -- the parent ----------------------------------------------------------------------------------
def run_method(method: str, model_dir: str, nproc: int, profile_path: str | None, run_forward: bool):
    """One load with ``method`` on ``nproc`` fresh processes; per-rank results and rank 0's logits (or None)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{method}-") as run_dir:
        results = values(run_ranks(run_rank, nproc, pathlib.Path(run_dir), method, model_dir, profile_path,
                                   run_forward, timeout=RUN_TIMEOUT_S, pg_timeout_s=300))
    logits = results[0].pop("logits", None)
    return results, logits


def check_against_reference(method: str, logits, checksums, reference) -> dict:
    """Compare one run's logits and per-rank shard checksums with the reference method's."""
    ref_method, ref_logits, ref_checksums = reference
    diff = None if logits is None else (logits - ref_logits).abs().max().item()
    same = diff in (None, 0.0) and checksums == ref_checksums
    if not same:
        log(f"!!!!! MISMATCH: {method} differs from {ref_method}: max |logit diff| {diff}, "
            f"checksums {checksums} vs {ref_checksums} !!!!!")
    return {"reference": ref_method, "matches_reference": same, "max_abs_logit_diff": diff}


def summarize_method(method: str, rounds: list[list[dict]], checks: list[dict], info: dict, nproc: int) -> dict:
    per_round_time = [max(r["time_to_ready_s"] for r in ranks) for ranks in rounds]  # ready = all ranks ready
    per_round_cpu = [max(r["cpu_s"] for r in ranks) for ranks in rounds]
    peak_rss = max(r["peak_rss_added_bytes"] for ranks in rounds for r in ranks)
    floor = info["checkpoint_bytes"] / nproc + info["largest_unit_bytes"]
    return {
        "method": method,
        "best_time_to_ready_s": min(per_round_time),
        "time_to_ready_s_per_round": per_round_time,
        "best_cpu_s": min(per_round_cpu),
        "cpu_s_per_round": per_round_cpu,
        "max_peak_rss_added_bytes": peak_rss,
        "max_peak_anon_added_bytes": max(r["peak_anon_added_bytes"] for ranks in rounds for r in ranks),
        "bytes_read_per_rank": [r["bytes_read"] for r in rounds[0]],
        "checkpoint_bytes": info["checkpoint_bytes"],
        # from_pretrained reads whole files on every rank, dcp its shards, both through mmap (not in rchar)
        "bytes_to_read_per_rank": (
            [info["file_bytes"]] * nproc if method == "from_pretrained"
            else [r.get("bytes_requested", r["bytes_read"]) for r in rounds[0]]
        ),
        "rss_floor_bytes": floor,
        "rss_target_bytes": floor * RSS_SLACK,
        "peak_rss_over_floor": round(peak_rss / floor, 3),
        "correct": all(c["matches_reference"] for c in checks),
        "checks": checks,
        "ranks_per_round": [[{k: v for k, v in r.items() if k != "checksum"} for r in ranks] for ranks in rounds],
    }


def compute_ratios(summaries: dict[str, dict]) -> dict:
    out: dict = {"ratios": {}, "targets": {}}
    for method, s in summaries.items():
        for base in ("from_pretrained", "dcp", *FLOORS):
            if base in summaries and base != method:
                for what, key in (("time", "best_time_to_ready_s"), ("cpu", "best_cpu_s")):
                    out["ratios"][f"{method}_{what}_over_{base}"] = round(s[key] / summaries[base][key], 3)
        out["ratios"][f"{method}_peak_rss_over_floor"] = s["peak_rss_over_floor"]
    if "sliced" in summaries:
        r = out["ratios"]
        out["targets"]["sliced_peak_rss_le_1.1x_floor"] = r["sliced_peak_rss_over_floor"] <= RSS_SLACK
        if "sliced_time_over_from_pretrained" in r:
            out["targets"]["sliced_time_le_0.5x_from_pretrained"] = r["sliced_time_over_from_pretrained"] <= FP_TIME_TARGET
        if "sliced_time_over_dcp" in r:
            out["targets"]["sliced_time_le_0.5x_dcp"] = r["sliced_time_over_dcp"] <= DCP_TIME_TARGET
        if "sliced_time_over_floor-copy" in r:
            out["targets"]["sliced_time_le_2.5x_floor-copy"] = r["sliced_time_over_floor-copy"] <= FLOOR_TIME_TARGET
    out["all_correct"] = all(s["correct"] for s in summaries.values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local safetensors checkpoint (default: generate one)")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where to generate the checkpoint")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=2, help="rounds; each runs every method once")
    parser.add_argument("--profile", metavar="DIR", help="write a cProfile of each rank's load to DIR")
    parser.add_argument("--source", choices=("local", "s3"), default="local",
                        help="s3: the checkpoint in an S3 API server on loopback, the s3-* methods")
    parser.add_argument("--bucket", default="hsdp-bench")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every method's run")
    args = parser.parse_args(argv)
    if args.source == "s3" and args.methods == ",".join(METHODS):
        args.methods = ",".join(S3_METHODS)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := set(methods) - set(METHODS + S3_METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHODS + S3_METHODS}")

    # the ranks are this host's, as the server's launcher tells them (the loader's reads ahead count idle cores)
    os.environ["LOCAL_WORLD_SIZE"] = str(args.nproc)
    model_dir = os.path.abspath(args.model or generate_checkpoint(args.out_dir))
    info = describe_checkpoint(model_dir)
    if args.cold:
        drop_page_cache()  # a host that does not allow it stops here, before any figure
        log(f"{model_dir}: {info}; the page cache dropped before each run (--cold)")
    else:
        log(f"{model_dir}: {info}; warmed {warm_page_cache(model_dir) / 1e9:.2f} GB of page cache")
    s3_server = None
    source = model_dir
    if args.source == "s3":
        source, s3_server = start_s3(model_dir, args.bucket)
        log(f"uploaded to {source} ({os.environ['AWS_ENDPOINT_URL']})")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)

    rounds: dict[str, list[list[dict]]] = {m: [] for m in methods}
    checks: dict[str, list[dict]] = {m: [] for m in methods}
    ref_method = ("from_pretrained" if "from_pretrained" in methods else
                  "s3-download" if "s3-download" in methods else
                  next((m for m in methods if m not in FLOORS), methods[0]))
    reference = None
    for i in range(args.repeats):
        # The reference first in each round, the others interleaved so that noise hits them alike.
        for method in [ref_method] + [m for m in methods if m != ref_method]:
            profile = os.path.join(args.profile, f"{method}-round{i}") if args.profile else None
            if args.cold:
                drop_page_cache()
            # A forward of 8 tokens in the first round; shard checksums in every round.
            results, logits = run_method(method, source if method.startswith("s3-") else model_dir, args.nproc,
                                         profile, run_forward=i == 0)
            checksums = [r["checksum"] for r in results]
            if method in FLOORS:  # bytes, not a model: nothing to check
                rounds[method].append(results)
                log(f"round {i} {method}: " + ", ".join(f"rank {r['rank']} {r['time_to_ready_s']:.2f} s" for r in results))
                continue
            if reference is None:
                reference = (method, logits, checksums)
            checks[method].append(check_against_reference(method, logits, checksums, reference))
            rounds[method].append(results)
            log(f"round {i} {method}: " + ", ".join(
                f"rank {r['rank']} {r['time_to_ready_s']:.2f} s +{r['peak_rss_added_bytes'] / 1e9:.2f} GB"
                for r in results))

    summaries = {m: summarize_method(m, rounds[m], checks[m], info, args.nproc) for m in methods}
    for s in summaries.values():
        print(json.dumps(s), flush=True)
    ratios = compute_ratios(summaries)
    ratios.update(largest_unit=info["largest_unit"], largest_unit_bytes=info["largest_unit_bytes"])
    if "s3-download" in summaries:
        base = summaries["s3-download"]["best_time_to_ready_s"]
        for method in ("s3-sliced", "s3-full"):
            if method in summaries:
                ratios["ratios"][f"{method}_time_over_s3-download"] = round(
                    summaries[method]["best_time_to_ready_s"] / base, 3)
    ratios.update(cold=args.cold, nproc=args.nproc)
    print(json.dumps(ratios), flush=True)
    if s3_server is not None:
        s3_server.stop()
    return 0 if ratios["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
