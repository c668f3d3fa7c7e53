"""Operator routes under ``/admin``, behind the API key like every route but the probes.

``POST /admin/peer-load``: a group starting with ``--load-from-peer`` asks this one for its
weights (``server.peer``); 403 unless this server runs with ``--share-weights``, 409 naming the
difference where the peer loads another checkpoint or loads it otherwise, 503 before this group
serves or while another transfer runs.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request

from server.api.generation import off_loop, require_ready
from server.http.errors import ForbiddenError, InputValidationError
from server.http.state import ServerState, server_state
from server.peer import ROUTE

router = APIRouter()


@router.post(ROUTE)
async def peer_load(request: Request, state: ServerState = Depends(server_state)) -> dict:
    sharing = state.weight_sharing
    if sharing is None:
        raise ForbiddenError("this server does not share its weights (start it with --share-weights)")
    require_ready(state)
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise InputValidationError(f"malformed JSON: {e}") from None
    return await off_loop(sharing.offer, body)  # (the transfer's store is opened there)
