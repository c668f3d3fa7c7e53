"""Rank 0's HTTP app: probes, info and metrics here; the APIs in ``server.api`` (TGI's, OpenAI's,
tokenization). Errors leave through ``server.http.errors``, in each API's style.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server import __version__
from server.http.errors import register_error_handlers
from server.http.guard import GuardMiddleware, allowed_hosts_for
from server.http.responses import FiniteJSONResponse
from server.api.admin import router as admin_router
from server.api.openai.router import router as openai_router
from server.api.tgi.router import router as tgi_router
from server.api.tokenize import router as tokenize_router
from server.http.state import ServerState
from server.http.ui import build_ui_router


def build_app(state: ServerState, cfg=None) -> FastAPI:
    """The app; ``cfg`` (``server.config.ServeConfig``, default: the defaults) gives the guard's limits."""
    from server.config import ServeConfig

    cfg = cfg or ServeConfig()
    app = FastAPI(title="hsdp-serve", version=__version__, default_response_class=FiniteJSONResponse)
    register_error_handlers(app)
    app.add_middleware(GuardMiddleware, metrics=state.metrics, api_key=state.api_key, max_body_bytes=cfg.max_body_bytes,
                       max_buffered_body_bytes=cfg.max_buffered_body_bytes, body_timeout_s=cfg.body_timeout_s,
                       allowed_hosts=allowed_hosts_for(cfg.host, cfg.allowed_hosts), open_metrics=cfg.open_metrics)
    app.state.hsdp = state  # the routes' ServerState (server.http.state.server_state)
    app.include_router(tgi_router)
    app.include_router(openai_router)
    app.include_router(tokenize_router)
    app.include_router(admin_router)
    app.include_router(build_ui_router())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 503 once the group has failed, or while a step group has had work and made no
        progress for ``--liveness-timeout`` (a stuck step: an orchestrator should restart the group)."""
        ok = state.phase != "failed"
        body = {"status": "ok" if ok else "failed", "phase": state.phase}
        if state.failure:
            body["error"] = state.failure
        stalled = state.stalled_for()
        if ok and stalled > state.liveness_timeout_s:
            ok = False
            body.update(status="stalled", error=f"no step has ended for {stalled:.0f} s while requests wait "
                                                f"(--liveness-timeout {state.liveness_timeout_s:g} s)")
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body: dict = {"status": "ready" if state.ready else "not_ready", "phase": state.phase}
        update, drain = state.weights_admin.readiness() if state.weights_admin is not None else (None, False)
        if update is not None:  # POST /admin/weights in progress (server.weights)
            body["weights_update"] = update
            if drain and state.ready:
                body["status"] = "updating"
                return JSONResponse(body, status_code=503)
        if state.phase == "loading":
            total = state.load_total_bytes
            body["progress"] = {
                "bytes_loaded": state.load_done_bytes,
                "bytes_total": total,
                "fraction": round(state.load_done_bytes / total, 4) if total else 0.0,
                "ranks": state.ranks_load_progress(),
            }
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/info")
    async def info() -> dict:
        limits = state.limits
        body = {
            "model_id": state.model_name,
            "served_model_names": state.model_names,
            "model_path": state.model_path,
            "model_source": state.model_source,
            "model_dtype": state.dtype,
            "mesh_shape": {"replicate": state.mesh_shape[0], "shard": state.mesh_shape[1]},
            "world_size": state.world_size,
            "max_input_tokens": limits.max_input_tokens if limits else None,
            "max_total_tokens": limits.max_total_tokens if limits else None,
            "max_concurrent_requests": limits.max_concurrent_requests if limits else None,
            "max_queued_requests": limits.max_queued_requests if limits else None,
            "version": __version__,
            "phase": state.phase,
            "residency": state.residency,
            "quantization": state.quantization,
            "weights": dict(state.weights or {}, sharing=state.weight_sharing.describe()
                            if state.weight_sharing is not None else {"enabled": False},
                            served=state.weights_admin.describe() if state.weights_admin is not None else None),
            "images": state.media.describe() if state.images is not None else None,  # an image-text model's limits
        }
        scheduler = state.scheduler
        if scheduler is not None:
            body["kv_cache"] = {
                "block_size": scheduler.block_size, "prefix_caching": scheduler.pools[0].prefix_caching,
                "max_batch_prefill_tokens": scheduler.max_prefill_tokens, "preemptions": scheduler.preemptions,
                **(state.kv_layout or {}),
            }
            ranks = []
            for r, s in enumerate(scheduler.rank_stats):
                entry = {"rank": r, "replica": r // state.mesh_shape[1], "step_group": scheduler.replica_of(r)}
                if s is not None:
                    entry.update(pid=s.pid, sequences_started=s.sequences_started, tokens_computed=s.tokens_computed,
                                 forwards=s.forwards, active=s.active)
                pool = scheduler.pools[r]
                entry["kv_blocks"] = {"total": pool.num_blocks, "used": pool.num_used, "cached": pool.num_cached}
                entry["prefix_cache"] = {"queried_tokens": pool.queries, "hit_tokens": pool.hits,
                                         "hit_rate": round(pool.hits / pool.queries, 4) if pool.queries else None}
                entry["memory"] = scheduler.rank_memory[r]
                if state.load_bytes_read is not None:
                    entry["load_bytes_read"] = state.load_bytes_read[r]
                ranks.append(entry)
            body["ranks"] = ranks
        return body

    return app
