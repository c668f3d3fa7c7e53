"""Independent step groups: each runs its own steps. Two replicas (``--replicate-size 2
--shard-size 1``), and the two ranks of one shard group when every unit is resident (the CPU
default: a forward runs no collective, so each rank steps alone). A slow group does not delay the
other, an idle one runs no forward, and requests are placed by cached prefix, then open requests."""

import json
import threading
import time

import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import ServerProcess
from tests.waiting import wait_until

SLOW_S = 0.4  # every forward of rank 0 (replica 0) takes this much longer


LAYOUTS = {
    # (server arguments, the mesh it makes, each rank's mesh replica)
    "replicas": (("--replicate-size", "2", "--shard-size", "1"), {"replicate": 2, "shard": 1}, [0, 1]),
    "resident-shard-group": ((), {"replicate": 1, "shard": 2}, [0, 0]),
}
# Equal KV pools on both ranks: two idle replicas then tie on every placement key (open requests,
# the step in progress, free blocks) and the first, replica 0, takes the slow request. With auto
# sizing each rank measures free memory at its own start, and the one that measured more took it
# now and then (its request was then the fast one, and the test proved nothing).
KV = ("--kv-cache-memory", "64MiB")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    path = write_checkpoint(root / "llama", "llama")
    args, mesh, replicas = LAYOUTS[request.param]
    server = ServerProcess(path, extra_args=(*args, *KV),
                           log_path=root / "server.log", env={"HSDP_INJECT_FORWARD_DELAY": f"0:{SLOW_S}"})
    server.layout = (mesh, replicas)
    try:
        server.poll_ready(timeout=180)
        yield server
    finally:
        server.stop()


def _ranks(server) -> dict[int, dict]:
    return {r["rank"]: r for r in server.client.get("/info").json()["ranks"]}


def _stream(server, prompt: str, n: int, out: dict) -> threading.Thread:
    def run():
        times = []
        with server.client.stream("POST", "/generate_stream", json={
                "inputs": prompt, "parameters": {"max_new_tokens": n, "stop": []}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    times.append(time.monotonic())
                    out["last"] = json.loads(line[5:])
        out["times"] = times

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_slow_replica_does_not_delay_the_other(served):
    info = served.client.get("/info").json()
    mesh, replicas = served.layout
    assert info["mesh_shape"] == mesh
    assert [(r["rank"], r["replica"], r["step_group"]) for r in info["ranks"]] == [(0, replicas[0], 0),
                                                                                   (1, replicas[1], 1)]
    slow, fast = {}, {}
    slow_thread = _stream(served, "the slow replica", 14, slow)  # both idle: replica 0 takes it
    wait_until(lambda: "last" in slow, 30, "the slow request's first token")  # decoding, one token per SLOW_S
    fast_thread = _stream(served, "the fast replica", 16, fast)  # replica 0 has an open request: replica 1
    fast_thread.join(30)
    assert not fast_thread.is_alive() and len(fast["times"]) == 16
    gaps = [b - a for a, b in zip(fast["times"], fast["times"][1:])]
    assert slow_thread.is_alive(), "the slow request finished first: the test proves nothing"
    # in lockstep every step would wait for replica 0's SLOW_S
    assert sorted(gaps)[len(gaps) // 2] < SLOW_S / 4, gaps
    slow_thread.join(60)
    assert len(slow["times"]) == 14
    ranks = _ranks(served)
    assert ranks[0]["sequences_started"] >= 2 and ranks[1]["sequences_started"] >= 2  # warm-up + one each


@pytest.mark.slow
def test_an_idle_replica_runs_no_forward(served):
    prompt = "one prompt, long enough to fill a block of the prefix cache and be placed by it " * 2
    first = served.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 2}})
    assert first.status_code == 200
    before = _ranks(served)
    for _ in range(3):  # one after another: the replica that holds the prompt's prefix takes them all
        assert served.client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 3}}
                                  ).status_code == 200
    after = _ranks(served)
    moved = [r for r in (0, 1) if after[r]["forwards"] != before[r]["forwards"]]
    assert len(moved) == 1, (before, after)
    busy, idle = moved[0], 1 - moved[0]
    assert after[busy]["forwards"] - before[busy]["forwards"] >= 3 * 3
    assert after[idle]["tokens_computed"] == before[idle]["tokens_computed"]
