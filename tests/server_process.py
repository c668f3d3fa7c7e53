"""Start the real ``hsdp-serve`` as a subprocess group and talk to it over HTTP."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.warm_launcher import WarmLauncher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free localhost port outside the kernel's ephemeral range.

    A port from ``bind(("", 0))`` is free only until it is closed: the server under test then binds
    its own stores and gloo's pair sockets on ports the OS picks from that same range, and one of
    them can take the HTTP port before uvicorn binds it (CI saw ``address already in use``). The OS
    never hands out a port below the range on its own, so a port there stays ours."""
    low, high = _ephemeral_range()
    span = (1024, low - 1) if low > 11024 else (high + 1, 65535)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randint(*span)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {span}")


class ServerProcess:
    """The server on ``nproc`` CPU ranks, or, with ``argv``, whatever command starts one on ``port``
    (``env`` is added to the environment)."""

    def __init__(self, model_dir, *, nproc: int = 2, extra_args: tuple[str, ...] = (), log_path=None,
                 argv: list[str] | None = None, port: int | None = None, env: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        warm = None
        if argv is None:
            model = ["--model", str(model_dir)] if model_dir is not None else []  # None: the default model
            args = [*model, "--nproc-per-node", str(nproc), "--device", "cpu", "--port", str(self.port), *extra_args]
            argv = [sys.executable, "-m", "server", *args]
            warm = WarmLauncher.for_env(REPO, env)
        if warm is not None:  # a fork of the session's warm parent: the same process tree, no imports
            self.proc = warm.launch(args, env, REPO, str(log_path) if log_path else None)
        else:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                # a session of its own: session_pids finds every process it started (the ranks run in
                # process groups of their own, and die with the launcher)
                start_new_session=True,
            )
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def poll_ready(self, timeout: float = 180) -> list[tuple[int, dict]]:
        """Poll /ready until 200; returns every (status, body) seen. Fails if the server exits."""
        seen: list[tuple[int, dict]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                r = self.client.get("/ready", timeout=2)
                seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return seen
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"not ready after {timeout} s: {self.log_tail()}")

    def __enter__(self) -> ServerProcess:
        """``with ServerProcess(...) as server``: ready on entry (else stopped and the error raised),
        stopped on exit."""
        try:
            self.poll_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left of the group
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.client.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (the server was started in a session of its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid and _state(int(entry)) != "Z":
                    pids.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def rank_pids(client) -> dict[int, int]:
    """{rank: pid} as the server's /info reports them."""
    return {r["rank"]: r["pid"] for r in client.get("/info").json()["ranks"]}


def wait_session_gone(sid: int, timeout: float = 10) -> list[int]:
    """Wait for session ``sid`` to empty (helpers such as multiprocessing's resource tracker
    leave a moment after the launcher); returns what is left after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def listening_addresses(pids) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the processes ``pids`` listen on, from /proc (IPv4
    as dotted quads, IPv6 as the kernel's hex)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                if table == "tcp":
                    address = ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
                found.add((address, int(port, 16)))
    return found
