"""Launch paths of the real server: under torchrun directly, idle past the collective timeout,
and `make serve` in a terminal stopped with Ctrl-C."""

import contextlib
import fcntl
import hashlib
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time

import httpx
import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import REPO, ServerProcess, free_port, rank_pids, session_pids, wait_session_gone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("launch") / "llama", "llama")


def test_idle_longer_than_the_collective_timeout_still_serves(model_dir, tmp_path):
    server = ServerProcess(model_dir, extra_args=("--collective-timeout", "2"), log_path=tmp_path / "log")
    try:
        server.poll_ready()
        time.sleep(5)  # well past the 2 s timeout with no request
        r = server.client.post("/generate", json={"inputs": "still here", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200, server.log_tail()
        assert server.client.get("/health").status_code == 200
    finally:
        server.stop()


def test_runs_under_torchrun(model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "server", "--model", model_dir,
         "--device", "cpu", "--port", str(port)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            while time.monotonic() < deadline:
                assert proc.poll() is None, open(tmp_path / "log").read()[-3000:]
                try:
                    if client.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            info = client.get("/info").json()
            assert info["world_size"] == 2
            workers = rank_pids(client)
            titles = {r: open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip() for r, pid in workers.items()}
            assert titles == {0: "hsdp-serve rank 0/2", 1: "hsdp-serve rank 1/2"}
            r = client.post("/generate", json={"inputs": "torchrun", "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 200
        log_text = open(tmp_path / "log").read()
        assert "[rank0]" in log_text
    finally:
        # torchrun passes SIGTERM to its workers (in sessions of their own, out of killpg's reach)
        # and waits for them: the group drains and exits.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            log.close()
        assert not [pid for pid in workers.values() if os.path.exists(f"/proc/{pid}")], "torchrun left workers"


class MakeServeInATerminal:
    """``make serve`` as a user starts it: make is the job in a terminal (a pty here) of its own
    session, so Ctrl-C typed there is the terminal's SIGINT to the foreground process group."""

    def __init__(self, model_dir, log_path):
        self.port = free_port()
        self.master, slave = pty.openpty()
        self.log = open(log_path, "w")
        self.log_path = log_path
        args = f"--model {model_dir} --device cpu --port {self.port} --shutdown-timeout 30"
        # -o: the Makefile's install stamp for this environment counts as made (the suite runs installed)
        stamp = ".install-stamp-" + hashlib.md5(sys.prefix.encode()).hexdigest()[:10]
        self.proc = subprocess.Popen(
            ["make", "-s", "-o", stamp, "serve", f"PYTHON={sys.executable}", f"ARGS={args}"],
            cwd=REPO, stdin=slave, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # the pty becomes its terminal
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        os.close(slave)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def wait_ready(self, timeout=180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, open(self.log_path).read()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/ready").status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(open(self.log_path).read()[-3000:])

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            for pid in session_pids(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        os.close(self.master)
        self.client.close()
        self.log.close()


def _stream_in_background(client, max_new_tokens: int) -> dict:
    """A streamed TGI request on a thread; the returned dict fills with its events and status."""
    out: dict = {"events": [], "status": None}

    def run():
        with client.stream("POST", "/generate_stream",
                           json={"inputs": "Ctrl-C", "parameters": {"max_new_tokens": max_new_tokens}}) as r:
            out["status"] = r.status_code
            out["events"] += [line for line in r.iter_lines() if line.startswith("data:")]

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    deadline = time.monotonic() + 30
    while not out["events"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return out


@pytest.mark.timeout(300)
def test_ctrl_c_in_the_terminal_drains_make_serve(model_dir, tmp_path):
    """One Ctrl-C: the in-flight request finishes, make exits 0, nothing is left."""
    serve = MakeServeInATerminal(model_dir, tmp_path / "log")
    try:
        serve.wait_ready()
        titles = {open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
                  for pid in session_pids(serve.proc.pid)}
        assert {"hsdp-serve launcher (2 ranks)", "hsdp-serve rank 0/2", "hsdp-serve rank 1/2"} <= titles
        stream = _stream_in_background(serve.client, 60)
        assert stream["status"] == 200 and stream["events"]
        serve.ctrl_c()
        stream["thread"].join(60)
        assert stream["status"] == 200 and '"finish_reason":"length"' in stream["events"][-1]
        assert len(stream["events"]) == 60  # drained, not cut short
        assert serve.proc.wait(60) == 0, open(tmp_path / "log").read()[-3000:]
        assert wait_session_gone(serve.proc.pid) == []
        log = open(tmp_path / "log").read()
        assert "draining" in log and "Interrupt" not in log and "leaked" not in log, log[-3000:]
    finally:
        serve.close()


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_stops_at_once(model_dir, tmp_path):
    """A group that cannot drain (rank 1 stopped): the first Ctrl-C waits for it, the second
    ends every process at once."""
    serve = MakeServeInATerminal(model_dir, tmp_path / "log")
    try:
        serve.wait_ready()
        os.kill(rank_pids(serve.client)[1], signal.SIGSTOP)
        serve.ctrl_c()
        time.sleep(2)
        assert serve.proc.poll() is None  # draining: the group cannot step without rank 1
        serve.ctrl_c()
        start = time.monotonic()
        assert serve.proc.wait(30) != 0
        assert time.monotonic() - start < 10  # not the 30 s shutdown timeout, nor the step timeout
        assert wait_session_gone(serve.proc.pid) == []
    finally:
        serve.close()


def test_a_forked_rank_sees_the_launchers_environment_and_the_agents_variables(monkeypatch):
    """A rank forked by the fork server: the launcher's environment as it was at launch (what the
    launcher set or dropped after the fork server started included), torch's agent's per-rank
    variables kept, even where the launcher has a variable of the same name."""
    from server.group import forkserver

    fork_server = {"KEPT": "1", "DROPPED": "2", "MASTER_PORT": "111"}
    rank = dict(fork_server, RANK="1", MASTER_PORT="222")  # what torch's agent set in the fork
    monkeypatch.setattr(forkserver, "_FORK_SERVER", (os.getpid() + 1, fork_server))
    monkeypatch.setattr(os, "environ", rank)
    forkserver.apply_launcher_environment({"KEPT": "1", "LATER": "3", "MASTER_PORT": "111"})
    assert rank == {"KEPT": "1", "LATER": "3", "RANK": "1", "MASTER_PORT": "222"}

    unforked = {"RANK": "0", "SET": "x"}  # no fork server recorded itself: only what is unset is set
    monkeypatch.setattr(forkserver, "_FORK_SERVER", None)
    monkeypatch.setattr(os, "environ", unforked)
    forkserver.apply_launcher_environment({"RANK": "9", "SET": "y", "NEW": "z"})
    assert unforked == {"RANK": "0", "SET": "x", "NEW": "z"}


def test_the_tests_warm_launcher_starts_what_python_m_server_starts(model_dir, tmp_path):
    """tests/warm_launcher.py: a launch forked from the warm parent makes the process tree
    ``python -m server`` makes (launcher, fork server, ranks, in a session of their own) and passes
    on its exit status; a launch in another environment (beyond ``HSDP_*``) starts cold."""
    from tests.warm_launcher import LaunchedServer, WarmLauncher

    with ServerProcess(model_dir, log_path=tmp_path / "warm.log") as server:
        assert isinstance(server.proc, LaunchedServer), "the warm launcher is off"
        sid = os.getsid(server.proc.pid)
        assert sid == server.proc.pid
        titles = sorted(_title(pid) for pid in session_pids(sid))
        assert server.client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).is_success
    assert server.proc.returncode == 0 and wait_session_gone(sid) == []
    assert [t for t in titles if t.startswith("hsdp-serve")] == [
        "hsdp-serve fork server (ranks start here)", "hsdp-serve launcher (2 ranks)", "hsdp-serve rank 0/2",
        "hsdp-serve rank 1/2"], titles
    bad = ServerProcess(model_dir, log_path=tmp_path / "bad.log", extra_args=("--resident-units", "many"))
    assert isinstance(bad.proc, LaunchedServer) and bad.proc.wait(60) == 2
    assert "--resident-units" in bad.log_tail()
    bad.stop()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    assert WarmLauncher.for_env(REPO, {**env, "HSDP_ANYTHING": "1"}) is not None
    assert WarmLauncher.for_env(REPO, {**env, "HF_HUB_OFFLINE": "0" if env.get("HF_HUB_OFFLINE") == "1" else "1"}) is None


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()
