"""Forward prefetch and resident units: same outputs, and the all-gathers they save are really saved."""

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.dist import run_ranks, values


def _loaded_and_counted(rank, path):
    """The sharded model, transformers' unsharded one, this rank's input and the reference logits,
    with the process group's all-gathers counted in ``gathers["n"]`` (``original`` restores them)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    model = load_hsdp_model(path, HSDPInferenceConfig()).model
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]]) + rank  # each rank its own input
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    gathers = {"n": 0}
    original = dist.all_gather_single

    def counting(*args, **kwargs):
        gathers["n"] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counting
    return model, reference, ids, expected, gathers, original


def _forwards(rank, world_size, path, settings):
    """Logits and all-gather counts of two forwards under each (prefetch depth, resident count)."""
    import torch.distributed as dist
    from shard_engine import disable_forward_prefetch, enable_forward_prefetch, fsdp_units, set_resident_units

    model, reference, ids, expected, gathers, original = _loaded_and_counted(rank, path)
    out = {"units": len(fsdp_units(model)), "runs": []}
    pool = None
    for depth, resident, shm in settings:
        disable_forward_prefetch(model)
        if depth:
            enable_forward_prefetch(model, depth=depth)
        if shm and pool is None:
            from shard_engine import enable_shared_memory_all_gather

            pool = enable_shared_memory_all_gather(model, slots=5)
            out["shm_dir"] = pool.directory
            out["shm_files_after_gather"] = None
        residency = set_resident_units(model, resident)
        counts, exact = [], []
        for _ in range(2):
            gathers["n"] = 0
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            counts.append(gathers["n"])
            exact.append(torch.allclose(logits, expected, rtol=1e-5, atol=1e-5))
        out["runs"].append({"counts": counts, "exact": exact, "resident": residency.as_dict()})
        if pool is not None and out["shm_files_after_gather"] is None:
            import os

            out["shm_files_after_gather"] = sorted(os.listdir(pool.directory))
    dist.all_gather_single = original
    if pool is not None:
        dist.barrier()
        pool.close()
        import os

        out["shm_dir_left"] = os.path.exists(pool.directory)
    out["sharded_extra_bytes"] = sum(p.numel() * p.element_size() for p in reference.parameters()) - sum(
        p.to_local().numel() * p.element_size() for p in model.parameters() if hasattr(p, "to_local"))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("overlap") / "llama", "llama")


def test_prefetch_and_residency_keep_outputs_and_save_gathers(tmp_path, llama):
    settings = [(0, 0, False), (1, 0, False), (2, 0, False), (0, -1, False), (2, 2, False), (0, 0, False),
                (2, 0, True), (0, 0, True)]
    results = values(run_ranks(_forwards, 2, tmp_path, llama, settings, timeout=300))
    for r in results:
        units = r["units"]
        plain, depth1, depth2, everything, two, back, shm_prefetch, shm_plain = r["runs"]
        for run in r["runs"]:
            assert run["exact"] == [True, True]
        # every unit gathers once per forward, prefetched or not (here the root's own parameters
        # are the final norm and lm_head, so it is a unit that gathers too)
        assert plain["counts"] == depth1["counts"] == depth2["counts"] == [units, units]
        # all resident: gathered once by set_resident_units, never again
        assert everything["counts"] == [0, 0]
        assert everything["resident"]["units"] == units == everything["resident"]["of"]
        assert everything["resident"]["extra_bytes_per_rank"] == r["sharded_extra_bytes"]
        # two resident (the root and the embeddings): the other units still gather every forward
        assert two["counts"] == [units - 2, units - 2] and two["resident"]["names"] == ["", "model.embed_tokens"]
        assert 0 < two["resident"]["extra_bytes_per_rank"] < everything["resident"]["extra_bytes_per_rank"]
        # and back to nothing resident: the units are resharded and gather again
        assert back["counts"] == [units, units] and back["resident"]["extra_bytes_per_rank"] == 0
        # through shared memory: no all-gather on the process group at all, the same logits
        assert shm_prefetch["counts"] == shm_plain["counts"] == [0, 0]
        # what stays named: the probe and each rank's pid file; a slot file is unlinked once every
        # rank has mapped it (at the slot's next use), so no crash can leave the ring's pages behind
        files = r["shm_files_after_gather"]
        assert "probe" in files and len([f for f in files if f.startswith("pid-")]) == 2, files
        assert len([f for f in files if f.startswith("slot")]) < 5, files
        assert r["shm_dir"].startswith("/dev/shm/hsdp-") and not r["shm_dir_left"]


def _unit_ring(rank, world_size, path):
    """Nothing resident, gathers through shared memory: the leaf units in the two-slot ring."""
    import torch.distributed as dist

    from shard_engine import enable_shared_memory_all_gather, fsdp_units, set_resident_units

    model, reference, ids, expected, gathers, original = _loaded_and_counted(rank, path)
    names = {id(m): name for name, m in model.named_modules()}
    set_resident_units(model, 0)
    pool = enable_shared_memory_all_gather(model, slots=5)
    ring = pool.unit_ring
    out = {"units": [names[id(u)] for u in fsdp_units(model)],
           "ring": [names[id(u)] for u in ring.units] if ring is not None else [], "exact": [], "calls": []}
    for _ in range(3):
        before, gathers["n"] = pool.calls, 0
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        out["exact"].append(torch.allclose(logits, expected, rtol=1e-5, atol=1e-5))
        out["calls"].append((pool.calls - before, gathers["n"]))
    # the ring's parameters are views of its shared slots: one copy of the unit per host
    if ring is not None:
        params = [p for unit in ring.units for p in unit.parameters()]
        out["param_in_slot"] = bool(params) and all(_in_slot(ring, p) for p in params)
        out["private_in_slot"] = _in_slot(ring, torch.empty_like(params[-1]))  # the check can fail
    out["ring_bytes"] = ring.nbytes if ring is not None else 0
    set_resident_units(model, 0)  # releases the ring: the units gather through the pool again
    with torch.no_grad():
        out["exact_after_release"] = torch.allclose(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    dist.all_gather_single = original
    dist.barrier()
    pool.close()
    return out


def _in_slot(ring, param) -> bool:
    """Whether ``param``'s bytes lie inside one of the ring's slots (its storage is the slot's)."""
    start = param.data_ptr()
    end = start + param.numel() * param.element_size()
    for i in range(ring.SLOTS):
        slot = ring.slot(i)
        if slot.data_ptr() <= start and end <= slot.data_ptr() + slot.numel():
            return True
    return False


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_unit_ring_gathers_leaf_units_without_a_copy_out(tmp_path, arch):
    """With nothing resident on one host, every leaf unit's gathered parameters live in one of
    two shared slots, filled by each rank's own rows before the unit runs; the outputs are
    exact, the pool's copy-out gathers are left to the units the ring cannot take."""
    path = write_checkpoint(tmp_path / arch, arch)
    for r in values(run_ranks(_unit_ring, 2, tmp_path, path, timeout=300)):
        assert r["exact"] == [True, True, True] and r["exact_after_release"], r
        layers = [u for u in r["units"] if ".layers." in u]
        assert layers and set(layers) <= set(r["ring"]), r
        assert "" not in r["ring"]  # the root's forward spans every other unit
        if arch == "qwen2":  # tied: the embedding's weight is lm_head's too, used outside its unit
            assert "model.embed_tokens" not in r["ring"], r
        else:
            assert "model.embed_tokens" in r["ring"], r
        # per forward: a pool gather for each unit outside the ring, none on the process group
        assert r["calls"] == [(len(r["units"]) - len(r["ring"]), 0)] * 3, r
        assert r["param_in_slot"] and not r["private_in_slot"] and r["ring_bytes"] > 0, r


def _shared_residency(rank, world_size, path):
    """Residency through one shared copy per host: outputs, gathers, files and views, then back."""
    import os

    import torch.distributed as dist

    from shard_engine import fsdp_units, set_resident_units, shared_weights_of

    model, reference, ids, expected, gathers, original = _loaded_and_counted(rank, path)
    out = {"units": len(fsdp_units(model)), "runs": [],
           "whole_bytes": sum(p.numel() * p.element_size() for p in reference.parameters())}
    for count, shared in [(-1, True), (0, False), (2, True), (-1, False), (-1, True), (0, False)]:
        residency = set_resident_units(model, count, shared=shared)
        weights = shared_weights_of(model)
        run = {"resident": residency.as_dict(), "counts": [], "exact": []}
        if weights is not None:
            run["file"] = weights.path
            run["file_exists"] = os.path.exists(weights.path)  # unlinked once every rank mapped it
            run["shard_view_bytes"] = weights.shard_view_bytes
            # the module's parameters and the local shards both live in the shared mapping
            first = fsdp_units(model)[1]  # the embeddings
            embed = first.weight
            base = weights.tensor(0, 1, torch.uint8).data_ptr()
            run["param_in_mapping"] = base <= embed.data_ptr() < base + weights.nbytes
        for _ in range(2):
            gathers["n"] = 0
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            run["counts"].append(gathers["n"])
            run["exact"].append(torch.allclose(logits, expected, rtol=1e-5, atol=1e-5))
        out["runs"].append(run)
    dist.all_gather_single = original
    return out


def test_shared_residency_holds_one_copy_per_host_and_gathers_nothing(tmp_path, llama):
    import os

    results = values(run_ranks(_shared_residency, 2, tmp_path, llama, timeout=300))
    for r in results:
        units = r["units"]
        shared_all, none, shared_two, private_all, shared_again, back = r["runs"]
        for run in r["runs"]:
            assert run["exact"] == [True, True]
        # all resident, shared: nothing gathered per forward, no private copy, one file per host
        assert shared_all["counts"] == [0, 0] and shared_all["resident"]["units"] == units
        assert shared_all["resident"]["extra_bytes_per_rank"] == 0
        assert shared_all["resident"]["shared_with"] == 2
        assert r["whole_bytes"] <= shared_all["resident"]["shared_bytes"] < r["whole_bytes"] + 64 * 64
        assert not shared_all["file_exists"] and shared_all["file"].startswith("/dev/shm/hsdp-")
        assert shared_all["param_in_mapping"] and shared_all["shard_view_bytes"] > 0
        # released: the file is gone, every unit gathers again
        assert none["counts"] == [units, units] and not os.path.exists(shared_all["file"])
        assert shared_two["counts"] == [units - 2, units - 2]
        assert 0 < shared_two["resident"]["shared_bytes"] < shared_all["resident"]["shared_bytes"]
        assert private_all["counts"] == [0, 0] and private_all["resident"]["extra_bytes_per_rank"] > 0
        assert shared_again["counts"] == [0, 0] and shared_again["resident"]["extra_bytes_per_rank"] == 0
        assert back["counts"] == [units, units]
    assert results[0]["runs"][0]["file"] == results[1]["runs"][0]["file"]  # the same file on both ranks


def _two_jobs_one_run_id(rank, world_size, path):
    """Two jobs named alike (torchrun's static rendezvous calls every run ``none``)."""
    import os
    import stat

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig, enable_shared_memory_all_gather

    model = load_hsdp_model(path, HSDPInferenceConfig()).model
    first = enable_shared_memory_all_gather(model, run_id="none")
    second = enable_shared_memory_all_gather(model, run_id="none")
    mode = stat.S_IMODE(os.stat(first.directory).st_mode)
    out = {"dirs": [first.directory, second.directory], "both_exist": all(map(os.path.isdir, [first.directory,
                                                                                            second.directory])),
           "mode": oct(mode)}
    import torch.distributed as dist

    dist.barrier()
    first.close()
    second.close()
    return out


def test_jobs_sharing_a_run_id_never_share_memory(tmp_path, llama):
    results = values(run_ranks(_two_jobs_one_run_id, 2, tmp_path, llama, timeout=240))
    for r in results:
        first, second = r["dirs"]
        assert first != second and r["both_exist"] and r["mode"] == "0o700"
        assert first.startswith("/dev/shm/hsdp-none-") and second.startswith("/dev/shm/hsdp-none-")
    assert results[0]["dirs"] == results[1]["dirs"]  # within a job, every rank agrees on the names


def _shm_unavailable(rank, world_size, path):
    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig, enable_shared_memory_all_gather

    model = load_hsdp_model(path, HSDPInferenceConfig()).model
    return enable_shared_memory_all_gather(model, min_free_bytes=1 << 60) is None  # more than any /dev/shm


def test_shared_memory_all_gather_declines_on_every_rank(tmp_path, llama):
    assert values(run_ranks(_shm_unavailable, 2, tmp_path, llama, timeout=240)) == [True, True]


def test_prefetch_depth_must_be_positive():
    from torch import nn

    from shard_engine import enable_forward_prefetch

    with pytest.raises(ValueError, match="depth"):
        enable_forward_prefetch(nn.Linear(2, 2), depth=0)


def test_server_reports_residency_and_serves_the_same_tokens(tmp_path, llama):
    from tests.checkpoints import PROMPTS, reference_generate
    from tests.server_process import ServerProcess

    server = ServerProcess(llama, extra_args=("--resident-units", "all", "--prefetch-depth", "1", "--all-gather", "group"),
                           log_path=tmp_path / "log")
    try:
        server.poll_ready()
        residency = server.client.get("/info").json()["residency"]
        assert residency["units"] == residency["of"] > 0 and residency["prefetch_depth"] == 1
        # every unit resident: nothing is gathered after startup; with --all-gather group the copies
        # are private to each rank, not one shared copy for the host
        assert residency["all_gather"] == "none" and residency["shared_bytes"] == 0
        extra = residency["extra_bytes_per_rank"]
        assert len(extra) == 2 and all(e > 0 for e in extra)
        metrics = server.client.get("/metrics").text
        assert f"hsdp_resident_units {float(residency['units'])}" in metrics
        assert f'hsdp_resident_bytes{{rank="1"}} {float(extra[1])}' in metrics
        r = server.client.post("/generate", json={"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 12,
                                                                                       "details": True}})
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == reference_generate(llama, PROMPTS[2:3], 12)[0]
    finally:
        assert server.stop() == 0, server.log_tail()


