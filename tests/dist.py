"""Run a function on several CPU ranks (gloo), with a rendezvous that cannot collide and a hard timeout."""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.masking_utils", "transformers.modeling_utils",
           "loaders", "shard_engine", "server.engine", "pytest", "tests.checkpoints"]
"""What the ranks' fork server imports once a session, so that each rank is forked with it loaded
instead of importing it again (seconds a rank on 2 cores; the suite runs ranks ~60 times)."""


@dataclass
class RankResult:
    rank: int
    value: object = None
    error_type: str | None = None
    error: object = None  # the exception itself where it pickles, else its text
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.error_type is None


def _entry(fn, rank, world_size, store_path, out_dir, args, pg_timeout_s, environment):
    os.environ.clear()  # the test's environment now, not the fork server's when it started
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = RankResult(rank)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        result.value = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.error_type = type(e).__name__
        result.traceback = traceback.format_exc()
        try:
            pickle.dumps(e)
            result.error = e
        except Exception:  # noqa: BLE001
            result.error = str(e)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn, world_size: int, tmp_path, *args, timeout: float = 240, pg_timeout_s: float = 60) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (forks of a fork server that
    has imported torch and the project: :data:`PRELOAD`); return per-rank results.

    Every process is killed when ``timeout`` passes, and the call raises TimeoutError: a hang fails.
    """
    run_dir = tmp_path / f"ranks-{time.monotonic_ns()}"
    run_dir.mkdir()
    mp.set_forkserver_preload(PRELOAD)
    ctx = mp.get_context("forkserver")
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, str(run_dir / "store"), str(run_dir), args, pg_timeout_s, dict(os.environ)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout} s")
    results = []
    for rank in range(world_size):
        path = run_dir / f"rank{rank}.pkl"
        if not path.exists():
            raise RuntimeError(f"rank {rank} exited with code {procs[rank].exitcode} and no result")
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    return results


def values(results: list[RankResult]) -> list:
    """The per-rank values, failing with the first rank's traceback if any rank raised."""
    for r in results:
        if not r.ok:
            raise AssertionError(f"rank {r.rank} raised {r.error_type}:\n{r.traceback}")
    return [r.value for r in results]
