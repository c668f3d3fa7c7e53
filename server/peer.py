"""Weights between two running groups that serve the same checkpoint (``loaders.peer`` moves them).

A group started with ``--load-from-peer URL`` asks the server at URL (``POST /admin/peer-load``,
with this server's API key) from its rank 0 while it loads: :class:`PeerClient`. The sender
(``--share-weights``) checks the request (:meth:`WeightSharing.offer`: the same checkpoint, the
same manifest, the same kind of device, no transfer already running), opens a store for a
transfer group on its rank 0, and hands every step group's next plan a ``PeerShare``; each of its
ranks then sends from a thread of its own (``loaders.peer.send_to_peer``) while it goes on
serving. One transfer at a time; a refusal is a 4xx with a JSON body naming why, and the
receiving group reads storage instead.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import threading
import time
from urllib.parse import urlparse

from loaders.errors import PeerLoadError
from loaders.peer import Rendezvous, send_to_peer, transfer_backend
from shard_engine.transfer import Slot, manifest_difference, manifest_digest

logger = logging.getLogger(__name__)

ROUTE = "/admin/peer-load"


class PeerClient:
    """Rank 0 of a receiving group: ask the server at ``url`` for a transfer (``loaders.peer``'s ``ask``)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s

    def __call__(self, request: dict) -> Rendezvous:
        import httpx

        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:  # (no TLS context to build for a plain http:// peer: 75 ms of a load's critical path)
            with httpx.Client(timeout=self.timeout_s, verify=self.url.startswith("https://")) as client:
                response = client.post(self.url + ROUTE, json=request, headers=headers)
        except httpx.HTTPError as e:
            raise PeerLoadError(f"the peer {self.url} is unreachable: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            try:
                why = response.json().get("error", response.text)
            except ValueError:
                why = response.text
            raise PeerLoadError(f"the peer {self.url} refused ({response.status_code}): {str(why)[:300]}")
        body = dict(response.json())
        body["host"] = urlparse(self.url).hostname  # the sender's store listens on every interface
        return Rendezvous.from_json(body)


class WeightSharing:
    """Rank 0 of a sending group: the transfers it offers, one at a time."""

    def __init__(self, manifest: list[Slot], fingerprint: str, mesh_shape: tuple[int, int], device, timeout_s: float,
                 metrics=None):
        self.manifest, self.fingerprint, self.mesh_shape = manifest, fingerprint, tuple(mesh_shape)
        self.digest = manifest_digest(manifest)
        self.backend = transfer_backend(device)
        self.timeout_s, self.metrics = timeout_s, metrics
        self.router = None  # set once the schedulers exist (server.main)
        self.admin = None  # server.weights.WeightsAdmin: no transfer while the weights change
        self._lock = threading.Lock()
        self._active: dict | None = None  # the running transfer: its store, key, start
        self.transfers: list[dict] = []  # the last few, for /info

    def offer(self, body) -> dict:
        """A transfer's rendezvous for request ``body`` (``loaders.peer.receive_from_peer``'s), or a
        ConflictError / InputValidationError / UnavailableError saying why not."""
        from server.http.errors import ConflictError, InputValidationError, UnavailableError

        if not isinstance(body, dict):
            raise InputValidationError("the body must be a JSON object")
        fingerprint, manifest, mesh, backend = (body.get(k) for k in ("fingerprint", "manifest", "mesh", "backend"))
        if not (isinstance(mesh, list) and len(mesh) == 2 and all(isinstance(m, int) and 1 <= m <= 65536 for m in mesh)):
            raise InputValidationError("mesh: two positive integers, [replicas, shard size]", param="mesh")
        if not isinstance(manifest, list):
            raise InputValidationError("manifest: a list of tensors", param="manifest")
        try:
            theirs = [Slot.from_json(item) for item in manifest]
        except ValueError as e:
            raise InputValidationError(f"manifest: {e}", param="manifest") from None
        if backend != self.backend:
            self._refused()
            raise ConflictError(f"this group sends over {self.backend}; the receiver asked for {backend}")
        if fingerprint != self.fingerprint:
            self._refused()
            raise ConflictError("this group serves another checkpoint (its config.json or tensor headers differ)")
        difference = manifest_difference(self.manifest, theirs)
        if difference is not None:
            self._refused()
            raise ConflictError(f"the receiver loads the model otherwise (dtype, quantization): {difference}")
        if self.router is None:
            raise UnavailableError("this group is not serving yet", headers={"Retry-After": "1"})
        import torch.distributed as dist

        with self._lock:
            if self._active is not None:
                raise UnavailableError("a transfer to another peer group is running", headers={"Retry-After": "5"})
            if self.admin is not None and self.admin.lock.locked():
                raise UnavailableError("the weights are being updated (POST /admin/weights)",
                                       headers={"Retry-After": "5"})
            store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            key = secrets.token_hex(16)
            self._active = {"store": store, "key": key, "started": time.time(), "receivers": list(mesh)}
        from server.engine.plan import PeerShare

        self.router.share_weights(PeerShare(port=store.port, key=key, receivers=(mesh[0], mesh[1]),
                                            backend=self.backend, timeout_s=self.timeout_s))
        logger.info("sending the weights to a peer group of %d x %d ranks", mesh[0], mesh[1])
        return {"port": store.port, "key": key, "mesh": list(self.mesh_shape), "backend": self.backend,
                "timeout_s": self.timeout_s}

    def finished(self, sent: int, seconds: float, error: BaseException | None) -> None:
        """Rank 0's sending thread: the transfer ended (its store goes)."""
        with self._lock:
            active, self._active = self._active, None
        record = {"started": active["started"] if active else None, "receivers": active and active["receivers"],
                  "bytes_sent_by_rank_0": sent, "seconds": round(seconds, 3),
                  "error": f"{type(error).__name__}: {error}" if error is not None else None}
        self.transfers = (self.transfers + [record])[-8:]
        if self.metrics is not None:
            self.metrics.peer_transfers.labels("sent", "ok" if error is None else "failed").inc()
            self.metrics.peer_bytes.labels("sent").inc(sent)

    @property
    def busy(self) -> bool:
        return self._active is not None

    def _refused(self) -> None:
        if self.metrics is not None:
            self.metrics.peer_transfers.labels("sent", "refused").inc()

    def describe(self) -> dict:
        return {"enabled": True, "running": self._active is not None, "transfers": self.transfers}


def share_hook(loaded, mesh_shape: tuple[int, int], rank: int, sharing: WeightSharing | None):
    """``run_engine_loop``'s ``on_share`` for this rank: start sending its shards."""

    def on_share(share) -> None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # rank 0's, where the transfer's store listens
        send_to_peer(loaded.model, loaded.manifest, mesh_shape, rank, host, share.port, share.key,
                     tuple(share.receivers), share.backend, share.timeout_s,
                     done=sharing.finished if rank == 0 and sharing is not None else None)

    return on_share
