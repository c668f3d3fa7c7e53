"""Launch paths of the real server: under torchrun directly, and idle past the collective timeout."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import REPO, ServerProcess, free_port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("launch") / "llama", "llama")


def test_idle_longer_than_the_collective_timeout_still_serves(model_dir, tmp_path):
    server = ServerProcess(model_dir, extra_args=("--collective-timeout", "4"), log_path=tmp_path / "log")
    try:
        server.poll_ready()
        time.sleep(10)  # well past the 4 s timeout with no request
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
        assert not _processes_mentioning(model_dir), "torchrun left workers behind"


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids
