"""Start the model group: one process per rank on this node, or this process under torchrun.

A user types one command. :func:`launch_group` either spawns ``nproc_per_node`` ranks through
torch's elastic launcher (a c10d rendezvous on a localhost port the OS picks once) or, when
this process already is a torchrun worker, runs the entrypoint right here, so several nodes
work with one ``torchrun`` per node. Knows nothing of checkpoints or HTTP: the entrypoint
does the work and calls :func:`init_rank` itself.

Several nodes: after the process group forms, every rank proves to rank 0 that it knows
``HSDP_GROUP_SECRET`` (:func:`authenticate_group`, through the group's store) before any control
message; the local launcher's ranks need none (their store and gloo listen on loopback).

A failed rank ends the whole group (``max_restarts=0``) and surfaces as one :class:`GroupError`
whose text is one line; the traceback is logged at ``--log-level debug``.

Signals: only the launcher decides when the group stops. Spawned ranks run in process groups
of their own (and die with the launcher), so a terminal's Ctrl-C, which reaches the whole
foreground process group, reaches the launcher alone; the launcher passes SIGINT/SIGTERM on
once, and a second one kills the ranks. Started by another program in the terminal's
foreground (``make serve``), the launcher takes the foreground for itself, so that Ctrl-C
drains the group instead of interrupting ``make``. Every process names itself in ``ps``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import hmac
import logging
import multiprocessing
import os
import secrets
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

logger = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICE_TYPES = ("cpu", "cuda")
# Torch's own launcher loggers: at INFO and on failure they print a wall of configuration and
# tracebacks that GroupError already sums up in one line.
_QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_THREAD_DRAIN_S = 0.05


class GroupError(RuntimeError):
    """A rank of the group failed; ``str()`` is one line naming the rank and the error."""

    def __init__(self, message: str, *, rank: int | None = None, exit_code: int = 1):
        self.rank = rank
        self.exit_code = exit_code
        super().__init__(message if rank is None else f"rank {rank}: {message}")


def is_under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (or another elastic agent) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(name in os.environ for name in _TORCHRUN_ENV)


def resolve_world_size(nproc_per_node: int) -> int:
    """The group's world size: torchrun's under torchrun, else ``nproc_per_node`` on this node."""
    if is_under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return nproc_per_node


CPU_DEFAULT_NPROC_PER_NODE = 2
"""Ranks per node that ``--nproc-per-node auto`` starts on CPU (gloo)."""


def int_or_keyword(keyword: str, keyword_value, minimum: int):
    """An argparse type: an integer >= ``minimum``, or ``keyword``, which parses to ``keyword_value``."""

    def parse(text: str):
        if text == keyword:
            return keyword_value
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or {keyword!r}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


parse_nproc_per_node = int_or_keyword("auto", None, 1)
"""argparse type for ``--nproc-per-node``: a positive integer, or ``auto`` (None)."""


def resolve_nproc_per_node(nproc_per_node: int | None, device_type: str) -> int:
    """The ranks to start on this node.

    None (``auto``) means torchrun's local world size under torchrun, one rank per visible GPU on
    cuda, and :data:`CPU_DEFAULT_NPROC_PER_NODE` on cpu. On cuda, asking for more ranks than
    visible GPUs is a ValueError: ranks would share a device and NCCL would refuse.
    """
    if is_under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node or 1))
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if nproc_per_node is None:
            if visible < 1:
                raise ValueError("--nproc-per-node auto: no GPU visible")
            return visible
        if nproc_per_node > visible:
            raise ValueError(f"--nproc-per-node {nproc_per_node} > {visible} visible GPU(s)")
        return nproc_per_node
    return CPU_DEFAULT_NPROC_PER_NODE if nproc_per_node is None else nproc_per_node


def resolve_device_type(device: str | None) -> str:
    """``device`` checked against :data:`DEVICE_TYPES`; None means cuda when CUDA is available."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {DEVICE_TYPES}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
    return device


