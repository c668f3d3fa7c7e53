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
        self.version = cfg.served_model_name or os.path.basename(source_path.rstrip("/")) or "initial"
        self.source = source_path
        self.updated_at: float | None = None
        self.last: dict | None = None  # the last update's outcome
        self.running: dict | None = None  # the update in progress
        self.lock = threading.Lock()  # one update at a time; a peer transfer waits for it (server.peer)
        self.router = None
        self.sharing = None  # server.peer.WeightSharing with --share-weights
        self.state = None  # rank 0's ServerState: a failed group ends a wait

    def describe(self) -> dict:
        return {"version": self.version, "source": self.source, "updated_at": self.updated_at,
                "in_progress": self.running, "last_update": self.last}

    def update(self, body) -> dict:
        """``POST /admin/weights``'s work (on a worker thread): checked, then applied; 4xx errors
        raised as the API's error classes, the old weights serving on."""
        from server.engine.plan import WeightUpdate
        from server.http.errors import ConflictError, InputValidationError, UnavailableError

        source, version, mode = _parse(body)
        if self.router is None:
            raise UnavailableError("not serving yet", headers={"Retry-After": "1"})
        if not self.lock.acquire(blocking=False):
            raise ConflictError("another weight update is running")
        if self.sharing is not None and self.sharing.busy:
            self.lock.release()
            raise ConflictError("a transfer of the weights to a peer group is running (server.peer)")
        try:
            began = time.perf_counter()
            self.running = {"source": source, "version": version, "mode": mode, "phase": "checking",
                            "started": time.time()}
            try:
                self._check(source)
            except CheckpointError as e:
                self._count("refused")
                raise InputValidationError(f"{source}: {e}", param="source") from None
            self.running["phase"] = "updating"
            try:
                reports = self.router.update_weights(WeightUpdate(source=source, version=version), mode,
                                                     failed=self._group_failed)
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

    def _check(self, source: str) -> None:
        from loaders import update_hsdp_model

        if not os.path.isdir(source):
            raise CheckpointError("no such directory (a local checkpoint directory, as --model takes)", path=source)
        update_hsdp_model(self.loaded, source, dtype=self.cfg.torch_dtype or "auto", quantize=_quantize(self.cfg),
                          check_only=True)

    def _group_failed(self) -> bool:
        state = getattr(self, "state", None)
        return state is not None and state.phase == "failed"

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.weight_updates.labels(outcome).inc()


def _parse(body) -> tuple[str, str, str]:
    from server.http.errors import InputValidationError

    if not isinstance(body, dict):
        raise InputValidationError("the body must be a JSON object")
    unknown = set(body) - {"source", "version", "mode"}
    if unknown:
        raise InputValidationError(f"unknown field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    source, version, mode = body.get("source"), body.get("version"), body.get("mode", "wait")
    if not isinstance(source, str) or not source:
        raise InputValidationError("source: a checkpoint directory", param="source")
    if "://" in source:
        raise InputValidationError("source: only a local checkpoint directory is updated from so far; s3:// and Hub "
                                   "ids are not implemented", param="source")
    if version is not None and (not isinstance(version, str) or not 0 < len(version) <= 128):
        raise InputValidationError("version: a label of 1 to 128 characters", param="version")
    if mode not in MODES:
        raise InputValidationError(f"mode: one of {', '.join(MODES)}", param="mode")
    return source, version or os.path.basename(source.rstrip("/")), mode


def _quantize(cfg) -> str | None:
    return None if cfg.quantization == "none" else cfg.quantization


def apply_update(loaded, cfg, residency, update):
    """Every rank, on the update step: its rows of ``update.source`` into its shards, then what was
    built from them refreshed. An UpdateReport; an error before any write is reported (the old
    weights stand); one after raises :class:`PartialUpdateError` (the group must go down)."""
    from loaders import update_hsdp_model
    from server.engine.plan import UpdateReport
    from server.group.memory import release_freed_memory

    began = time.perf_counter()
    try:
        stats = update_hsdp_model(loaded, update.source, dtype=cfg.torch_dtype or "auto", quantize=_quantize(cfg),
                                  load_concurrency=cfg.load_concurrency)
    except PartialUpdateError:
        raise
    except (CheckpointError, OSError, ValueError) as e:
        return UpdateReport(bytes_read=0, seconds=round(time.perf_counter() - began, 3),
                            error=f"{type(e).__name__}: {e}")
    _refresh(loaded.model, residency)
    release_freed_memory()
    return UpdateReport(bytes_read=stats.bytes_read, seconds=round(time.perf_counter() - began, 3))


def _refresh(model, residency) -> None:
    """What was computed from the shards, again: private gathered copies of resident units (a
    collective over the shard group, which updates at the same step in lockstep groups), and
    packed linears' copies. A host's shared resident copy needs nothing: the shards are its rows."""
    from server.engine.linears import repack_linears
    from shard_engine import set_resident_units

    if residency is not None and residency.units and not residency.shared_bytes:
        set_resident_units(model, len(residency.units))
    repack_linears(model)
