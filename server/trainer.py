"""Push a training job's FSDP2-sharded weights into a running hsdp-serve, shard to shard.

    from server.trainer import push
    push(model, "http://server:8000", version=f"step-{step}")  # on every trainer rank

An FSDP2 trainer's shard of a parameter is a set of rows, and so is a serving rank's: each
serving rank receives exactly its rows from the trainer ranks that hold them (the intersection of
their row ranges; one sender per tensor where the shard sizes match), over a process group of the
trainer's and the server's ranks (gloo on CPU, NCCL on GPUs; ``shard_engine.transfer``), with a
64-bit XXH3 hash per piece. Nothing is gathered on either side; a trainer's float32 master weights
are cast to the server's dtype piece by piece as they go.

Collective over the trainer's default group: every trainer rank calls :func:`push` with its part
of the same model (FSDP2 ``fully_shard`` by rows, on a (replicate, shard) mesh whose ranks are
``replica * shard size + shard``, or a 1-D one). Its rank 0 asks the server (``POST
/admin/weights {"source": "trainer", ...}`` with the API key), which answers at once with the
rendezvous and updates as ``mode`` says (``server.weights``); rank 0 then waits for ``GET
/admin/weights`` to report the version served and returns that update's outcome on every rank.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn

from shard_engine import wire
from shard_engine.transfer import Slot, held_tensors, open_transfer_group, send_pieces, sharded_names, transfer_plan


class PushError(RuntimeError):
    """The server refused the weights, or the transfer or the update failed (its words)."""


def _trainer_mesh(model: nn.Module) -> tuple[int, int]:
    """(replicas, shard size) of the trainer's FSDP2 sharding, from its first sharded parameter."""
    from torch.distributed.fsdp import FSDPModule

    from shard_engine.torch_private import fsdp_params, shard_count

    world = dist.get_world_size()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            params = fsdp_params(module)
            if params:
                shards = shard_count(params[0])
                return world // shards, shards
    return world, 1  # nothing sharded: every rank holds the whole model


def push(model: nn.Module, url: str, *, version: str | None = None, mode: str = "wait",
         api_key: str | None = None, timeout_s: float = 300.0, poll_s: float = 0.2) -> dict:
    """Send this trainer rank's shards of ``model`` to the server at ``url``; every trainer rank
    calls it. Returns the server's record of the update (version, seconds, bytes per serving
    rank); raises :class:`PushError` with the server's words where it refused or failed."""
    import httpx

    url = url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    held = held_tensors(model)
    sharded = sharded_names(model)
    mesh = _trainer_mesh(model)
    device = next((t.device for t, _ in held.values()), torch.device("cpu"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    reply = None
    if dist.get_rank() == 0:
        manifest = [[name, list(_global_shape(t, name, model)), str(t.dtype).removeprefix("torch."),
                     name in sharded] for name, (t, _) in held.items()]
        try:
            r = httpx.post(url + "/admin/weights", headers=headers, timeout=60, json={
                "source": "trainer", "version": version, "mode": mode, "mesh": list(mesh), "manifest": manifest,
                "backend": backend, "timeout_s": timeout_s})
            reply = r.json() if r.status_code == 200 else {"error": f"{r.status_code}: {r.text[:500]}"}
        except httpx.HTTPError as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
    reply = wire.broadcast(reply, src=0)
    if "error" in reply:
        raise PushError(f"the server at {url} refused the weights: {reply['error']}")
    slots = [Slot.from_json(item) for item in reply["manifest"]]
    server = (int(reply["mesh"][0]), int(reply["mesh"][1]))
    senders = mesh[0] * mesh[1]
    import datetime

    store = dist.TCPStore(urlparse(url).hostname, int(reply["port"]), is_master=False,
                          timeout=datetime.timedelta(seconds=float(reply["timeout_s"])))
    group = open_transfer_group(store, reply["key"], dist.get_rank(), senders + server[0] * server[1], backend,
                                float(reply["timeout_s"]), device if backend == "nccl" else None)
    plan = transfer_plan(slots, mesh, server, sent_sharded=[s.name in sharded for s in slots])
    with torch.no_grad():
        sent = send_pieces(group, dist.get_rank(), slots, plan, held)
    outcome = None
    if dist.get_rank() == 0:
        outcome = _wait_for(url, headers, reply["version"], timeout_s, poll_s)
    outcome = wire.broadcast(outcome, src=0)
    if outcome.get("error"):
        raise PushError(f"the server at {url} failed the update: {outcome['error']}")
    return dict(outcome, bytes_sent_by_this_rank=sent)


def _wait_for(url: str, headers: dict, version: str, timeout_s: float, poll_s: float) -> dict:
    """The server's record of the update to ``version`` once it is done: ``GET /admin/weights``
    polled on one connection, first every 10 ms (the update ends soon after the last byte
    arrives), backing off to every ``poll_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    delay = min(0.01, poll_s)
    with httpx.Client(headers=headers, timeout=30) as client:
        while time.monotonic() < deadline:
            state = client.get(url + "/admin/weights").json()
            last = state.get("last_update") or {}
            if state.get("in_progress") is None and last.get("version") == version and last.get("source") == "trainer":
                return last
            time.sleep(delay)
            delay = min(delay * 2, poll_s)
    return {"error": f"the update was not done within {timeout_s} s"}


def _global_shape(tensor: torch.Tensor, name: str, model: nn.Module) -> torch.Size:
    try:
        return model.get_parameter(name).shape  # a DTensor's, or a gathered one's: the whole parameter's
    except AttributeError:
        return tensor.shape  # a buffer
