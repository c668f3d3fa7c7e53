"""Start the model group: one process per rank on this node, or this process under torchrun.

A user types one command. :func:`launch_group` either starts ``nproc_per_node`` ranks through
torch's elastic launcher (a c10d rendezvous on a localhost port the OS picks once; each rank a
fork of the fork server, :mod:`server.group.forkserver`, which has imported what a rank needs) or, when
this process already is a torchrun worker, runs the entrypoint right here, so several nodes
work with one ``torchrun`` per node. Knows nothing of checkpoints or HTTP: the entrypoint
does the work and calls :func:`init_rank` itself.

Several nodes: after the process group forms, every rank proves to rank 0 that it knows
``HSDP_GROUP_SECRET`` (:func:`authenticate_group`, through the group's store) before any control
message; the local launcher's ranks need none (their store and gloo listen on loopback).

A failed rank ends the whole group (``max_restarts=0``) and surfaces as one :class:`GroupError`
whose text is one line; the traceback is logged at ``--log-level debug``.

Signals: only the launcher decides when the group stops. Its ranks run in process groups
of their own (and die with the launcher), so a terminal's Ctrl-C, which reaches the whole
foreground process group, reaches the launcher alone; the launcher passes SIGINT/SIGTERM on
once, and a second one kills the ranks. Started by another program in the terminal's
foreground (``make serve``), the launcher takes the foreground for itself, so that Ctrl-C
drains the group instead of interrupting ``make``. Every process names itself in ``ps``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from server.group.forkserver import (START_METHOD, apply_launcher_environment, die_with_parent, ensure_running,
                                     launcher_environment)
from server.group.logs import _quiet_torch_loggers, configure_logging, set_process_title
from server.group.process_group import close_rank, is_under_torchrun

logger = logging.getLogger(__name__)


class GroupError(RuntimeError):
    """A rank of the group failed; ``str()`` is one line naming the rank and the error."""

    def __init__(self, message: str, *, rank: int | None = None, exit_code: int = 1):
        self.rank = rank
        self.exit_code = exit_code
        super().__init__(message if rank is None else f"rank {rank}: {message}")


def _run_rank(entrypoint: Callable[..., Any], args: tuple, log_level: str | None, title: str | None = None,
              launcher_env: dict[str, str] | None = None) -> Any:
    """Body of every rank: logging first, then the entrypoint; the group is closed on success.

    On failure the group is left to process exit: destroying it while peers may still sit in
    a collective can block, and the launcher stops those peers anyway. ``launcher_env``: a rank
    forked by the fork server takes the launcher's environment, leaves the launcher's process
    group and dies with the launcher (see the module).
    """
    if launcher_env is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it; a rank must not
        apply_launcher_environment(launcher_env)
        _detach_from_launcher()
    rank = int(os.environ.get("RANK", 0))
    if title:
        set_process_title(f"{title} rank {rank}/{os.environ.get('WORLD_SIZE', '?')}")
    configure_logging(log_level, rank=rank)
    try:
        result = entrypoint(*args)
    except BaseException:
        logger.debug("rank failed", exc_info=True)
        raise
    close_rank()
    return result


def _detach_from_launcher() -> None:
    """This rank's own process group, and SIGKILL when its parent, the fork server, dies (Linux):
    the fork server dies with the launcher (``server.group._rank_imports``)."""
    parent = os.getppid()
    os.setpgid(0, 0)
    if die_with_parent() and os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


@contextlib.contextmanager
def _terminal_foreground() -> Iterator[None]:
    """Make this process's own group the terminal's foreground while the group runs.

    Only when this process is in the foreground group of its controlling terminal without
    leading it (another program, ``make`` say, started it): Ctrl-C then reaches this group
    alone, which drains, instead of also interrupting the program that waits for it (make
    would exit 130 whatever the server did). The foreground is handed back at the end.
    """
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:  # no controlling terminal (outside the except: the group's errors are not "during" it)
        tty = None
    if tty is None:
        yield
        return
    try:
        previous = os.tcgetpgrp(tty)
        if previous != os.getpgrp() or os.getpgrp() == os.getpid():
            yield
            return
        os.setpgid(0, 0)
        _set_foreground(tty, os.getpgrp())
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                _set_foreground(tty, previous)
    finally:
        os.close(tty)


def _set_foreground(tty: int, pgrp: int) -> None:
    # A process outside the foreground group gets SIGTTOU (and stops) for this unless it ignores it.
    old_ttou = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(tty, pgrp)
    finally:
        signal.signal(signal.SIGTTOU, old_ttou)


def launch_group(
    entrypoint: Callable[..., Any],
    args: tuple = (),
    *,
    nproc_per_node: int,
    log_level: str | None = None,
    rdzv_timeout_s: int = 300,
    shutdown_timeout_s: int = 15,
    title: str | None = None,
) -> Any:
    """Run ``entrypoint(*args)`` on every rank of the group and return rank 0's return value.

    Under torchrun the entrypoint runs in this process (``nproc_per_node`` is then torchrun's
    to decide) and its own return value is returned, whatever the rank. Otherwise
    ``nproc_per_node`` ranks are spawned on this node; ``entrypoint`` must be picklable (a
    module-level function). Raises :class:`GroupError` if any rank fails; the other ranks are
    stopped, with SIGKILL after ``shutdown_timeout_s``. ``title`` names the processes in ``ps``:
    ``TITLE launcher (N ranks)`` and ``TITLE rank R/W``.
    """
    if is_under_torchrun():
        rank = int(os.environ["RANK"])
        configure_logging(log_level, rank=rank)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node))
        if nproc_per_node != local_world_size and int(os.environ.get("LOCAL_RANK", 0)) == 0:
            logger.warning(
                "running under torchrun with %d rank(s) on this node; nproc_per_node=%d is ignored",
                local_world_size,
                nproc_per_node,
            )
        _exit_when_agent_dies()
        try:
            return _run_rank(entrypoint, args, log_level, title)
        except Exception as e:
            raise GroupError(_describe_exception(e), rank=rank) from e
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    if title:
        set_process_title(f"{title} launcher ({nproc_per_node} ranks)")
    with _terminal_foreground():
        return _launch_local(entrypoint, args, nproc_per_node, log_level, rdzv_timeout_s, shutdown_timeout_s, title)


AGENT_POLL_S = 0.5
AGENT_GONE_EXIT_CODE = 4


def _exit_when_agent_dies(poll_s: float = AGENT_POLL_S) -> None:
    """Under torchrun: exit when the agent that started this worker is gone. torchrun starts its
    workers in sessions of their own and without a parent-death signal, so a worker whose agent
    was killed (the node lost its agent, the operator killed it) would otherwise serve on as an
    orphan, holding its GPU and the other ranks' collectives. Seen as the parent pid changing:
    the orphan is adopted by init or a subreaper."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_s)
        logger.error("the torchrun agent (pid %d) is gone: this worker exits (%d)", agent, AGENT_GONE_EXIT_CODE)
        from shard_engine import remove_owned_now

        remove_owned_now()  # os._exit skips atexit
        os._exit(AGENT_GONE_EXIT_CODE)

    threading.Thread(target=watch, name="hsdp-agent-watch", daemon=True).start()


