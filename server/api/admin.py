"""Operator routes under ``/admin``, behind the API key like every route but the probes.

``POST /admin/weights`` ``{"source": DIR | s3://... | org/name, "revision"?: Hub revision, "version"?:
label, "mode"?: "wait" | "abort" | "keep"}``: new weights into the running group from a checkpoint
directory, an object-storage prefix or a Hugging Face repo (``server.weights``); 422 naming
the tensor or field where the checkpoint or the request is wrong (the old weights serve on),
409 while another update or a peer transfer runs. ``GET /admin/weights``: the version served,
its source, when, the last update, one in progress.

SGLang's routes where their meaning is the same: ``POST /update_weights_from_disk``
(``model_path``, ``weight_version``, ``abort_all_requests``; ``{"success", "message",
"num_paused_requests"}``, 400 with ``success: false`` on a failure, as SGLang answers) and
``GET /get_model_info``.

vLLM's pause routes: ``POST /pause?mode=abort|wait|keep&clear_cache=true|false`` (vLLM's
defaults: abort, true) answers once the pause has taken (running sequences ended, finished or
frozen; 409 where a resume came first; a pause while paused changes nothing); new requests queue
until ``POST /resume``; ``GET /is_paused``. An aborted sequence ends
with an error event, not vLLM's partial output with ``finish_reason: abort``.

``POST /admin/peer-load``: a group starting with ``--load-from-peer`` asks this one for its
weights (``server.peer``); 403 unless this server runs with ``--share-weights``, 409 naming the
difference where the peer loads another checkpoint or loads it otherwise, 503 before this group
serves or while another transfer runs.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from server.api.generation import off_loop, require_ready
from server.http.errors import APIError, ConflictError, ForbiddenError, InputValidationError, UnavailableError
from server.http.state import ServerState, server_state
from server.peer import ROUTE

router = APIRouter()


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise InputValidationError(f"malformed JSON: {e}") from None


@router.post("/admin/weights")
async def update_weights(request: Request, state: ServerState = Depends(server_state)) -> dict:
    require_ready(state)
    return await off_loop(state.weights_admin.update, await _json(request))


@router.get("/admin/weights")
async def weights(state: ServerState = Depends(server_state)) -> dict:
    require_ready(state)
    return state.weights_admin.describe()


@router.post(ROUTE)
async def peer_load(request: Request, state: ServerState = Depends(server_state)) -> dict:
    sharing = state.weight_sharing
    if sharing is None:
        raise ForbiddenError("this server does not share its weights (start it with --share-weights)")
    require_ready(state)
    return await off_loop(sharing.offer, await _json(request))  # (the transfer's store is opened there)


SGLANG_UPDATE_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                        "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache",
                        "manifest"}
"""What SGLang's UpdateWeightFromDiskReqInput declares; a field outside it is refused."""


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, state: ServerState = Depends(server_state)) -> JSONResponse:
    """SGLang's route: ``POST /admin/weights`` with ``model_path`` as the source, ``weight_version``
    as the version and ``abort_all_requests`` for mode abort (else wait). The prefix cache is always
    flushed (``flush_cache: false`` is accepted and flushed anyway: what it holds came from the old
    weights); ``is_async`` and ``keep_pause`` are refused."""
    require_ready(state)
    body = await _json(request)
    try:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise InputValidationError("model_path: a checkpoint directory", param="model_path")
        unknown = set(body) - SGLANG_UPDATE_FIELDS
        if unknown:
            raise InputValidationError(f"unknown field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
        for name in ("is_async", "keep_pause"):
            if body.get(name):
                raise InputValidationError(f"{name}: not implemented here", param=name)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise InputValidationError("load_format: safetensors checkpoints only", param="load_format")
        ours = {"source": body["model_path"], "mode": "abort" if body.get("abort_all_requests") else "wait"}
        if body.get("weight_version") is not None:
            ours["version"] = body["weight_version"]
        outcome = await off_loop(state.weights_admin.update, ours)
    except APIError as e:
        return JSONResponse({"success": False, "message": e.message, "num_paused_requests": 0},
                            status_code=400 if e.status_code < 500 else e.status_code)
    return JSONResponse({"success": True, "message": f"Succeeded to update model weights ({outcome['seconds']} s).",
                         "num_paused_requests": 0})


PAUSE_MODES = ("abort", "wait", "keep")


@router.post("/pause")
async def pause(state: ServerState = Depends(server_state), mode: str = "abort", clear_cache: str = "true") -> dict:
    """vLLM's route: pause generation (``Scheduler.pause``); answers once every step group has settled."""
    require_ready(state)
    if mode not in PAUSE_MODES:
        raise InputValidationError(f"mode: one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
    if clear_cache.lower() not in ("true", "false", "1", "0"):
        raise InputValidationError(f"clear_cache: true or false, got {clear_cache!r}", param="clear_cache")
    failed = lambda: state.phase == "failed"  # noqa: E731
    try:
        paused = await off_loop(state.scheduler.pause, mode, clear_cache.lower() in ("true", "1"), failed)
    except RuntimeError as e:
        raise UnavailableError(str(e)) from None
    if not paused:
        raise ConflictError("resumed (POST /resume) before the pause took")
    return {"status": "paused", "mode": mode}


@router.post("/resume")
async def resume(state: ServerState = Depends(server_state)) -> dict:
    """vLLM's route: queued and kept requests go on."""
    require_ready(state)
    state.scheduler.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(state: ServerState = Depends(server_state)) -> dict:
    require_ready(state)
    return {"is_paused": state.scheduler.paused_by_request}


@router.get("/get_model_info")
async def get_model_info(state: ServerState = Depends(server_state)) -> dict:
    """SGLang's route: the served weights' path and version."""
    admin = state.weights_admin
    return {"model_path": admin.source if admin is not None else state.model_path, "tokenizer_path": state.model_path,
            "is_generation": True, "weight_version": admin.version if admin is not None else None,
            "preferred_sampling_params": None}
