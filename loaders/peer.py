"""A checkpoint's rows from a running group that serves it, instead of from storage.

The receiving group (starting, or restarted) builds its skeleton and checks the checkpoint's
config, index and headers as any load does; then, instead of reading the files, its rank 0 asks
the sending group (``ask``: :class:`server.peer.PeerClient` asks over HTTP) for a transfer with
the checkpoint's :meth:`~loaders.checkpoint.CheckpointFiles.fingerprint` and the load's manifest
(``shard_engine.transfer``); the sender refuses anything that differs (another checkpoint, dtype,
quantization, a tensor of another shape) before a byte moves. Both groups' ranks then join one
transfer group, each receiving rank gets its rows of every tensor from the sending ranks that
hold them, and every unit is sharded as its last tensor arrives, exactly as from storage.
Whatever goes wrong (no sender, a refusal, a peer that dies, a checksum that differs) raises
:class:`PeerLoadError` on every receiving rank; the caller loads from storage instead.

:func:`send_to_peer` is the sending rank's side, run on a thread of a serving rank: its shards
are read-only while it serves, so it sends views of them while its main thread keeps stepping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loaders.errors import PeerLoadError
from shard_engine import wire
from shard_engine.transfer import (
    Slot,
    held_tensors,
    open_transfer_group,
    plan_bytes,
    receive_pieces,
    send_pieces,
    slots_as_json,
    transfer_plan,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the receiving ranks join a sender's transfer group."""

    host: str
    port: int
    key: str
    senders: tuple[int, int]  # the sending group's mesh: (replicas, shard size)
    backend: str
    timeout_s: float

    def to_json(self) -> dict:
        return {"host": self.host, "port": self.port, "key": self.key, "mesh": list(self.senders),
                "backend": self.backend, "timeout_s": self.timeout_s}

    @classmethod
    def from_json(cls, body: dict) -> Rendezvous:
        try:
            mesh = body["mesh"]
            return cls(str(body["host"]), int(body["port"]), str(body["key"]), (int(mesh[0]), int(mesh[1])),
                       str(body["backend"]), float(body["timeout_s"]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PeerLoadError(f"a malformed rendezvous from the peer: {e}") from e


def transfer_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def receive_from_peer(load, ask: Callable[[dict], Rendezvous], files, mesh_shape: tuple[int, int],
                      device: torch.device) -> int:
    """Every receiving rank: fill ``load`` (a ``loaders.streaming._StreamingLoad`` of checkpoint
    ``files``) from the peer ``ask`` names (called on rank 0 only). Returns this rank's bytes received."""
    manifest = load.manifest()
    reply = None
    began = time.perf_counter()
    if dist.get_rank() == 0:
        try:
            reply = ask({"fingerprint": files.fingerprint(), "manifest": slots_as_json(manifest), "mesh": list(mesh_shape),
                         "backend": transfer_backend(device)}).to_json()
        except Exception as e:  # noqa: BLE001 - every rank learns of it below and falls back
            reply = {"error": f"{type(e).__name__}: {e}" if not isinstance(e, PeerLoadError) else str(e)}
    reply = wire.broadcast(reply, src=0)
    if "error" in reply:
        raise PeerLoadError(str(reply["error"]))
    rendezvous = Rendezvous.from_json(reply)
    if rendezvous.backend != transfer_backend(device):
        raise PeerLoadError(f"the peer sends over {rendezvous.backend}, this group computes on {device.type}")
    senders = rendezvous.senders[0] * rendezvous.senders[1]
    me = senders + dist.get_rank()
    asked = time.perf_counter()
    try:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False,
                              timeout=_timedelta(rendezvous.timeout_s))
        group = open_transfer_group(store, rendezvous.key, me, senders + dist.get_world_size(), rendezvous.backend,
                                    rendezvous.timeout_s, device if device.type == "cuda" else None)
        joined = time.perf_counter()
        plan = transfer_plan(manifest, rendezvous.senders, mesh_shape)
        expected = plan_bytes(manifest, plan, me)
        received = 0
        for name, rows in receive_pieces(group, me, manifest, plan, device):
            received += rows.numel() * rows.element_size()
            load.deliver_received(name, rows, received, expected)
        load.finish_received()
        if dist.get_rank() == 0:
            done = time.perf_counter()
            logger.info("received %.1f MB of rank 0's rows from %s:%d in %.2f s (%.2f s asking, %.2f s joining the "
                        "transfer group, %.2f s receiving and sharding: %.2f GB/s)", received / 1e6,
                        rendezvous.host, rendezvous.port, done - began, asked - began, joined - asked, done - joined,
                        received / max(done - joined, 1e-9) / 1e9)
    except PeerLoadError:
        raise
    except (RuntimeError, ValueError, OSError) as e:
        raise PeerLoadError(f"the transfer from {rendezvous.host}:{rendezvous.port} failed: {e}") from e
    return received


def send_to_peer(model, manifest: list[Slot], mesh_shape: tuple[int, int], rank: int, host: str, port: int,
                 key: str, receivers: tuple[int, int], backend: str, timeout_s: float,
                 done: Callable[[int, float, BaseException | None], None] | None = None) -> threading.Thread:
    """A sending rank (global ``rank`` of a group of ``mesh_shape``): send a receiving group of
    ``receivers`` its rows of every tensor of ``manifest`` on a thread of its own, which it
    returns. What this rank holds is taken now, on the calling (stepping) thread; ``done(bytes
    sent, seconds, error)`` is called on the thread at the end."""
    held = held_tensors(model)
    missing = [slot.name for slot in manifest if slot.name not in held]
    senders = mesh_shape[0] * mesh_shape[1]

    def run() -> None:
        start, sent, error = time.perf_counter(), 0, None
        try:
            if backend == "nccl":  # a new thread's current device is cuda:0
                torch.cuda.set_device(_device_of(held))
            if missing:
                raise PeerLoadError(f"this rank holds no tensor {missing[0]!r}")
            store = dist.TCPStore(host, port, is_master=False, timeout=_timedelta(timeout_s))
            group = open_transfer_group(store, key, rank, senders + receivers[0] * receivers[1], backend, timeout_s,
                                        _device_of(held) if backend == "nccl" else None)
            sent = send_pieces(group, rank, manifest, transfer_plan(manifest, mesh_shape, receivers), held)
            logger.info("sent %.1f MB of this rank's shards to a peer group in %.2f s", sent / 1e6,
                        time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - a failed transfer never stops serving
            error = e
            logger.warning("sending shards to a peer group failed: %s: %s", type(e).__name__, e)
        if done is not None:
            done(sent, time.perf_counter() - start, error)

    thread = threading.Thread(target=run, name="hsdp-peer-send", daemon=True)
    thread.start()
    return thread


def _device_of(held) -> torch.device:
    return next((t.device for t, _ in held.values() if t.device.type != "cpu"), torch.device("cpu"))


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
