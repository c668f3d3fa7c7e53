"""New weights into the running group: ``POST /admin/weights`` from storage, by rows.

Rank 0 (:class:`WeightsAdmin`) checks the new checkpoint first, from its config and headers
alone (``loaders.update_hsdp_model(check_only=True)``: the same model tensor for tensor, every
tensor there): a mismatch is a 4xx naming it, and nothing pauses. Then every step group stops
admitting and, as the request's ``mode`` says (vLLM's: ``wait``, ``abort``, ``keep``), plans an
update step (``server.engine.scheduler``); on that step every rank streams its rows of the new
checkpoint into its shards (:func:`apply_update`: the same streaming loader, at most a unit's rows
beyond the model), refreshes what was built from them (private gathered copies of resident units;
packed linears), and reports. The groups hold until all have updated, then resume together:
ranks that share a host's resident copy never step on rows another is still writing. The prefix
cache is dropped (its blocks were computed by the old weights).

A rank that fails after its first write leaves the model part old, part new: it raises, and the
group goes down as on any rank's fault (``/health`` 503, every process exits non-zero) rather than
serve a mixture. One update at a time, never during a transfer to a peer (``server.peer``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from loaders.errors import CheckpointError, PartialUpdateError

logger = logging.getLogger(__name__)

MODES = ("wait", "abort", "keep")


class WeightsAdmin:
    """Rank 0: the served weights' version and source, and the updates of them."""

    def __init__(self, loaded, cfg, source_path: str, metrics=None):
        self.loaded, self.cfg, self.metrics = loaded, cfg, metrics
        self.version = label(cfg.served_model_name or os.path.basename(source_path.rstrip("/")))
        self.source = source_path
        self.updated_at: float | None = None
        self.last: dict | None = None  # the last update's outcome
        self.running: dict | None = None  # the update in progress
        self.lock = threading.Lock()  # one update at a time; a peer transfer waits for it (server.peer)
        self.router = None
        self.sharing = None  # server.peer.WeightSharing with --share-weights
        self.loaded_mesh: tuple[int, int] = (1, 1)  # this group's (replicas, shard size), for trainers
        self.state = None  # rank 0's ServerState: a failed group ends a wait

    def readiness(self) -> tuple[dict | None, bool]:
        """What ``/ready`` says of an update in progress (None: none), and whether it asked to drain
        (``"drain": true``: ``/ready`` answers 503 until it ends, so that a load balancer's readiness
        check sends the group nothing meanwhile: ``server.roll``)."""
        running = self.running
        if running is None:
            return None, False
        return {k: running[k] for k in ("source", "version", "mode", "phase", "started") if k in running}, \
            bool(running.get("drain"))

    def describe(self) -> dict:
        return {"version": self.version, "source": self.source, "updated_at": self.updated_at,
                "in_progress": self.running, "last_update": self.last, "replicas": self.replica_versions()}

    def replica_versions(self) -> list[dict]:
        """Each replica's weights as its step groups compute with them now: ``{"replica", "version",
        "updating"}``. While an update rolls, replicas already done report the new version and
        the others the old one; ``updating`` marks the replica whose groups hold for it."""
        if self.router is None:
            return []
        schedulers = self.router.schedulers
        return [{"replica": replica, "version": schedulers[groups[0]].weights_version,
                 "updating": any(schedulers[i].updating for i in groups)}
                for replica, groups in enumerate(self._replica_groups())]

    def update(self, body) -> dict:
        """``POST /admin/weights``'s work (on a worker thread): checked, then applied; 4xx errors
        raised as the API's error classes, the old weights serving on."""
        from server.engine.plan import WeightUpdate
        from server.http.errors import InputValidationError, UnavailableError

        if isinstance(body, dict) and body.get("source") == "trainer":
            return self.from_trainer(body)
        source, version, mode, revision = _parse(body)
        self._take_lock()
        try:
            began = time.perf_counter()
            self.running = {"source": source, "version": version, "mode": mode, "phase": "checking",
                            "started": time.time(), "drain": bool(body.get("drain"))}
            try:
                update = _located(source, version, revision)
                self._check(update.source)
            except (CheckpointError, ValueError) as e:
                self._count("refused")
                raise InputValidationError(f"{source}: {e}", param="source") from None
            if update.hub is not None:  # the commit the repo id and revision named: all ranks read it
                source = f"{update.hub}@{update.revision}"
                version = update.version
                self.running.update(source=source, version=version)
            self.running["phase"] = "updating"
            try:
                reports = self.router.update_weights(update, mode, failed=self._group_failed,
                                                     rolling=self._rolling())
            except RuntimeError as e:
                self._count("failed")
                raise UnavailableError(str(e)) from None
            errors = [f"rank {rank}: {r.error}" for rank, r in reports if r.error]
            seconds = round(time.perf_counter() - began, 3)
            outcome = {"source": source, "version": version, "mode": mode, "seconds": seconds,
                       "bytes_read_per_rank": [r.bytes_read for _, r in reports],
                       "update_seconds_per_rank": [r.seconds for _, r in reports]}
            if errors:  # every rank refused before writing (the same files, the same checks)
                self._count("refused")
                outcome["error"] = "; ".join(errors)
                self.last = outcome
                raise InputValidationError(f"{source}: {errors[0]}", param="source")
            self.version, self.source, self.updated_at = version, source, time.time()
            self.last = outcome
            self._count("ok")
            if self.metrics is not None:
                self.metrics.weight_update_seconds.observe(seconds)
                self.metrics.weights_version.labels(version).set(1)
            logger.info("weights updated to %s (%s) in %.2f s", version, source, seconds)
            return dict(outcome, status="updated")
        finally:
            self.running = None
            self.lock.release()

    def from_trainer(self, body: dict) -> dict:
        """``{"source": "trainer", "manifest", "mesh", "backend", "version"?, "mode"?}`` (what
        ``server.trainer.push`` sends): the rendezvous for the trainer's ranks, answered at once;
        the update runs on a thread of its own and ``GET /admin/weights`` tells when it is done."""
        import datetime
        import secrets

        import torch.distributed as dist

        from loaders.peer import transfer_backend
        from server.engine.plan import TrainerTransfer, WeightUpdate
        from server.http.errors import InputValidationError
        from shard_engine.transfer import Slot, slots_as_json

        version, mode = body.get("version") or "trainer", body.get("mode", "wait")
        _, version, mode, _ = _parse({"source": "trainer", "version": version, "mode": mode})
        mesh, manifest, backend = body.get("mesh"), body.get("manifest"), body.get("backend")
        if not (isinstance(mesh, list) and len(mesh) == 2 and all(isinstance(m, int) and m >= 1 for m in mesh)):
            raise InputValidationError("mesh: [replicas, shard size] of the trainer", param="mesh")
        try:
            theirs = {slot.name: slot for slot in (Slot.from_json(item) for item in manifest)}
        except (TypeError, ValueError) as e:
            raise InputValidationError(f"manifest: {e}", param="manifest") from None
        ours = trainer_manifest(self.loaded)
        for slot in ours:
            other = theirs.get(slot.name)
            if other is None or other.shape != slot.shape:
                self._count("refused")
                held = "none" if other is None else list(other.shape)
                raise InputValidationError(f"the trainer's model is not the one served: {slot.name} is "
                                           f"{list(slot.shape)} here, {held} in the trainer", param="manifest")
        if backend != transfer_backend(self.loaded.context.target_device):
            raise InputValidationError(f"backend: this group receives over "
                                       f"{transfer_backend(self.loaded.context.target_device)}", param="backend")
        self._take_lock()
        timeout_s = max(self.cfg.peer_timeout_s, float(body.get("timeout_s") or 0))
        try:
            store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except Exception:
            self.lock.release()
            raise
        key = secrets.token_hex(16)
        update = WeightUpdate(source="trainer", version=version, trainer=TrainerTransfer(
            port=store.port, key=key, senders=(mesh[0], mesh[1]), backend=backend, timeout_s=timeout_s,
            sent_sharded=[theirs[slot.name].sharded for slot in ours]))
        self.running = {"source": "trainer", "version": version, "mode": mode, "phase": "updating",
                        "started": time.time()}
        threading.Thread(target=self._apply_from_trainer, args=(update, mode, store), daemon=True,
                         name="hsdp-trainer-update").start()
        return {"status": "accepted", "port": store.port, "key": key, "mesh": list(self.loaded_mesh),
                "backend": backend, "timeout_s": timeout_s, "manifest": slots_as_json(ours), "version": version}

    def _apply_from_trainer(self, update, mode: str, store) -> None:
        began = time.perf_counter()
        try:
            # every serving rank joins the trainer's one transfer group at once: never rolled
            reports = self.router.update_weights(update, mode, failed=self._group_failed)
            errors = [f"rank {rank}: {r.error}" for rank, r in reports if r.error]
            outcome = {"source": "trainer", "version": update.version, "mode": mode,
                       "seconds": round(time.perf_counter() - began, 3),
                       "bytes_received_per_rank": [r.bytes_read for _, r in reports],
                       "update_seconds_per_rank": [r.seconds for _, r in reports]}
            if errors:
                outcome["error"] = "; ".join(errors)
                self._count("failed")
            else:
                self.version, self.source, self.updated_at = update.version, "trainer", time.time()
                self._count("ok")
                if self.metrics is not None:
                    self.metrics.weight_update_seconds.observe(outcome["seconds"])
                    self.metrics.weights_version.labels(update.version).set(1)
                logger.info("weights updated to %s from a trainer in %.2f s", update.version, outcome["seconds"])
            self.last = outcome
        except RuntimeError as e:
            self.last = {"source": "trainer", "version": update.version, "error": str(e)}
            self._count("failed")
        finally:
            del store  # (the transfer group formed long before: its store may go)
            self.running = None
            self.lock.release()

    def _check(self, source: str) -> None:
        from loaders import update_hsdp_model

        if not os.path.isdir(source):
            raise CheckpointError("no such directory (a local checkpoint directory, as --model takes)", path=source)
        update_hsdp_model(self.loaded, source, dtype=self.cfg.torch_dtype or "auto", quantize=_quantize(self.cfg),
                          check_only=True)

    def _take_lock(self) -> None:
        """Hold the one update's lock (the caller releases it), or say why not: 503 before serving,
        409 while another update or a transfer to a peer group runs."""
        from server.http.errors import ConflictError, UnavailableError

        if self.router is None:
            raise UnavailableError("not serving yet", headers={"Retry-After": "1"})
        if not self.lock.acquire(blocking=False):
            raise ConflictError("another weight update is running")
        if self.sharing is not None and self.sharing.busy:
            self.lock.release()
            raise ConflictError("a transfer of the weights to a peer group is running (server.peer)")

    def _rolling(self) -> list[list[int]] | None:
        """With several replicas, their step groups (indices), to update one replica at a time."""
        return self._replica_groups() if self.loaded_mesh[0] >= 2 else None

    def _replica_groups(self) -> list[list[int]]:
        """Each replica's step groups (indices into the router's), replica by replica."""
        shard = self.loaded_mesh[1]
        out: dict[int, list[int]] = {}
        for i, ranks in enumerate(self.router.replicas):
            out.setdefault(ranks[0] // shard, []).append(i)
        return [out[r] for r in sorted(out)]

    def _group_failed(self) -> bool:
        state = getattr(self, "state", None)
        return state is not None and state.phase == "failed"

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.weight_updates.labels(outcome).inc()


def _parse(body) -> tuple[str, str | None, str, str | None]:
    """(source, version or None, mode, revision or None) of a ``POST /admin/weights`` body."""
    from loaders.sources.hub import looks_like_repo_id
    from server.http.errors import InputValidationError

    if not isinstance(body, dict):
        raise InputValidationError("the body must be a JSON object")
    unknown = set(body) - {"source", "version", "mode", "revision", "drain"}
    if unknown:
        raise InputValidationError(f"unknown field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    source, version, mode = body.get("source"), body.get("version"), body.get("mode", "wait")
    revision = body.get("revision")
    if not isinstance(source, str) or not source:
        raise InputValidationError("source: a checkpoint directory, an s3:// prefix, a Hugging Face repo id, or "
                                   "\"trainer\"", param="source")
    if "://" in source and not source.startswith("s3://"):
        raise InputValidationError("source: a local checkpoint directory, an s3:// prefix or a Hugging Face repo id; "
                                   "other URLs are not implemented", param="source")
    if revision is not None and (not isinstance(revision, str) or not revision or not looks_like_repo_id(source)):
        raise InputValidationError("revision: a branch, tag or commit of a Hugging Face repo id given as source",
                                   param="revision")
    if version is not None and (not isinstance(version, str) or not 0 < len(version) <= 128
                                or not all(" " <= c <= "~" for c in version)):
        raise InputValidationError("version: a label of 1 to 128 printable ASCII characters (it is sent as the "
                                   "x-weights-version header)", param="version")
    if mode not in MODES:
        raise InputValidationError(f"mode: one of {', '.join(MODES)}", param="mode")
    if not isinstance(body.get("drain", False), bool):
        raise InputValidationError("drain: true or false (true: /ready answers 503 while this update runs, so a "
                                   "load balancer sends the group nothing meanwhile)", param="drain")
    return source, version, mode, revision


UPDATES_KEPT = 4
"""Directories of object-storage updates a host keeps (``update_directory``)."""

SMALL_FILES = ("config.json", "model.safetensors.index.json")
"""What every rank needs of a checkpoint in object storage besides ``remote.json``: its rows are read
from the store itself (``loaders.remote``)."""


def _located(source: str, version: str | None, revision: str | None):
    """The update of ``source``, located on rank 0's host (a ValueError, in one line, where it
    cannot be): a directory is itself; an ``s3://`` prefix is listed and its small files fetched
    now, to travel with the update (:func:`_local_checkpoint`); a Hugging Face repo id is found in
    (or downloaded to) this host's Hub cache at ``revision`` (``loaders.sources.hub``, as ``--model``
    does), and every rank reads the commit that resolved to from its own host's cache
    (:func:`update_directory`). The version label defaults to the directory's or prefix's last
    name, or ``repo@commit`` (its first 12 characters)."""
    from loaders.sources.hub import download_hub_model, looks_like_repo_id
    from server.engine.plan import WeightUpdate

    if looks_like_repo_id(source):  # (never a path that exists, nor a URL)
        local = download_hub_model(source, revision)
        commit = os.path.basename(local.rstrip(os.sep))  # the snapshot's directory: its commit
        return WeightUpdate(source=local, version=version or label(f"{source}@{commit[:12]}"), hub=source,
                            revision=commit)
    local, files = _local_checkpoint(source)
    return WeightUpdate(source=local, version=version or label(os.path.basename(source.rstrip("/"))), files=files)


def _local_checkpoint(source: str) -> tuple[str, dict[str, bytes]]:
    """``source`` as a local directory, and the files each rank must write where its host lacks it:
    an ``s3://`` prefix is listed and its small files fetched now (``loaders.sources.s3``: the
    store's current objects, whatever an earlier load of the same prefix fetched); a directory is
    itself, with none."""
    if not source.startswith("s3://"):
        return source, {}
    from loaders.remote import REMOTE_FILE
    from loaders.sources.s3 import resolve_s3

    try:
        local = resolve_s3(source)
    except ValueError as e:  # (its words name --model, as the load's; here it is the update's source)
        raise ValueError(str(e).replace(f"--model {source}: ", "")) from None
    except Exception as e:  # noqa: BLE001 - botocore's transport errors, a full disk: the source cannot be read
        raise ValueError(f"cannot fetch its files: {type(e).__name__}: {e}") from None
    files = {}
    for name in (*SMALL_FILES, REMOTE_FILE):
        path = os.path.join(local, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    return local, files


def update_directory(update) -> str:
    """The directory a rank reads ``update`` from: a Hub repo's snapshot at the update's commit in
    this host's Hub cache (downloaded where this host lacks it; huggingface_hub locks each file, so
    a host's ranks fetch it once); its source where the checkpoint is local (or none of its files
    travel); else a directory named by the files' content under this host's cache, written once
    (aside, then renamed into place: the host's other ranks may race to the same)."""
    if update.hub is not None:
        from loaders.sources.hub import download_hub_model

        return download_hub_model(update.hub, update.revision)
    if not update.files:
        return update.source
    import hashlib
    import shutil
    import tempfile

    from loaders.sources.default_model import cache_root

    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in sorted(update.files.items())))
    root = os.path.join(cache_root(), "updates")
    target = os.path.join(root, digest.hexdigest()[:24])
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".write-", dir=root)
    try:
        for name, data in update.files.items():
            with open(os.path.join(staging, os.path.basename(name)), "wb") as f:
                f.write(data)
        os.replace(staging, target)
    except OSError:
        if not os.path.isdir(target):  # (another rank's won the rename: the same content)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # an RL loop updates every step: keep this and the few before it (another rank may still read one)
    kept = sorted((os.path.join(root, n) for n in os.listdir(root) if not n.startswith(".")),
                  key=lambda p: os.stat(p).st_mtime if os.path.exists(p) else 0, reverse=True)
    for old in kept[UPDATES_KEPT:]:
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


