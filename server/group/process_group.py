"""This rank in the process group: how it joins (device, backend, cores, the group's secret) and leaves.

:func:`init_rank` forms the default process group (NCCL on ``cuda:LOCAL_RANK``, gloo on CPU with
the node's cores split between its ranks) and then :func:`authenticate_group`: every rank proves
to rank 0 that it knows ``HSDP_GROUP_SECRET`` through the group's store before any control
message. :func:`close_rank` destroys the groups and lets their threads drain. The resolvers say
how many ranks a node starts and on which device type; knows nothing of checkpoints or HTTP.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import time

import torch
import torch.distributed as dist

from server.config import DEVICE_TYPES, read_secret_file
from server.group.forkserver import is_under_torchrun
from shard_engine.torch_private import default_store

logger = logging.getLogger(__name__)

def resolve_world_size(nproc_per_node: int) -> int:
    """The group's world size: torchrun's under torchrun, else ``nproc_per_node`` on this node."""
    if is_under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return nproc_per_node


CPU_DEFAULT_NPROC_PER_NODE = 2
"""Ranks per node that ``--nproc-per-node auto`` starts on CPU (gloo)."""


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
    store = default_store()
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


_THREAD_DRAIN_S = 0.05

