"""What rank 0's HTTP side knows about the group: phase, load progress, limits, the scheduler."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastapi import Request

PHASES = ("loading", "compiling", "warming_up", "ready", "draining", "failed")
LOAD_PROGRESS_KEY = "hsdp/load-progress/"
"""Each rank's ``done,total`` checkpoint bytes while loading, in the group's store."""


@dataclass(kw_only=True)
class Limits:
    """What one request may ask for (``server.config``'s admission and limits options, resolved)."""

    max_input_tokens: int
    max_total_tokens: int
    max_concurrent_requests: int
    max_queued_requests: int
    max_sequences_per_request: int = 64
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 256
    max_top_logprobs: int = 20
    max_tokenize_tokens: int = 16384


@dataclass
class ServerState:
    model_names: list[str]
    """The names clients may give as ``model``; the first is the one responses carry. (More
    than one leaves room for adapters served beside the base model.)"""
    model_path: str
    model_source: str  # directory, hub, default or demo
    dtype: str
    mesh_shape: tuple[int, int]
    world_size: int
    limits: Limits | None = None
    phase: str = "loading"
    failure: str | None = None
    load_done_bytes: int = 0
    load_total_bytes: int = 0
    scheduler: object | None = None
    tokenizer: object | None = None
    vocab_size: int | None = None  # token ids a request may give: the tokenizer's that the embedding has rows for
    metrics: object | None = None
    api_key: str | None = None
    residency: dict | None = None  # what --resident-units and --prefetch-depth did, per rank
    load_bytes_read: list[int] | None = None  # checkpoint bytes each rank read at startup
    quantization: dict | None = None  # a quantized checkpoint's method, formats and bytes per rank (/info)
    kv_layout: dict | None = None  # what one token of KV cache holds and costs (/info kv_cache)
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's, for OpenAI requests
    special_ids: frozenset = frozenset()  # the tokenizer's special tokens (TGI's `special`)
    chat: object | None = None  # server.api.openai.chat.ChatRenderer: chat template and tool-call format
    images: object | None = None  # server.api.media.ImagePrompts: an image-text model's processor, else None
    media: object | None = None  # server.api.media.MediaPolicy: where images may come from, how large
    liveness_timeout_s: float = 60.0  # --liveness-timeout: /health fails past it (stalled_for)
    weight_sharing: object | None = None  # server.peer.WeightSharing with --share-weights
    weights_admin: object | None = None  # server.weights.WeightsAdmin: the served version, POST /admin/weights
    weights: dict | None = None  # where the weights came from (/info): source, fingerprint, peer transfer
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stalled_for(self) -> float:
        """Seconds some step group has had work and made no progress (0 before the scheduler exists)."""
        import time

        return self.scheduler.stalled_for(time.perf_counter()) if self.scheduler is not None else 0.0

    def set_phase(self, phase: str, failure: str | None = None) -> None:
        """Move to ``phase``; ``failed`` is final (a drain that follows a failure does not hide it)."""
        assert phase in PHASES, phase
        with self.lock:
            if self.phase == "failed":
                return
            self.phase = phase
            if failure is not None:
                self.failure = failure

    load_store: object | None = field(default=None, repr=False)  # the group's store: every rank's load progress

    def set_load_progress(self, done: int, total: int) -> None:
        self.load_done_bytes, self.load_total_bytes = done, total

    def ranks_load_progress(self) -> list[dict]:
        """Every rank's load progress as it last reported it (``server.main``: through the store)."""
        out = []
        for rank in range(self.world_size):
            key = f"{LOAD_PROGRESS_KEY}{rank}"
            entry: dict = {"rank": rank, "bytes_loaded": 0, "bytes_total": None, "fraction": 0.0}
            try:
                if self.load_store is not None and self.load_store.check([key]):
                    done, total = (int(x) for x in self.load_store.get(key).decode().split(","))
                    entry.update(bytes_loaded=done, bytes_total=total, fraction=round(done / total, 4) if total else 0.0)
            except Exception:  # noqa: BLE001 - a probe answers whatever happens
                pass
            out.append(entry)
        return out

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def ready(self) -> bool:
        return self.phase == "ready"


def server_state(request: Request) -> ServerState:
    """The routes' dependency (``Depends(server_state)``): the app's :class:`ServerState`, which
    ``server.http.app.build_app`` puts on ``app.state.hsdp``."""
    return request.app.state.hsdp
