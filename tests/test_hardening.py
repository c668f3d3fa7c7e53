"""Nothing a client sends or withholds may stall, crash or mislead the server (issue 23).

One server for the module (2 CPU ranks, an API key, short deadlines), driven with real sockets
for the slow clients; a probe thread checks that ``/health`` answers within 1 s throughout, and
after the bad requests the group's pids and ``/health`` are unchanged. A few findings are tested
without a server (the parsers, the config, the response class).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server.api.openai.tools import FORMATS, StreamingToolParser
from tests.checkpoints import tokenizer, write_checkpoint
from tests.server_process import REPO, ServerProcess, rank_pids
from tests.waiting import wait_until

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_S, BODY_S, KEEP_ALIVE_S, SLOW_READER_S = 2.0, 2.0, 1.0, 1.0
EXTRA_TOKENS = ["<extra_a>", "<extra_b>", "<extra_c>"]
MAX_CONNECTIONS = 400


class HealthProbe:
    """GET /health every 0.1 s on a thread; ``worst`` is the slowest answer (a failure counts as 99 s)."""

    def __init__(self, url: str):
        self.url, self.worst, self.count = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    ok = client.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - t if ok else 99.0)
                self.count += 1
                self._stop.wait(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(40)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    path = write_checkpoint(root / "llama", "llama")
    # the tokenizer knows more tokens than the embedding has rows (as many checkpoints' added tokens)
    tok = tokenizer()
    extended = type(tok).from_pretrained(path)
    extended.add_tokens(EXTRA_TOKENS)
    extended.save_pretrained(path)
    server = ServerProcess(path, log_path=root / "server.log", env={"HSDP_INJECT_LOAD_DELAY": "0.02"}, extra_args=(
        "--api-key", KEY, "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S),
        "--keep-alive-timeout", str(KEEP_ALIVE_S), "--slow-reader-timeout", str(SLOW_READER_S),
        "--max-body-bytes", "65536", "--max-buffered-body-bytes", "131072", "--max-connections", str(MAX_CONNECTIONS)))
    try:
        while_loading = _requests_while_loading(server)
        server.poll_ready()
        yield server, path, while_loading
    finally:
        server.stop()


def _untitled(server) -> dict[int, str]:
    """The group's processes that `ps` shows as multiprocessing's, not as ours: {pid: command line}."""
    from tests.server_process import session_pids

    found = {}
    for pid in session_pids(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "multiprocessing.spawn" in cmdline or "multiprocessing.forkserver" in cmdline:
            found[pid] = cmdline[:120]
    return found


def _requests_while_loading(server) -> dict:
    """What /generate, /v1/completions and /tokenize answer before the model is ready (and, under
    "titles", any process seen without its title from the start)."""
    seen: dict = {"titles": {}}  # pid -> (first and last time seen untitled)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = time.monotonic()
        for pid in _untitled(server):
            seen["titles"][pid] = (seen["titles"].get(pid, (now,))[0], now)
        try:
            ready = server.client.get("/ready", timeout=2)
        except httpx.TransportError:
            time.sleep(0.02)
            continue
        if ready.status_code == 200:
            break
        for path, body in (("/generate", {"inputs": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                           ("/tokenize", {"inputs": "hi"})):
            r = server.client.post(path, json=body, headers=AUTH, timeout=10)
            seen.setdefault(path, set()).add(r.status_code)
    return seen


def _raw(server, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    if data:
        s.sendall(data)
    return s


def _closed_within(s: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closes ``s`` (reading what it sends), failing past ``limit_s``."""
    start, received = time.monotonic(), b""
    s.settimeout(limit_s)
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        except socket.timeout:
            pytest.fail(f"not closed within {limit_s} s")
        if not chunk:
            break
        received += chunk
    return time.monotonic() - start, received


def _kv_used(server) -> int:
    return sum(r["kv_blocks"]["used"] for r in server.client.get("/info", headers=AUTH).json()["ranks"])


