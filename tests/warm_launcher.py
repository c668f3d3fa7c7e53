"""A warm parent for the servers the tests start: ``python -m server`` without its seconds of imports.

A server's start is its imports: the launcher imports torch and the config while its fork server
imports what a rank imports (``server.group.rank_modules``), ~6 s on one core of the CI machine,
before a tiny model loads in a fraction of a second; the suite starts a server ~150 times.
:class:`WarmLauncher` is one process per test session that has made those imports and computed
nothing; each launch is a fork of it that runs ``server.__main__.run()`` as ``python -m server``
would (its own session, argv, environment, working directory and log), whose fork server is a
fork of it in turn (``server.group.forkserver.fork_from_this_process``). The process tree is the
one ``python -m server`` makes: launcher, fork server, ranks.

A launch goes to the warm parent only when its environment differs from the parent's in
``HSDP_*`` variables alone (and pytest's ``PYTEST_CURRENT_TEST``) (read when used; another variable may have been read at import, as
huggingface_hub reads ``HF_*``), and ``HSDP_TEST_WARM_LAUNCH=0`` turns it off: then, and for a
command of a test's own (``argv``), :class:`tests.server_process.ServerProcess` runs the
command in a fresh interpreter as before.

The protocol, one Unix-socket connection per launch: the client sends one JSON line
``{"argv", "env", "cwd", "log"}``; the parent answers ``{"pid"}`` and, when that launcher exits,
``{"returncode"}`` (negative: killed by that signal, as ``subprocess.Popen`` has it).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

_ENABLED = os.environ.get("HSDP_TEST_WARM_LAUNCH", "1") != "0"


def _read_when_used(name: str) -> bool:
    """Whether a variable of a launch's environment may differ from the warm parent's: the server's
    own (read when used) and pytest's name of the running test."""
    return name.startswith("HSDP_") or name == "PYTEST_CURRENT_TEST"


class LaunchedServer:
    """A launcher forked by the warm parent, with the part of ``subprocess.Popen``'s interface the
    tests use: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``."""

    def __init__(self, connection: socket.socket, argv: list[str]):
        self._connection = connection
        self._buffer = b""
        self.args = argv
        self.returncode: int | None = None
        self.pid = self._message(timeout=60)["pid"]

    def _message(self, timeout: float | None) -> dict:
        """The parent's next message; ``TimeoutError`` if none within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._connection.settimeout(left)
            try:
                chunk = self._connection.recv(4096)
            except (socket.timeout, BlockingIOError):
                raise TimeoutError from None
            if not chunk:
                raise RuntimeError("the tests' warm launcher went away")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._message(timeout=0)["returncode"]
                self._connection.close()
            except TimeoutError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._message(timeout)["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._connection.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmLauncher:
    """The session's warm parent, started at its first use and killed at exit (it also dies with
    the process that started it)."""

    _instance: WarmLauncher | None = None
    _lock = threading.Lock()

    def __init__(self, repo: str, env: dict[str, str]):
        self._dir = tempfile.mkdtemp(prefix="hsdp-warm-")
        self.address = os.path.join(self._dir, "socket")
        self.env = env
        self._log = open(os.path.join(self._dir, "log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_launcher", self.address], cwd=repo, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        atexit.register(self.close)

    @classmethod
    def for_env(cls, repo: str, env: dict[str, str]) -> WarmLauncher | None:
        """The session's warm parent if a launch in ``env`` may use it (started with the first such
        environment), else None."""
        if not _ENABLED:
            return None
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls(repo, {k: v for k, v in env.items() if not _read_when_used(k)})
        own = cls._instance.env
        differs = {k for k in set(env) | set(own) if env.get(k) != own.get(k)}
        return cls._instance if all(map(_read_when_used, differs)) else None

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, log: str | None) -> LaunchedServer:
        """``python -m server`` with ``argv`` (what follows ``-m server``) forked from the warm parent."""
        deadline = time.monotonic() + 120  # its imports, if it has only just started
        while True:
            connection = socket.socket(socket.AF_UNIX)
            try:
                connection.connect(self.address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    with open(self._log.name) as f:
                        raise RuntimeError(f"the tests' warm launcher did not start: {f.read()[-2000:]}") from None
                time.sleep(0.05)
        request = {"argv": argv, "env": env, "cwd": cwd, "log": log}
        connection.sendall(json.dumps(request).encode() + b"\n")
        return LaunchedServer(connection, argv)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _serve(address: str) -> None:
    """The warm parent: imports, then forks a launcher per connection until killed."""
    from server.group.forkserver import die_with_parent

    die_with_parent()
    try:
        import setproctitle

        setproctitle.setproctitle("hsdp-serve tests' warm launcher")
    except ImportError:
        pass
    import server.__main__  # noqa: F401
    import server.group.rank_modules  # noqa: F401

    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sig_r, selectors.EVENT_READ)
    launched: dict[int, socket.socket] = {}
    buffers: dict[socket.socket, bytes] = {}
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                buffers[connection] = b""
                selector.register(connection, selectors.EVENT_READ)
            elif key.fileobj == sig_r:
                os.read(sig_r, 4096)
                _reap(launched)
            else:
                connection = key.fileobj
                chunk = connection.recv(65536)
                if not chunk:  # the client went before its launcher ended
                    selector.unregister(connection)
                    buffers.pop(connection, None)
                    connection.close()
                    continue
                buffers[connection] += chunk
                if b"\n" in buffers[connection]:
                    request = json.loads(buffers.pop(connection).split(b"\n", 1)[0])
                    selector.unregister(connection)
                    pid = os.fork()
                    if pid == 0:
                        for own in (listener, connection, *launched.values(), *buffers):
                            own.close()
                        selector.close()
                        os.close(sig_r)
                        os.close(sig_w)
                        _run_launcher(request)  # never returns
                    launched[pid] = connection
                    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(launched)


def _reap(launched: dict[int, socket.socket]) -> None:
    while launched:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = launched.pop(pid, None)
        if connection is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            except OSError:
                pass
            connection.close()


def _run_launcher(request: dict) -> None:
    """In a fork of the warm parent: ``python -m server`` as the request has it, then exit."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(request["log"] or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import server.__main__ as entry
        from server.group.forkserver import fork_from_this_process

        sys.argv = [entry.__file__, *request["argv"]]
        fork_from_this_process()
        entry.run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])
