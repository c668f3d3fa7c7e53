"""The JSON response class of every route: standard JSON even where a float is not finite.

Starlette's ``JSONResponse`` refuses NaN and infinities (``allow_nan=False``) only after a route
has done all its work, which turns a model's NaN log-probability into a 500. Here such a float
is ``null``, as pydantic writes it in the streamed frames (``model_dump_json``); the common case
costs nothing more.
"""

from __future__ import annotations

import json
import math

from fastapi.responses import JSONResponse


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class FiniteJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # a NaN or an infinity somewhere: null
            return json.dumps(_finite(content), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


SSE_DONE = "data: [DONE]\n\n"
"""The last frame of an OpenAI stream."""


def sse(model) -> str:
    """One server-sent event of a pydantic model (a NaN log-probability is null, as pydantic writes it)."""
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(exc, path: str) -> str:
    """The frame of an error after a stream has begun (its status line is sent): the error's body
    in the endpoint's style (``server.http.errors``), the same in both APIs' streams."""
    from server.http.errors import error_body

    return f"data: {json.dumps(error_body(exc, path))}\n\n"
