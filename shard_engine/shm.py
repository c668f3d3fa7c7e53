"""The /dev/shm plumbing of the shared-memory gathers and weights. Knows nothing of FSDP.

A job's shared files live in directories of their own, ``/dev/shm/hsdp-{run id}-{random}-{tag}{rank}``
(one per process group and use: ``g`` the gather ring, ``w`` the shared resident weights), made
by the group's first rank exclusively (mode 0700: an existing one, or a link, is refused) after
every rank has agreed to share (:func:`open_shared_directory`). Each rank leaves a ``pid-N`` file
in the directories it uses, and registers them as its own (:func:`own`): they go when it closes
them, at exit, in :func:`remove_owned_now` for exits that skip ``atexit``, and, for a job killed
outright, in the next start's :func:`sweep_stale` or the launcher's :func:`cleanup_run`.

Files get their pages when they are made (:func:`reserve_shared_file`, :func:`create_reserved`):
a full /dev/shm is a named error then, not SIGBUS at the first write inside a forward.

The functions that take a process group are collectives over it (or over the default group,
where they say so): every rank calls them in the same place, and each keeps its ranks in step
(every rank enters the same broadcasts and gets the same verdict).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import socket
import time
import uuid

import torch.distributed as dist

import shard_engine.wire as wire

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"
STALE_AFTER_S = 60.0
"""A directory none of whose ranks is alive, and older than this, is a crashed job's: removed."""
TENSOR_ALIGN_BYTES = 64
"""Where each tensor of a file laid out tensor after tensor starts: a multiple of a cache line."""
SLOT_SIZE_ALIGN_BYTES = 1 << 20
"""A gather ring slot's file size is a multiple of this: a unit a little larger maps no new file."""
_OWNED: set[str] = set()  # this process's /dev/shm directories, for remove_owned_now()


# ownership


def own(directory: str) -> None:
    """Register ``directory`` as this process's, for :func:`remove_owned_now`."""
    _OWNED.add(directory)


def disown(directory: str) -> None:
    """Remove ``directory`` and forget it (its mapped pages stay valid for whoever maps them)."""
    _OWNED.discard(directory)
    shutil.rmtree(directory, ignore_errors=True)


def remove_owned_now() -> None:
    """Remove every /dev/shm directory of this process, for exits that skip ``atexit`` (the step
    watchdog's and the torchrun worker's ``os._exit``). Mapped pages stay valid for whoever maps them."""
    for directory in list(_OWNED):
        disown(directory)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: existing is all we know


def sweep_stale(root: str = SHM_ROOT, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Remove this user's ``hsdp-*`` directories whose ranks are all gone (each rank leaves a
    ``pid-N`` file in the directories it uses) and that are older than ``min_age_s``: what a job
    killed outright (SIGKILL of every rank, a node's agent killed with its workers) left behind.
    Returns what it removed."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith("hsdp-"):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
                continue
            if time.time() - st.st_mtime < min_age_s:
                continue
            pids = [int(n[4:]) for n in os.listdir(path) if n.startswith("pid-") and n[4:].isdigit()]
        except OSError:
            continue
        if not any(is_alive(pid) for pid in pids):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d stale shared-memory director%s of crashed jobs: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def cleanup_run(run_id: str) -> None:
    """Remove what a run's ranks left under /dev/shm (for a launcher, after its ranks ended)."""
    prefix = f"hsdp-{run_id}-"  # the gather rings (-g) and the shared resident weights (-w)
    try:
        names = os.listdir(SHM_ROOT)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(SHM_ROOT, name), ignore_errors=True)


def job_token(run_id: str | None = None) -> str:
    """This job's part of its /dev/shm names: the run id (the launcher's sweep removes
    ``hsdp-{run_id}-*``) and a random part, so that two jobs sharing a run id (torchrun's static
    rendezvous names every run ``none``) never share a file. Rank 0's is broadcast by the callers."""
    run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return f"{run_id}-{uuid.uuid4().hex[:12]}"


# files


def reserve_shared_file(fd: int, nbytes: int, path: str) -> None:
    """Give a shared file its pages now: a tmpfs that is full fails here with a named error, where
    a file only sized with ``ftruncate`` raises SIGBUS at the first write past what it can hold
    (inside a forward). Where the file system cannot reserve (EOPNOTSUPP), it stays sized only."""
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise OSError(e.errno, f"cannot reserve {nbytes} bytes of shared memory for {path}: {e.strerror} "
                               f"(is {os.path.dirname(path) or SHM_ROOT} full?)") from None