def test_server_with_nothing_resident_gathers_leaf_units_in_the_ring(tmp_path, llama):
    """``--resident-units 0`` on one host: gathers through shared memory, the leaf units through
    the two-slot ring; greedy tokens of concurrent requests (one rank idles while the other
    finishes: idle forwards fill the slots too) equal transformers'."""
    import threading

    from tests.checkpoints import PROMPTS, reference_generate
    from tests.server_process import ServerProcess

    server = ServerProcess(llama, extra_args=("--resident-units", "0"), log_path=tmp_path / "log")
    try:
        server.poll_ready()
        info = server.client.get("/info").json()
        assert info["residency"]["units"] == 0 and info["residency"]["all_gather"] == "shm"
        # lockstep: a forward gathers, so the shard group steps as one
        assert [r["step_group"] for r in info["ranks"]] == [0, 0]
        assert all(r["memory"]["gather_ring"] > 0 for r in info["ranks"])
        results = {}

        def run(i, n):
            r = server.client.post("/generate", json={"inputs": PROMPTS[i], "parameters": {
                "max_new_tokens": n, "details": True}})
            results[i] = (r.status_code, [t["id"] for t in r.json()["details"]["tokens"]], n)

        threads = [threading.Thread(target=run, args=(i, n)) for i, n in ((0, 6), (1, 14), (2, 10))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, (status, ids, n) in results.items():
            assert status == 200 and ids == reference_generate(llama, PROMPTS[i:i + 1], n)[0], i
        assert len(results) == 3
    finally:
        assert server.stop() == 0, server.log_tail()


def test_a_crashed_jobs_shared_memory_is_swept_by_the_next_start(tmp_path):
    """Every rank leaves a pid file in the directories it uses; a directory none of whose ranks
    lives, and that is older than a minute, goes at the next start (sweep_stale)."""
    import os
    import subprocess
    import sys
    import time

    from shard_engine import sweep_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    old = time.time() - 3600
    dirs = {}
    for name, pids, age in [("crashed", [dead_pid], old), ("alive", [dead_pid, os.getpid()], old),
                            ("starting", [], time.time()), ("no-pids-old", [], old)]:
        path = tmp_path / f"hsdp-test-{name}"
        path.mkdir()
        for pid in pids:
            (path / f"pid-{pid}").touch()
        (path / "slot0-1").touch()
        os.utime(path, (age, age))
        dirs[name] = path
    (tmp_path / "other-file").touch()
    removed = sweep_stale(str(tmp_path))
    assert sorted(removed) == sorted(str(dirs[n]) for n in ("crashed", "no-pids-old"))
    assert dirs["alive"].exists() and dirs["starting"].exists() and (tmp_path / "other-file").exists()


def test_exits_that_skip_atexit_still_remove_this_processes_shared_memory(tmp_path):
    """The step watchdog and the orphaned torchrun worker leave by os._exit, which skips atexit:
    they call remove_owned_now() first, which removes every directory the pools and shared
    weights of this process registered."""
    from shard_engine import remove_owned_now
    from shard_engine.shm import own

    dirs = [tmp_path / "hsdp-a-g0", tmp_path / "hsdp-a-w0"]
    for d in dirs:
        d.mkdir()
        (d / "slot0-1").write_bytes(b"x")
        own(str(d))
    remove_owned_now()
    assert not any(d.exists() for d in dirs)