def _supported_fields(cls, **optional) -> dict:
    """The keyword arguments ``cls`` (a dataclass) accepts: LaunchConfig grew fields over the torch
    versions pyproject.toml allows (torch 2.11 has no ``shutdown_timeout``), and an older torch
    keeps its own default for the ones it lacks."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    skipped = sorted(set(optional) - names)
    if skipped:
        logger.debug("torch %s: LaunchConfig has no %s; its defaults apply", torch.__version__, skipped)
    return {k: v for k, v in optional.items() if k in names}


LOOPBACK = "127.0.0.1"
_LOOPBACK_RDZV = "hsdp-loopback"
_LISTENERS: list = []  # the sockets the loopback stores listen on (the stores use their descriptors)


def _loopback_tcp_store(timeout_s: float = 600):
    """A TCPStore server listening on 127.0.0.1 only. Given a host name, TCPStore listens on every
    interface, unauthenticated; given a socket already bound to loopback, it listens there."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(1024)
    _LISTENERS.append(sock)
    return dist.TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                         master_listen_fd=sock.fileno(), timeout=datetime.timedelta(seconds=timeout_s))


def _loopback_rendezvous(params):
    """torch's c10d dynamic rendezvous for one node, both of whose stores (the rendezvous's and the
    one the ranks share) listen on 127.0.0.1 only."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    from shard_engine.torch_private import loopback_rendezvous_handler

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks the handler's backend name against its own
            return _LOOPBACK_RDZV

    store = _loopback_tcp_store()
    join = datetime.timedelta(seconds=int(params.get("join_timeout", 600)))
    return loopback_rendezvous_handler(params, store, LoopbackBackend(store, params.run_id), local_addr=LOOPBACK,
                                       timeout=RendezvousTimeout(join=join), store_server=_loopback_tcp_store)


def _register_loopback_rendezvous() -> str:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_LOOPBACK_RDZV, _loopback_rendezvous)  # again: a no-op
    return _LOOPBACK_RDZV


def _launch_local(entrypoint, args, nproc_per_node, log_level, rdzv_timeout_s, shutdown_timeout_s, title) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_torch_loggers(log_level)
    # The error files in which the ranks record their exceptions; gone once the group ends.
    with tempfile.TemporaryDirectory(prefix="hsdp-launch-") as log_dir:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc_per_node,
            run_id=f"hsdp-{uuid.uuid4().hex[:12]}",
            # The agent's stores listen on 127.0.0.1 only, on ports the OS picks when it binds
            # them (two groups on one host cannot collide, no pick-then-bind race), and the
            # ranks reuse the agent's store: see _loopback_rendezvous.
            rdzv_backend=_register_loopback_rendezvous(),
            rdzv_endpoint="",
            rdzv_configs={"join_timeout": rdzv_timeout_s},
            max_restarts=0,
            # forks of a process that has imported and computed nothing (server.group.forkserver)
            start_method=START_METHOD,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
            **_supported_fields(
                LaunchConfig,
                local_addr=LOOPBACK,  # the address the ranks are told to reach rank 0's store at
                shutdown_timeout=shutdown_timeout_s,
                signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM and SIGINT are ours, see below
            ),
        )
        logger.debug("launching %d rank(s), run id %s", nproc_per_node, config.run_id)
        if sys.platform.startswith("linux"):  # gloo's own sockets on loopback too (the ranks inherit it)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ensure_running()  # started already by `python -m server`, its imports overlapping ours
        with _passing_stop_signals_to_ranks(shutdown_timeout_s) as received:
            try:
                results = elastic_launch(config, _run_rank)(entrypoint, args, log_level, title,
                                                            launcher_environment())
            except ChildFailedError as e:
                error = _summarize_failures(e.failures)
                if received:
                    error.exit_code = 128 + received[0]
                raise error from None
            except SignalException as e:
                raise GroupError(f"interrupted by {e.sigval.name}", exit_code=128 + int(e.sigval)) from None
            finally:
                # shared-memory all-gather buffers of ranks that died before removing them
                from shard_engine.shm import cleanup_run

                cleanup_run(config.run_id)
    return results[0]


@contextlib.contextmanager
def _passing_stop_signals_to_ranks(grace_s: float) -> Iterator[list[int]]:
    """SIGTERM/SIGINT to the launcher go on to the ranks, which end the group themselves.

    torch's agent would handle them by no longer reading the ranks' results and waiting for the
    ranks to die; a rank that drains and returns would then wait for ever for its result to be
    read, until the agent's SIGKILL. Here the agent keeps reading, so a drained group exits 0.
    A second signal, or ``grace_s`` after the first, kills the ranks.
    """
    received: list[int] = []

    def kill_ranks(why: str) -> None:
        children = multiprocessing.active_children()
        if children:
            logger.warning("%s: killing the ranks (%s)", why, ", ".join(str(c.pid) for c in children))
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        if len(received) > 1:
            kill_ranks(f"a second {signal.Signals(signum).name}")
            return
        logger.warning("%s: passed on to the ranks (again to stop them at once)", signal.Signals(signum).name)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)
        timer = threading.Timer(grace_s, kill_ranks, args=(f"the ranks did not stop within {grace_s:g} s",))
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _summarize_failures(failures: dict) -> GroupError:
    """One GroupError for the root cause among the failed ranks.

    A rank that recorded its own exception beats one that only learned of another rank's
    failure (RemoteRankError) or died without a word, then the earliest, then the lowest rank.
    The traceback was logged by the rank itself, at debug level.
    """

    def recorded_text(failure) -> str | None:
        # The error file's {"message": {"message": "Type: text", ...}}, or None without one.
        message = failure.message
        return message.get("message") if isinstance(message, dict) else None

    def priority(item) -> tuple:
        rank, failure = item
        text = recorded_text(failure)
        return (text is None, (text or "").startswith("RemoteRankError"), failure.timestamp, rank)

    rank, failure = min(failures.items(), key=priority)
    text = recorded_text(failure)
    if text is None:
        if failure.exitcode < 0:
            text = f"killed by signal {failure.signal_name()}"
        else:
            text = f"exited with code {failure.exitcode} without recording an error"
    first_line = (text.strip().splitlines() or [""])[0]
    others = len(failures) - 1
    return GroupError(first_line + (f" ({others} other rank(s) failed too)" if others else ""), rank=rank)


def _describe_exception(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