def size_shared_file(path: str, nbytes: int) -> None:
    """Open ``path`` (creating it, mode 0600, in a directory of our own: no link to follow), size
    it to ``nbytes`` and reserve its pages. Every rank of a group may do this at once, for the
    same size: the order does not matter."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        reserve_shared_file(fd, nbytes, path)
    finally:
        os.close(fd)


def create_reserved(path: str, nbytes: int) -> None:
    """Create ``path`` exclusively (mode 0600; an existing file or a link is refused) with its
    ``nbytes`` reserved now: ENOSPC here, not SIGBUS in the middle of a gather."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def map_shared(path: str, nbytes: int) -> mmap.mmap:
    """The first ``nbytes`` of ``path``, mapped shared, read and write (the file stays open only
    through its mapping: unlinking it leaves the pages to whoever maps them)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def create_shared_files(files: list[tuple[str, int]], group: dist.ProcessGroup, leader: int,
                        reason: str | None = None) -> str | None:
    """Collective over ``group``: its ``leader`` (a global rank) creates each ``(path, nbytes)`` of
    ``files`` with :func:`create_reserved`, unless it has a ``reason`` not to; every rank gets the
    leader's reason against the files (that one, or the error that stopped it), or None."""
    if dist.get_rank() == leader and reason is None:
        try:
            for path, nbytes in files:
                create_reserved(path, nbytes)
        except OSError as e:
            reason = f"cannot create {path}: {e}"
    return wire.broadcast(reason, src=leader, group=group)


# agreeing to share


def open_shared_directory(group: dist.ProcessGroup | None, tag: str, need_bytes: int, *, reason: str | None,
                          fallback: str, run_id: str | None = None,
                          files: tuple[tuple[str, int], ...] = ()) -> str | None:
    """This job's shared directory for ``group`` (``hsdp-{token}-{tag}{first rank}`` under
    :data:`SHM_ROOT`) where every rank of the job can share memory, else None on every rank,
    having removed what it made and logged ``fallback: the first reason``.

    A rank with a ``reason`` against sharing already (the same on every rank of ``group``) skips
    the probe; the others probe that every rank of ``group`` sees what its first rank writes and
    that ``need_bytes`` are free, then that first rank creates ``files`` (names in the directory,
    sizes) reserved. Collective over the default group (and ``group``)."""
    token = wire.broadcast(job_token(run_id), src=0)  # one name for the whole run
    directory = None
    if reason is None:
        ranks = dist.get_process_group_ranks(group)
        directory = os.path.join(SHM_ROOT, f"hsdp-{token}-{tag}{ranks[0]}")
        reason = _probe(directory, group, ranks, need_bytes)
        if files:
            paths = [(os.path.join(directory, name), nbytes) for name, nbytes in files]
            verdict = create_shared_files(paths, group, ranks[0], reason)  # every rank of group enters it
            reason = reason or verdict  # a rank that cannot see the group's files keeps its own reason
    if not agree_on_shared_memory(reason, directory, fallback):
        return None
    return directory


def agree_on_shared_memory(reason: str | None, directory: str | None, fallback: str) -> bool:
    """True when no rank of the job has a ``reason`` against sharing memory; else every rank
    removes ``directory`` (if it got that far), logs ``fallback: the first reason`` and gets False.
    Collective over the default group."""
    verdicts = wire.all_gather(reason)
    failed = next((v for v in verdicts if v is not None), None)
    if failed is None:
        return True
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    logger.info("%s: %s", fallback, failed)
    return False


def _probe(directory: str, group: dist.ProcessGroup, ranks: list[int], need_bytes: int) -> str | None:
    """None if every rank of ``group`` sees the bytes the group's first rank writes, else why not.
    Ranks of different nodes (hosts, or torchrun's nodes: ``GROUP_RANK``) never share memory, even
    where two nodes run on one host and would see the same /dev/shm."""
    nodes = wire.all_gather(f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}", group=group)
    if len(set(nodes)) > 1:
        return f"the shard group spans {len(set(nodes))} nodes"
    me = dist.get_rank()
    path = os.path.join(directory, "probe")
    stamp = wire.broadcast(uuid.uuid4().bytes, src=ranks[0], group=group)
    problem = None
    try:
        if me == ranks[0]:
            sweep_stale()
            os.mkdir(directory, mode=0o700)  # exclusively: an existing one (or a link) is refused
            stat = os.statvfs(directory)
            if stat.f_bavail * stat.f_frsize < need_bytes:
                problem = f"{SHM_ROOT} has {stat.f_bavail * stat.f_frsize >> 20} MiB free, {need_bytes >> 20} needed"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(stamp)
    except OSError as e:
        problem = f"cannot write {path}: {e}"
    dist.barrier(group=group)
    with contextlib.suppress(OSError):  # whose directory this is, for sweep_stale of a crashed job
        os.close(os.open(os.path.join(directory, f"pid-{os.getpid()}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    if problem is None and me != ranks[0]:
        try:
            with open(path, "rb") as f:
                if f.read() != stamp:
                    problem = f"{path} differs between ranks"
        except OSError:
            problem = f"rank {me} does not see {path}: another host or another /dev/shm"
    dist.barrier(group=group)
    return problem