def label(name: str) -> str:
    """A version label from a name: printable ASCII (an HTTP header's), at most 128 characters."""
    return "".join(c if " " <= c <= "~" else "_" for c in name)[:128] or "initial"


def _quantize(cfg) -> str | None:
    return None if cfg.quantization == "none" else cfg.quantization


def apply_update(loaded, cfg, residency, update, mesh_shape: tuple[int, int] = (1, 1)):
    """Every rank, on the update step: its rows of ``update.source`` into its shards, then what was
    built from them refreshed. An UpdateReport; an error before any write is reported (the old
    weights stand); one after raises :class:`PartialUpdateError` (the group must go down)."""
    from loaders import update_hsdp_model
    from server.engine.plan import UpdateReport
    from server.group.memory import release_freed_memory

    began = time.perf_counter()
    if update.trainer is not None:
        received = receive_from_trainer(loaded, update.trainer, mesh_shape)
        if isinstance(received, str):
            return UpdateReport(bytes_read=0, seconds=round(time.perf_counter() - began, 3), error=received)
        _refresh(loaded.model, residency)
        return UpdateReport(bytes_read=received, seconds=round(time.perf_counter() - began, 3))
    try:
        stats = update_hsdp_model(loaded, update_directory(update), dtype=cfg.torch_dtype or "auto",
                                  quantize=_quantize(cfg), load_concurrency=cfg.load_concurrency,
                                  map_files=cfg.load_mmap)
    except PartialUpdateError:
        raise
    except (CheckpointError, OSError, ValueError) as e:
        return UpdateReport(bytes_read=0, seconds=round(time.perf_counter() - began, 3),
                            error=f"{type(e).__name__}: {e}")
    _refresh(loaded.model, residency)
    release_freed_memory()
    return UpdateReport(bytes_read=stats.bytes_read, seconds=round(time.perf_counter() - began, 3))


