"""Faults against the real server: overload, abandoned clients, a dead or stuck rank. Nothing hangs."""

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import ServerProcess, rank_pids, wait_session_gone
from tests.waiting import wait_until

# Long enough (tens of seconds) that nothing finishes by itself while a test provokes a fault.
LONG = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 3000}}
ROOM = ("--max-total-tokens", "4000")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "llama", "llama")


def _stream_in_background(url, body, events, first_token):
    def run():
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                with c.stream("POST", "/generate_stream", json=body) as r:
                    events.append(("status", r.status_code))
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            events.append(("data", json.loads(line[5:])))
                            first_token.set()
        except httpx.HTTPError as e:
            events.append(("transport", repr(e)))
        events.append(("end", time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _open_requests(server) -> float:
    """Sequences running and waiting, from /metrics."""
    gauges = {}
    for line in server.client.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("hsdp_running_sequences", "hsdp_waiting_sequences"):
            gauges[name] = float(value)
    return sum(gauges.values())


def test_overload_gets_429_with_retry_after(model_dir, tmp_path):
    server = ServerProcess(model_dir, log_path=tmp_path / "log",
                           extra_args=(*ROOM, "--max-concurrent-requests", "1", "--max-queued-requests", "1",
                                       "--shutdown-timeout", "1"))
    try:
        server.poll_ready()
        first_token = threading.Event()
        for _ in range(2):
            _stream_in_background(server.url, LONG, [], first_token)
        assert first_token.wait(30)
        # the bound on open requests (running and queued, 1 + 1) is reached: both streams are in
        wait_until(lambda: _open_requests(server) == 2, 30, "both streams admitted or queued")
        r = server.client.post("/generate", json={"inputs": "one more"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error_type"] == "overloaded"
        r = server.client.post("/v1/completions", json={"prompt": "one more"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
    finally:
        server.stop()


def test_abandoned_requests_are_freed(model_dir, tmp_path):
    server = ServerProcess(model_dir, log_path=tmp_path / "log")
    try:
        server.poll_ready()

        def abandon(i):
            body = {"inputs": f"abandoned request {i}", "parameters": {"max_new_tokens": 200}}
            if i % 2:  # a stream read up to its first token, then closed
                with httpx.Client(base_url=server.url, timeout=30) as c:
                    with c.stream("POST", "/generate_stream", json=body) as r:
                        return next(r.iter_lines()).startswith("data:")
            try:  # a plain request whose client gives up (before its 200 tokens: on a fast host 0.3 s was not
                # always before them, 13 of 50 finished in one CI run)
                with httpx.Client(base_url=server.url, timeout=0.1) as c:
                    c.post("/generate", json=body)
            except httpx.TimeoutException:
                return True
            return False

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            abandoned = sum(pool.map(abandon, range(100)))
        assert abandoned >= 90
        start = time.monotonic()
        r = server.client.post("/generate", json={"inputs": "fresh", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200 and time.monotonic() - start < 5, server.log_tail()
        # A sequence leaves its rank at its group's next step, not with its last token: the
        # fresh request's own, or an abandoned one whose disconnect came last, may still count
        # for that long (once seen in CI, on a loaded host). A leak never reaches 0.
        wait_until(lambda: "hsdp_running_sequences 0.0" in server.client.get("/metrics").text, 10,
                   "every abandoned sequence freed")
    finally:
        server.stop()


def _shm_dirs() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hsdp-")}


def _assert_group_gone(server, deadline_s, shm_before=frozenset()):
    sid = server.proc.pid
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and server.proc.poll() is None:
        time.sleep(0.1)
    assert server.proc.poll() is not None, "the launcher did not exit"
    assert server.proc.returncode != 0
    assert not wait_session_gone(sid, max(1.0, deadline - time.monotonic())), "orphaned processes"
    # the shared-memory all-gather buffers of the dead group are gone too (the launcher's cleanup)
    assert not _shm_dirs() - shm_before


def _provoke(model_dir, tmp_path, extra_args, fault, after_error=lambda ranks: None):
    shm_before = _shm_dirs()
    server = ServerProcess(model_dir, log_path=tmp_path / "log", extra_args=(*ROOM, *extra_args))
    try:
        server.poll_ready()
        # one stream per rank: where each rank steps alone (every unit resident), a rank without
        # a request of its own runs no forward, and a fault in its forward would never come
        events, first = [], threading.Event()
        threads = [_stream_in_background(server.url, LONG, events, first)]
        assert first.wait(30)
        threads.append(_stream_in_background(server.url, LONG, events, threading.Event()))
        deadline = time.monotonic() + 30
        while sum(kind == "data" for kind, _ in events) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the second stream has its first tokens too
        ranks = rank_pids(server.client)
        assert set(ranks) == {0, 1}
        t0 = time.monotonic()
        fault(ranks)
        health = []  # (seconds after the fault, /health status or None)
        while time.monotonic() - t0 < 15 and server.proc.poll() is None:
            try:
                status = httpx.get(server.url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                status = None
            health.append((round(time.monotonic() - t0, 2), status))
            if not any(thread.is_alive() for thread in threads):
                break
            time.sleep(0.1)
        for thread in threads:
            thread.join(max(0.0, 15 - (time.monotonic() - t0)))
        assert not any(thread.is_alive() for thread in threads), "an in-flight request hung"
        errors = [e for kind, e in events if kind == "data" and "error" in e]
        assert errors or any(kind == "transport" for kind, _ in events), events[-3:]
        after_error(ranks)
        _assert_group_gone(server, 30, shm_before)
        return server, errors, health
    finally:
        server.stop()


def test_killed_rank_takes_the_group_down(model_dir, tmp_path):
    server, errors, health = _provoke(model_dir, tmp_path, (), lambda r: os.kill(r[1], signal.SIGKILL))
    assert errors and "failed" in errors[0]["error"], server.log_tail()
    # liveness tells the truth from the moment the rank is gone (rank 0 looks every 0.2 s; a
    # second allows for a loaded machine), not only once the group has exited
    statuses = [status for _, status in health]
    assert 503 in statuses and all(status != 200 for t, status in health if t > 1.0), health


def test_killed_rank_with_nothing_resident_takes_the_group_down(model_dir, tmp_path):
    """With nothing resident the ranks meet at a shared-memory barrier before every leaf unit
    (shard_engine's unit ring): a rank that dies leaves the other spinning there, and the group
    must still come down fast, not at the collective timeout."""
    server, errors, health = _provoke(model_dir, tmp_path, ("--resident-units", "0"),
                                      lambda r: os.kill(r[1], signal.SIGKILL))
    assert errors and "failed" in errors[0]["error"], server.log_tail()


@pytest.mark.parametrize("rank", [0, 1])
def test_exception_in_forward_takes_the_group_down(model_dir, tmp_path, monkeypatch, rank):
    # The rank's 30th forward raises, a few tokens into the long request (warm-up takes 2).
    monkeypatch.setenv("HSDP_INJECT_FORWARD_FAULT", f"{rank}:30")
    server, errors, health = _provoke(model_dir, tmp_path, (), lambda r: None)
    assert errors and "failed" in errors[0]["error"], server.log_tail()
    assert "injected fault" in open(tmp_path / "log").read()


@pytest.mark.parametrize("resident", ["auto", "0"])  # "0": rank 0 spins at a unit barrier of the ring
def test_stuck_step_trips_the_watchdog(model_dir, tmp_path, resident):
    # A stopped rank stands for a stuck one; once rank 0's watchdog has fired it is let go, so
    # that the SIGTERM the launcher sends it can act (a stopped process cannot die of it).
    server, errors, health = _provoke(model_dir, tmp_path, ("--step-timeout", "3", "--resident-units", resident),
                                      lambda r: os.kill(r[1], signal.SIGSTOP),
                                      after_error=lambda r: os.kill(r[1], signal.SIGCONT))
    log = open(tmp_path / "log").read()
    assert "step timeout" in log and "Thread 0x" in log  # every thread's stack was dumped
    assert errors and "step" in errors[0]["error"]
    assert 503 in [status for _, status in health]


def test_rank_stopped_while_idle_trips_the_watchdog(model_dir, tmp_path):
    """A peer stopped between steps blocks rank 0 in the control channel's broadcast, which is
    watched too: the group goes down instead of waiting out the collective timeout."""
    shm_before = _shm_dirs()
    server = ServerProcess(model_dir, log_path=tmp_path / "log", extra_args=("--step-timeout", "3"))
    try:
        server.poll_ready()
        ranks = rank_pids(server.client)
        os.kill(ranks[1], signal.SIGSTOP)  # no request: the ranks are between idle plans
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "step timeout" not in open(tmp_path / "log").read():
            time.sleep(0.1)
        os.kill(ranks[1], signal.SIGCONT)
        assert "step timeout" in open(tmp_path / "log").read(), server.log_tail()
        _assert_group_gone(server, 30, shm_before)
    finally:
        server.stop()


def _drain(model_dir, tmp_path, target):
    """SIGTERM while a request streams: it finishes, new requests get 503, the group exits."""
    server = ServerProcess(model_dir, log_path=tmp_path / "log", extra_args=(*ROOM, "--shutdown-timeout", "60"))
    try:
        server.poll_ready()
        events, first = [], threading.Event()
        body = {"inputs": "draining", "parameters": {"max_new_tokens": 400}}
        thread = _stream_in_background(server.url, body, events, first)
        assert first.wait(30)
        os.kill(target(server), signal.SIGTERM)
        deadline = time.monotonic() + 10
        ready = None
        while time.monotonic() < deadline:
            ready = server.client.get("/ready")
            if ready.status_code == 503:
                break
            time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["phase"] == "draining"
        r = server.client.post("/generate", json={"inputs": "too late"})
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
        thread.join(60)
        data = [e for kind, e in events if kind == "data"]
        assert data[-1]["details"]["generated_tokens"] == len(data), data[-1]
        server.proc.wait(60)
        assert not wait_session_gone(server.proc.pid), "orphaned processes"
        return server.proc.returncode
    finally:
        server.stop()


def test_sigterm_to_rank0_drains_and_every_rank_exits_0(model_dir, tmp_path):
    # The launcher exits 0 only when every rank did.
    assert _drain(model_dir, tmp_path, lambda s: rank_pids(s.client)[0]) == 0


def test_sigterm_to_the_launcher_drains_and_every_rank_exits_0(model_dir, tmp_path):
    assert _drain(model_dir, tmp_path, lambda s: s.proc.pid) == 0