def _wait_kv_free(server, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while (used := _kv_used(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


# -- without a server ------------------------------------------------------------------------------

def test_help_lists_every_option():
    out = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the lines
    assert "90% of what is free" in text and "--slow-reader-timeout" in text


def test_the_options_import_no_torch():
    """``--help`` and a usage error answer before torch (2-5 s of imports) or the ranks' fork server start."""
    code = "import sys, server.config; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
    out = subprocess.run([sys.executable, "-m", "server", "--no-such-flag"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "unrecognized arguments: --no-such-flag" in out.stderr


def test_an_api_key_file_is_read_once(tmp_path):
    """``--api-key-file`` may be a pipe (``<(pass show ...)``, /dev/stdin): the options are parsed once, so
    its contents are there when the server reads them. The key a FIFO gives reaches the checks past
    the options: here, the model, which does not exist."""
    import threading

    fifo = tmp_path / "key"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("a-key-from-a-pipe\n"), daemon=True)
    writer.start()
    out = subprocess.run([sys.executable, "-m", "server", "--api-key-file", str(fifo), "--model",
                          str(tmp_path / "no-such-model")], cwd=REPO, capture_output=True, text=True, timeout=120)
    writer.join(5)
    assert "api-key-file" not in out.stderr and "no-such-model" in out.stderr, out.stderr[-2000:]


def test_whitespace_in_streamed_tool_arguments_costs_microseconds_a_token():
    """The old trailing-brace regex was cubic in a run of whitespace: 3,000 spaces took minutes."""
    for head in ('<tool_call>\n{"name": "f", "arguments": {"a":', "<tool_call>\n{"):
        parser = StreamingToolParser(FORMATS["hermes"], {"f"})
        deltas = parser.feed(head)
        start = time.perf_counter()
        for _ in range(3000):
            deltas += parser.feed(" ")
        elapsed = time.perf_counter() - start
        tail = ' 1}}\n</tool_call>' if "arguments" in head else '"name": "f", "arguments": {"a": 1}}\n</tool_call>'
        deltas += parser.feed(tail, final=True)
        assert elapsed < 1.0, f"{elapsed / 3000 * 1e6:.0f} us a token"
        assert [c.name for c in parser.calls] == ["f"] and json.loads(parser.calls[0].arguments) == {"a": 1}
        assert "".join(d.arguments or "" for d in deltas) == parser.calls[0].arguments


def test_stop_strings_and_tags_are_held_back_in_time_linear_in_their_length():
    from server.api.detokenize import held_back

    stop = "a" * 255 + "b"
    start = time.perf_counter()
    for _ in range(1000):
        held_back("a" * 300, [stop] * 16)
    assert time.perf_counter() - start < 2.0
    assert held_back("xxab", ["abc"]) == 2 and held_back("xxa", ["abc", "ac"]) == 1 and held_back("x", ["abc"]) == 0


def test_config_refuses_keys_a_header_cannot_carry_and_bad_deadlines():
    from server.config import ServeConfig

    with pytest.raises(ValueError, match="printable ASCII"):
        ServeConfig(api_key="ключ")
    with pytest.raises(ValueError, match="printable ASCII"):
        ServeConfig(api_key="two words")
    with pytest.raises(ValueError, match="--slow-reader-timeout"):
        ServeConfig(slow_reader_timeout_s=0)
    with pytest.raises(ValueError, match="--max-buffered-body-bytes"):
        ServeConfig(max_body_bytes=2 << 20, max_buffered_body_bytes=1 << 20)


def test_every_variable_the_server_reads_is_declared():
    from server.config import unknown_variables

    read = {"HSDP_INJECT_FORWARD_FAULT": "1:2", "HSDP_INJECT_FORWARD_DELAY": "1:0.1", "HSDP_INJECT_LOAD_DELAY": "0.1",
            "HSDP_INJECT_GRAMMAR_LIMITS": "max_lexer_states=20"}
    assert unknown_variables(read) == []
    assert unknown_variables({"HSDP_NOT_A_THING": "1"}) == ["HSDP_NOT_A_THING"]


def test_the_docs_table_the_limits_and_timeouts():
    from server.config import render_limits_markdown

    with open(f"{REPO}/docs/options.md") as f:
        options = f.read()
    assert render_limits_markdown() in options  # regenerate with `python -m server.config --limits`
    assert "**Security model.**" in options


def test_a_nan_logprob_is_null_not_a_500():
    from server.http.responses import FiniteJSONResponse

    body = json.loads(FiniteJSONResponse({"a": [1.0, math.nan, {"b": -math.inf}], "c": "x"}).body)
    assert body == {"a": [1.0, None, {"b": None}], "c": "x"}


def test_an_unexpected_exception_is_the_apis_json_500():
    """A bug in a handler answers each API's JSON error envelope, never Starlette's plain text."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.http.errors import register_error_handlers

    app = FastAPI()
    register_error_handlers(app)

    @app.get("/v1/boom")
    @app.get("/boom")
    def boom():
        raise AttributeError("a bug")

    client = TestClient(app, raise_server_exceptions=False)
    r = client.get("/v1/boom")
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: AttributeError: a bug"
    r = client.get("/boom")
    assert r.status_code == 500 and r.json() == {"error": "internal error: AttributeError: a bug", "error_type": "internal"}


def test_a_full_shared_memory_is_a_named_error_not_sigbus(tmp_path, monkeypatch):
    import errno
    import os

    from shard_engine import shm

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "slot0-1"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="cannot reserve 4096 bytes of shared memory for .*slot0-1"):
            shm.reserve_shared_file(fd, 4096, str(path))
    finally:
        os.close(fd)


def test_a_slow_stream_to_a_client_that_reads_nothing_is_cut_off():
    """A stream that produces slowly (a busy server: 1 KB every 0.4 s) to a client that reads
    nothing: the kernel's send buffer takes tens of KB before the transport's own buffer grows, so
    a cut that waited for the latter came many seconds (in a soak, minutes) late. The kernel's
    count of bytes the peer acknowledged stops at once: cut within the timeout of that."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from server.config import ServeConfig
    from server.http.listener import start_http_server
    from tests.server_process import free_port

    async def slow(request):
        async def frames():
            for _ in range(200):
                yield b"data: " + b"x" * 1018 + b"\n\n"
                await asyncio.sleep(0.4)
        return StreamingResponse(frames(), media_type="text/event-stream")

    cfg = ServeConfig(port=free_port(), slow_reader_timeout_s=1.0)
    server = start_http_server(Starlette(routes=[Route("/slow", slow)]), cfg)
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", cfg.port))
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n")
        start = time.monotonic()
        # the client's window (a few KB) is full within ~5 frames, 2 s; the kernel's send buffer
        # (16 KB and growing) would take 40 frames and more
        while s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1 and time.monotonic() - start < 30:
            time.sleep(0.1)
        closed_after = time.monotonic() - start
    finally:
        s.close()
        server.should_exit = True
    assert closed_after < 7.0, f"cut after {closed_after:.1f} s"


def test_health_fails_while_a_step_group_is_stuck_with_work():
    from fastapi.testclient import TestClient

    from server.http.app import build_app
    from server.engine import BlockPool, Scheduler
    from server.http.metrics import ServerMetrics
    from server.http.state import ServerState

    scheduler = Scheduler(pools=[BlockPool(8, 16)], replicas=[[0]], max_running=4, max_queued=4,
                          max_total_tokens=64, max_prefill_tokens=64, eos_token_ids={0})
    state = ServerState(model_names=["m"], model_path="/x", model_source="directory", dtype="float32",
                        mesh_shape=(1, 1), world_size=1, metrics=ServerMetrics(), liveness_timeout_s=0.3)
    state.scheduler = scheduler
    state.set_phase("ready")
    client = TestClient(build_app(state), base_url="http://localhost")
    assert client.get("/health").status_code == 200
    scheduler.step_began(time.perf_counter())  # a step went out and never came back
    assert client.get("/health").status_code == 200  # within the bound
    time.sleep(0.4)  # past the 0.3 s bound: the wait is what is tested
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "stalled" and "--liveness-timeout" in r.json()["error"]
    scheduler.step_ended(0.4)
    assert client.get("/health").status_code == 200


# -- the server -------------------------------------------------------------------------------------

def test_every_rank_is_named_from_its_start(served):
    """Every process of the group is named within moments of its start: the ranks' fork server
    before its imports (``ps`` showed ``python3 -c from multiprocessing.forkserver ...``), the
    ranks it forks as they start."""
    _, _, while_loading = served
    untitled_for = {pid: last - first for pid, (first, last) in while_loading["titles"].items()}
    assert all(s < 0.5 for s in untitled_for.values()), untitled_for


def test_nothing_answers_500_while_loading(served):
    _, _, while_loading = served
    statuses_by_path = {k: v for k, v in while_loading.items() if k.startswith("/")}
    assert statuses_by_path, "the load was too quick to be seen"
    for path, statuses in statuses_by_path.items():
        assert statuses <= {503, 200}, (path, statuses)
        assert 503 in statuses, (path, statuses)


def test_half_sent_headers_get_408_and_are_closed(served):
    server, _, _ = served
    with HealthProbe(server.url) as probe:
        sockets = [_raw(server, b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-") for _ in range(150)]
        silent = [_raw(server) for _ in range(20)]
        took, answer = _closed_within(sockets[0], HEADER_S + 3)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        for s in sockets[1:] + silent:
            _closed_within(s, HEADER_S + 3)
    assert probe.worst < 1.0, probe.worst
    assert HEADER_S - 0.5 < took < HEADER_S + 2


def test_a_stalled_body_gets_408(served):
    server, _, _ = served
    s = _raw(server, b"POST /generate HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"inputs\": ")
    took, answer = _closed_within(s, BODY_S + 5)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:300]
    assert took < BODY_S + 2


def test_stalled_uploads_cannot_hold_more_than_the_buffer_budget(served):
    """Two uploads of 60 KiB bodies stall near their ends: the budget (128 KiB) is held; a third
    is refused with 503 at once, and once they time out it is served again."""
    server, _, _ = served
    head = (b"POST /generate HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 61440\r\n\r\n")
    stalled = [_raw(server, head + b" " * 61000) for _ in range(2)]
    wait_until(lambda: _metric(server, "hsdp_buffered_body_bytes") >= 2 * 61000, 10, "both bodies read as far as sent")
    third = _raw(server, head + b" " * 61000)
    _, answer = _closed_within(third, BODY_S + 5)
    assert answer.startswith(b"HTTP/1.1 503") and b"--max-buffered-body-bytes" in answer, answer[:300]
    for s in stalled:
        _closed_within(s, BODY_S + 5)
    r = server.client.post("/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 2}}, headers=AUTH)
    assert r.status_code == 200


def test_an_idle_keep_alive_connection_is_closed(served):
    server, _, _ = served
    s = _raw(server, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    took, answer = _closed_within(s, KEEP_ALIVE_S + 4)
    assert answer.startswith(b"HTTP/1.1 200") and took < KEEP_ALIVE_S + 2


def _metric(server, line_start: str) -> float:
    for line in server.client.get("/metrics", headers=AUTH).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_stops_reading_is_cut_off_and_its_sequences_freed(served):
    """64 streams of 240 tokens with 20 alternatives each (megabytes of frames) to a client that
    reads nothing: cut off within --slow-reader-timeout of its buffers filling, its sequences
    cancelled while they still run, their KV blocks freed; /health answers throughout."""
    server, _, _ = served
    body = json.dumps({"prompt": "Once", "max_tokens": 240, "stream": True, "ignore_eos": True, "logprobs": 20,
                       "n": 64}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
               + body)
    cut = 'hsdp_connections_timed_out_total{deadline="slow_reader"}'
    cancelled = 'hsdp_failures_total{reason="cancelled"}'
    cut_before, cancelled_before = _metric(server, cut), _metric(server, cancelled)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffers fill soon
    s.connect(("127.0.0.1", server.port))
    s.sendall(request)
    start = time.monotonic()
    with HealthProbe(server.url) as probe:
        while _kv_used(server) == 0 and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert _kv_used(server) > 0, "the request never ran"
        while _metric(server, cut) == cut_before and time.monotonic() - start < 30:
            time.sleep(0.1)
        cut_after = time.monotonic() - start
        assert _wait_kv_free(server) == 0
    assert probe.worst < 1.0, probe.worst
    assert _metric(server, cut) == cut_before + 1 and cut_after < SLOW_READER_S + 10, cut_after
    assert _metric(server, cancelled) >= cancelled_before + 1  # still running when cut: cancelled, not finished
    s.settimeout(5)
    received = b""
    try:
        while chunk := s.recv(65536):
            received += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    assert b"[DONE]" not in received  # cut off, not served to the end


def test_connections_beyond_the_cap_get_503_but_probes_are_answered(served):
    server, _, _ = served

    def models_status() -> int:
        return httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).status_code

    held = [_raw(server) for _ in range(MAX_CONNECTIONS)]
    try:
        wait_until(lambda: models_status() == 503, 10, "a request past the cap refused with 503")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # a probe: past the cap
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
    wait_until(lambda: models_status() == 200, 10, "served again once the held connections close")


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Pss")


def test_the_slow_client_drill(served):
    """Hundreds of half-sent headers, tens of stalled bodies, a stream that never reads, all at
    once: /health answers within 1 s throughout, rank 0 grows by less than 100 MB, and every such
    connection is closed within its deadline."""
    server, _, _ = served
    rank0 = rank_pids(httpx.Client(base_url=server.url, headers=AUTH))[0]
    before = _pss(rank0)
    stalled_head = (b"POST /generate HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: 61440\r\n\r\n")
    body = json.dumps({"prompt": "Once", "max_tokens": 240, "stream": True, "ignore_eos": True, "logprobs": 20,
                       "n": 64}).encode()  # megabytes more than the socket buffers hold
    never_reads = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
                   + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                   + b"\r\n\r\n" + body)
    cut = 'hsdp_connections_timed_out_total{deadline="slow_reader"}'
    cut_before = _metric(server, cut)
    with HealthProbe(server.url) as probe:
        start = time.monotonic()
        headers = [_raw(server, b"GET /v1/models HTTP/1.1\r\nHost: local") for _ in range(300)]
        bodies = [_raw(server, stalled_head + b" " * 30000) for _ in range(30)]
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", server.port))
        reader.sendall(never_reads)
        peak = _pss(rank0)
        for s in headers:
            _closed_within(s, HEADER_S + 3 - (time.monotonic() - start))
        for s in bodies:  # 408 at the body deadline, or 503 at once past the buffer budget
            _, answer = _closed_within(s, BODY_S + 3 - (time.monotonic() - start))
            assert answer.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")), answer[:60]
        # its buffers fill (megabytes of frames: how soon depends on the machine's speed), then
        # nothing is taken for --slow-reader-timeout and it is cut off
        deadline = time.monotonic() + 90
        while _metric(server, cut) == cut_before and time.monotonic() < deadline:
            time.sleep(0.2)
        closed_by_server = False
        reader.settimeout(10)
        try:
            while reader.recv(1 << 20):
                pass
            closed_by_server = True  # read to the end of what was sent before the cut: then EOF
        except ConnectionResetError:
            closed_by_server = True
        except socket.timeout:
            pass  # still open
        reader.close()
        assert _wait_kv_free(server) == 0
        peak = max(peak, _pss(rank0))
    assert probe.worst < 1.0, probe.worst
    assert _metric(server, cut) == cut_before + 1 and closed_by_server
    assert peak - before < 100 * 2**20, (peak - before) / 2**20


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 8}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, "n"),
    ("/v1/completions", {"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x" * 257]}, "stop"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
])
def test_openai_requests_over_a_bound_get_400_naming_the_parameter(served, path, body, param):
    server, _, _ = served
    before = rank_pids(httpx.Client(base_url=server.url, headers=AUTH))
    r = server.client.post(path, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"], r.text
    assert rank_pids(httpx.Client(base_url=server.url, headers=AUTH)) == before
    assert server.client.get("/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"inputs": "a", "parameters": {"best_of": 65, "do_sample": True}}, "best_of"),
    ("/generate", {"inputs": "a", "parameters": {"top_n_tokens": 21}}, "top_n_tokens"),
    ("/generate", {"inputs": "a", "parameters": {"stop": ["s"] * 17}}, "stop"),
    ("/tokenize", {"inputs": "q " * 30000}, "inputs"),  # ~30,000 tokens in 60 KB
])
def test_tgi_requests_over_a_bound_get_422_naming_the_parameter(served, path, body, param):
    server, _, _ = served
    r = server.client.post(path, json=body, headers=AUTH)
    assert r.status_code == 422 and param in r.json()["error"], r.text


def test_integers_past_64_bits_never_reach_the_control_channel(served):
    """A top_k of 10**20 crossed the control channel as an integer msgpack cannot carry: the plan
    failed to encode and the group stopped (found by the fuzz pass). It means every token."""
    server, _, _ = served
    before = rank_pids(httpx.Client(base_url=server.url, headers=AUTH))
    r = server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "top_k": 10**20}, headers=AUTH)
    assert r.status_code == 200, r.text
    r = server.client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 2, "top_k": 10**20,
                                                                             "do_sample": True}}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert rank_pids(httpx.Client(base_url=server.url, headers=AUTH)) == before