def configure_logging(log_level: str | None, *, rank: int | None = None) -> None:
    """One log stream per process, prefixed ``[rankN]`` (or ``[launch]`` for the launcher).

    ``rank=None`` means this process's rank under torchrun, else the launcher. ``log_level=None``
    logs rank 0 and the launcher at INFO, the other ranks at WARNING, so that N ranks do not
    print N copies of the same progress.
    """
    if log_level is not None and log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {log_level!r}")
    if rank is None and is_under_torchrun():
        rank = int(os.environ["RANK"])
    level = log_level.upper() if log_level else ("INFO" if not rank else "WARNING")
    prefix = "[launch]" if rank is None else f"[rank{rank}]"
    logging.basicConfig(
        level=level,
        format=f"{prefix} %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    _quiet_torch_loggers(log_level)


def _quiet_torch_loggers(log_level: str | None) -> None:
    # Some of these loggers carry their own level, so each existing one is set, not the parents.
    quiet = logging.WARNING if log_level == "debug" else logging.CRITICAL
    for name in [*_QUIET_LOGGERS, *logging.root.manager.loggerDict]:
        if name.startswith(_QUIET_LOGGERS):
            logging.getLogger(name).setLevel(quiet)


def init_rank(device: str, timeout_s: float) -> torch.device:
    """Initialise the default process group for this rank and return its device.

    ``cuda``: NCCL on ``cuda:LOCAL_RANK``. ``cpu``: gloo, with the node's cores split between
    its ranks. ``timeout_s`` bounds every collective, so a rank that never arrives fails the
    group instead of hanging it.
    """
    if device not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {DEVICE_TYPES}, got {device!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    timeout = datetime.timedelta(seconds=timeout_s)
    # torchrun sets OMP_NUM_THREADS=1 and spawned ranks would each take every core: both waste
    # or oversubscribe the node, so each rank gets its share of the cores it may run on (GPU
    # ranks too: their host work, the loader's reads and casts, runs on these threads).
    torch.set_num_threads(max(1, _count_usable_cores() // local_world_size))
    secret = read_group_secret()  # a misconfigured secret fails before the group forms
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        rank_device = torch.device("cuda", local_rank)
        # device_id binds the group to this GPU at once instead of at the first collective.
        dist.init_process_group("nccl", timeout=timeout, device_id=rank_device)
    else:
        rank_device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    authenticate_group(secret)  # before any control message
    return rank_device


GROUP_SECRET_ENV = "HSDP_GROUP_SECRET"
GROUP_SECRET_FILE_ENV = "HSDP_GROUP_SECRET_FILE"
_AUTH_KEY = "hsdp-auth/"


class GroupAuthError(RuntimeError):
    """A rank did not prove that it knows the group's secret; ``rank`` is that rank."""

    def __init__(self, message: str, *, rank: int | None = None):  # (None: as unpickled, rank restored after)
        self.rank = rank
        super().__init__(message)


def read_group_secret(environ=None) -> bytes | None:
    """The group's shared secret: ``HSDP_GROUP_SECRET``, or the contents of ``HSDP_GROUP_SECRET_FILE``
    (stripped); None where neither is set. ValueError for both, or a file that is unreadable or empty."""
    environ = os.environ if environ is None else environ
    text, path = environ.get(GROUP_SECRET_ENV, ""), environ.get(GROUP_SECRET_FILE_ENV, "")
    if text and path:
        raise ValueError(f"set {GROUP_SECRET_ENV} or {GROUP_SECRET_FILE_ENV}, not both")
    if path:
        return read_secret_file(path, GROUP_SECRET_FILE_ENV)
    return text.encode() or None


def read_secret_file(path: str, what: str) -> bytes:
    """A secret's file (a Docker or Kubernetes secret), stripped; ValueError naming ``what`` (the
    flag or variable that gave the path) where it is unreadable or empty."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"{what} {path}: empty")
    return secret


def _proof(secret: bytes | None, nonce: bytes, rank: int) -> bytes:
    if secret is None:
        return b"none"
    return hmac.new(secret, nonce + rank.to_bytes(8, "big"), hashlib.sha256).hexdigest().encode()


def authenticate_group(secret: bytes | None) -> None:
    """Every rank proves to rank 0 that it knows ``secret``, through the default group's store:
    rank 0 writes a random nonce, each rank HMAC-SHA256(secret, nonce || rank), rank 0 checks each
    and writes its verdict, which every rank waits for, so that a failure ends every rank at once
    (GroupAuthError naming the rank at fault), none waiting in a collective. Run by every rank
    (symmetric: the store's waits are bounded by the group's timeout), on one node too, where it
    costs a few loopback round trips. Without a secret anywhere the group starts unauthenticated,
    with a warning where it spans several nodes (its ports then listen beyond loopback)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    several_nodes = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world
    if secret is None and several_nodes and rank == 0:
        logger.warning("the group spans several nodes and %s is not set: its control plane is unauthenticated "
                       "(whoever reaches its store and gloo ports can join it)", GROUP_SECRET_ENV)
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.set(f"{_AUTH_KEY}proof{rank}", _proof(secret, store.get(f"{_AUTH_KEY}nonce"), rank))
        verdict = store.get(f"{_AUTH_KEY}verdict").decode()
        if verdict != "ok":
            failed, _, why = verdict.partition(" ")
            raise GroupAuthError(why, rank=int(failed))
        return
    nonce = secrets.token_bytes(32)
    store.set(f"{_AUTH_KEY}nonce", nonce)
    failed = why = None
    for r in range(1, world):
        proof = store.get(f"{_AUTH_KEY}proof{r}")
        if hmac.compare_digest(proof, _proof(secret, nonce, r)):
            continue
        failed = r
        if secret is None:
            why = f"rank {r} has a group secret and rank 0 has none: set {GROUP_SECRET_ENV} on every node"
        elif proof == _proof(None, nonce, r):
            why = f"rank {r} has no group secret: set {GROUP_SECRET_ENV} on every node"
        else:
            why = f"rank {r} does not know the group's secret ({GROUP_SECRET_ENV} differs from rank 0's)"
        break
    store.set(f"{_AUTH_KEY}verdict", "ok" if failed is None else f"{failed} {why}: the group refuses to start")
    if failed is not None:
        raise GroupAuthError(f"{why}: the group refuses to start", rank=failed)


def _count_usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on (taskset, cgroups)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_TEARDOWN_REPORT_S = 15


def close_rank() -> None:
    """Destroy the process groups, then let their worker threads finish before the process exits.

    A teardown that outlasts 15 s dumps every thread's stack to the log (once seen in CI under
    heavy load: a rank still alive 45 s after a clean drain, until the launcher killed it)."""
    if not dist.is_initialized():
        return
    import faulthandler

    faulthandler.dump_traceback_later(_TEARDOWN_REPORT_S, exit=False)
    try:
        dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()
    # DTensor's sharding cache keeps the DeviceMesh, hence its groups and their worker threads,
    # alive until exit. A gloo worker still dropping its last collective's tensors needs the
    # GIL; if the interpreter is finalising by then, the rank aborts with SIGABRT ("terminate
    # called without an active exception": 1 exit in 5 with a mesh on torch 2.13). Sleeping
    # hands it the GIL first.
    time.sleep(_THREAD_DRAIN_S)


def set_process_title(title: str) -> None:
    """What ``ps`` shows for this process (where setproctitle is installed)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _run_rank(entrypoint: Callable[..., Any], args: tuple, log_level: str | None, title: str | None = None,
              detach: bool = False) -> Any:
    """Body of every rank: logging first, then the entrypoint; the group is closed on success.

    On failure the group is left to process exit: destroying it while peers may still sit in
    a collective can block, and the launcher stops those peers anyway. ``detach``: a spawned
    rank leaves the launcher's process group and dies with the launcher (see the module).
    """
    rank = int(os.environ.get("RANK", 0))
    if detach:
        _detach_from_launcher()
    if title:
        set_process_title(f"{title} rank {rank}/{os.environ.get('WORLD_SIZE', '?')}")
    os.environ.pop("HSDP_SPAWN_TITLE", None)  # this rank's own children are not ranks
    configure_logging(log_level, rank=rank)
    try:
        result = entrypoint(*args)
    except BaseException:
        logger.debug("rank failed", exc_info=True)
        raise
    close_rank()
    return result


def _detach_from_launcher() -> None:
    """This rank's own process group, and SIGKILL when the launcher dies (Linux)."""
    launcher = os.getppid()
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the request took effect
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
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    class LoopbackRendezvousHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port):
            return _loopback_tcp_store()

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks the handler's backend name against its own
            return _LOOPBACK_RDZV

    store = _loopback_tcp_store()
    join = datetime.timedelta(seconds=int(params.get("join_timeout", 600)))
    return LoopbackRendezvousHandler.from_backend(
        params.run_id, store, LoopbackBackend(store, params.run_id), params.min_nodes, params.max_nodes,
        LOOPBACK, RendezvousTimeout(join=join))


def _register_loopback_rendezvous() -> str:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_LOOPBACK_RDZV, _loopback_rendezvous)  # again: a no-op
    return _LOOPBACK_RDZV


def _name_ranks_from_their_start(title: str) -> None:
    """The ranks spawned from here are named as their interpreters start, before seconds of
    imports (``server/_spawn_site/sitecustomize.py`` says how)."""
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_spawn_site")
    os.environ["HSDP_SPAWN_TITLE"] = title
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)


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
            start_method="spawn",  # fork after torch (or CUDA) is initialised is unsafe
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
        if title:
            _name_ranks_from_their_start(f"{title} rank (starting)")
        with _passing_stop_signals_to_ranks(shutdown_timeout_s) as received:
            try:
                results = elastic_launch(config, _run_rank)(entrypoint, args, log_level, title, True)
            except ChildFailedError as e:
                error = _summarize_failures(e.failures)
                if received:
                    error.exit_code = 128 + received[0]
                raise error from None
            except SignalException as e:
                raise GroupError(f"interrupted by {e.sigval.name}", exit_code=128 + int(e.sigval)) from None
            finally:
                # shared-memory all-gather buffers of ranks that died before removing them
                from shard_engine.shm_all_gather import cleanup_run

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
