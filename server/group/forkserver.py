"""The ranks' fork server: a rank starts as a fork of a process that has already imported what a
rank imports, not as a fresh interpreter that spends seconds importing torch and transformers.

``python -m server`` calls :func:`start` before its own imports, so the fork server imports
(:mod:`server.group._rank_imports`) on one core while the launcher imports, resolves the model and
checks the checkpoint on another; :mod:`server.group.launch` then starts the ranks with
multiprocessing's ``forkserver`` method, and they are forked at once. On the 2-core CI machine a
tiny model's server was ready in 13.0 s instead of 17.3 s: most of the test suite's time is server
starts. A fork of a process that has only imported is as safe as a fresh interpreter: the fork
server never initialises CUDA, OpenMP's threads or a process group (it computes nothing), which is
why the ranks are not forks of the launcher itself.

The fork server's environment is the launcher's when it started; :func:`launcher_environment` and
:func:`apply_launcher_environment` give each rank the launcher's at launch (what it set since:
inductor's cache directory, gloo's interface) beside the variables torch's agent sets per rank.
The fork server ignores SIGINT and SIGTERM (the launcher passes them on to the ranks, which drain)
and is killed when the launcher dies; the ranks die with it (``launch._detach_from_launcher``).

Light on purpose: nothing here imports torch (it would delay the start it exists to hasten).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver, resource_tracker, util

PRELOAD = "server.group._rank_imports"
"""The module the fork server imports before it forks a rank."""

START_METHOD = "forkserver"

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def is_under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (or another elastic agent) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(name in os.environ for name in _TORCHRUN_ENV)


def start(argv: list[str] | None = None) -> None:
    """Start the fork server now, so that its imports overlap this process's, unless this process
    starts no ranks: under torchrun (it is a rank itself), or for ``--help``/``--version``."""
    argv = sys.argv[1:] if argv is None else argv
    if is_under_torchrun() or any(a in ("-h", "--help", "--version") for a in argv):
        return
    ensure_running()


def ensure_running() -> None:
    """The fork server, started with its imports if it is not running (a no-op if it is): a fresh
    interpreter, or a fork of this process after :func:`fork_from_this_process`."""
    multiprocessing.set_forkserver_preload([PRELOAD])
    if not _FORK_THIS_PROCESS:
        forkserver.ensure_running()
        return
    resource_tracker.ensure_running()  # the fork server's own first step, as a fresh interpreter
    spawn = util.spawnv_passfds
    util.spawnv_passfds = _fork_passfds  # what forkserver.ensure_running starts it with
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn


_FORK_THIS_PROCESS = False


def fork_from_this_process() -> None:
    """This process has imported :mod:`server.group.rank_modules` and computed nothing since (a warm
    parent that forked it, as the tests' launcher does: ``tests/warm_launcher.py``): the fork server
    it starts is a fork of it, which has nothing left to import, instead of a fresh interpreter
    that spends seconds importing the same modules. Call it before :func:`start`."""
    global _FORK_THIS_PROCESS
    if "server.group.rank_modules" not in sys.modules:
        raise RuntimeError("fork_from_this_process: server.group.rank_modules is not imported")
    _FORK_THIS_PROCESS = True


def _fork_passfds(path: str, args: list[str], passfds) -> int:
    """``util.spawnv_passfds`` for the fork server, by fork: the child keeps only
    stdin, stdout, stderr and ``passfds`` and runs the command the fork server's ``-c`` carries
    (``multiprocessing.forkserver.main``, whose preload, :data:`PRELOAD`, then only runs its
    first lines: the rest is imported)."""
    command = args[args.index("-c") + 1]
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        keep = {0, 1, 2, *passfds}
        for fd in map(int, os.listdir("/proc/self/fd")):  # as the interpreter it replaces: none of the
            if fd not in keep:  # launcher's files (the alive pipe's write end would keep it waiting)
                try:
                    os.close(fd)
                except OSError:
                    pass
        exec(command, {"__name__": "__hsdp_fork_server__"})  # noqa: S102 - multiprocessing's own command
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - reported, then this process ends
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


_FORK_SERVER: tuple[int, dict[str, str]] | None = None
"""(pid, environment) of the fork server, recorded by it as it starts (:func:`record_fork_server`)."""


def record_fork_server() -> None:
    """In the fork server, before its imports: its pid and environment, which its forks inherit."""
    global _FORK_SERVER
    _FORK_SERVER = (os.getpid(), dict(os.environ))


def die_with_parent() -> bool:
    """SIGKILL to this process when its parent dies (Linux's PR_SET_PDEATHSIG); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    return True


def launcher_environment() -> dict[str, str]:
    """The launcher's environment as the ranks should see it, to pass to each rank."""
    return dict(os.environ)


def apply_launcher_environment(launcher: dict[str, str]) -> None:
    """In a rank forked by the fork server: the launcher's environment at launch, except for the
    variables torch's agent set for this rank (they differ from the fork server's own)."""
    forked = _FORK_SERVER is not None and _FORK_SERVER[0] != os.getpid()
    own = _FORK_SERVER[1] if forked else {}
    # not forked by a fork server that recorded itself: every variable already set stays
    agents = {k for k, v in os.environ.items() if own.get(k) != v} if forked else set(os.environ)
    for name in set(os.environ) - agents - set(launcher):
        del os.environ[name]
    for name, value in launcher.items():
        if name not in agents:
            os.environ[name] = value