def receive_from_trainer(loaded, transfer, mesh_shape: tuple[int, int]) -> int | str:
    """This rank's rows of every served tensor from the trainer's ranks, received straight into its
    shards: the bytes received, or why nothing was (the transfer group never formed). A failure once
    bytes may have landed raises PartialUpdateError."""
    import datetime

    import torch.distributed as dist

    from shard_engine.transfer import held_tensors, open_transfer_group, receive_pieces, transfer_plan

    senders = transfer.senders[0] * transfer.senders[1]
    me = senders + dist.get_rank()
    try:
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), transfer.port, is_master=False,
                              timeout=datetime.timedelta(seconds=transfer.timeout_s))
        device = loaded.context.target_device
        group = open_transfer_group(store, transfer.key, me, senders + dist.get_world_size(), transfer.backend,
                                    transfer.timeout_s, device if device.type == "cuda" else None)
    except (RuntimeError, ValueError, OSError) as e:
        return f"the trainer's ranks did not join: {type(e).__name__}: {e}"
    from loaders.quantization.on_load import dense_manifest, quantize_rows

    slots, dense = dense_manifest(loaded.model, loaded.manifest)
    plan = transfer_plan(slots, transfer.senders, mesh_shape, sent_sharded=transfer.sent_sharded)
    held = held_tensors(loaded.model)
    received = 0
    try:
        for name, rows in receive_pieces(group, me, slots, plan, loaded.context.target_device,
                                         into={n: t for n, t in held.items() if n not in dense}):
            received += rows.numel() * rows.element_size()
            if name in dense:  # a linear quantized on load: its rows quantized here, as at load
                stem = name.removesuffix("weight")
                for part, value in quantize_rows(rows, dense[name].format).items():
                    held[stem + part][0].copy_(value)
    except Exception as e:
        raise PartialUpdateError(f"receiving from the trainer failed after {received} bytes: {type(e).__name__}: {e}",
                                 path="trainer") from e
    return received


def trainer_manifest(loaded) -> list:
    """The tensors a trainer sends, in order (``shard_engine.transfer.Slot``s): what the model
    holds, but a linear quantized on load (``--quantization int8|fp8``) as its dense weight, whose
    rows each serving rank quantizes as they arrive (``loaders.quantization.on_load``). Every rank
    derives the same list from its own model."""
    from loaders.quantization.on_load import dense_manifest

    return dense_manifest(loaded.model, loaded.manifest)[0]


def _refresh(model, residency) -> None:
    """What was computed from the shards, again: private gathered copies of resident units (a
    collective over the shard group, which updates at the same step in lockstep groups), and
    packed linears' copies. A host's shared resident copy needs nothing: the shards are its rows."""
    from server.engine.linears import repack_linears
    from shard_engine import set_resident_units

    if residency is not None and residency.units and not residency.shared_bytes:
        set_resident_units(model, len(residency.units))
    repack_linears(model)