def test_token_ids_are_checked_against_the_embedding(served):
    server, path, _ = served
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    assert len(type(tokenizer()).from_pretrained(path)) == vocab + len(EXTRA_TOKENS)
    before = rank_pids(httpx.Client(base_url=server.url, headers=AUTH))
    for body, param in (({"prompt": [1, vocab], "max_tokens": 2}, "prompt"),
                        ({"prompt": "a", "max_tokens": 2, "logit_bias": {str(vocab + 1): 5}}, "logit_bias")):
        r = server.client.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = server.client.post("/v1/completions", json={"prompt": [1, vocab - 1], "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert rank_pids(httpx.Client(base_url=server.url, headers=AUTH)) == before


def test_a_key_header_outside_latin1_is_401_not_500(served):
    server, _, _ = served
    s = _raw(server, b"GET /info HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer \xd0\xba\xff\r\n"
                     b"Connection: close\r\n\r\n")
    _, answer = _closed_within(s, 10)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]


def test_metrics_need_the_key(served):
    server, _, _ = served
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_foreign_host_header_is_refused(served):
    """DNS rebinding: a page on evil.example resolving its name to 127.0.0.1 sends its own Host."""
    server, _, _ = served
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": "evil.example"}, timeout=10)
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": f"localhost:{server.port}"}, timeout=10)
    assert r.status_code == 200


def test_cache_salt_keeps_tenants_apart_in_the_prefix_cache(served):
    server, _, _ = served
    prompt = "The prefix cache shares blocks between requests that begin alike. " * 4

    def hit_tokens() -> int:
        return sum(r["prefix_cache"]["hit_tokens"] for r in server.client.get("/info", headers=AUTH).json()["ranks"])

    def complete(salt):
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        assert server.client.post("/v1/completions", json=body, headers=AUTH).status_code == 200

    complete("tenant-a")
    before = hit_tokens()
    complete("tenant-b")
    complete(None)
    assert hit_tokens() == before  # another salt (or none) finds nothing of tenant a's
    complete("tenant-a")
    assert hit_tokens() > before


def test_the_group_is_unchanged_after_the_bad_requests(served):
    server, _, _ = served
    r = server.client.post("/generate", json={"inputs": "still here", "parameters": {"max_new_tokens": 3}},
                           headers=AUTH)
    assert r.status_code == 200
    assert server.client.get("/health").json()["status"] == "ok"
    assert _wait_kv_free(server) == 0
    assert len(rank_pids(httpx.Client(base_url=server.url, headers=AUTH))) == 2
