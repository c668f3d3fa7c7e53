"""ASGI middleware in front of every route: request metrics, API-key check, body-size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streamed responses pass through
untouched and their full duration is measured.
"""

from __future__ import annotations

import hmac
import time

from server.errors import APIError, AuthenticationError, BodyTooLargeError, error_body, error_status
from server.metrics import ServerMetrics

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Open to any method without a key: the probes and metrics."""


def is_open(method: str, path: str) -> bool:
    """What needs no key: the probes and metrics, and GET of the page (``/``) and its assets
    (``/ui/...``); ``POST /`` (TGI's compat route) is guarded like every other route."""
    return path in OPEN_PATHS or (method in ("GET", "HEAD") and (path == "/" or path.startswith("/ui/")))


class GuardMiddleware:
    def __init__(self, app, *, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = self.metrics.endpoint_label(path)
        start = time.perf_counter()
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._check_key(scope, path)
            if error is None:
                receive, error = await self._limit_body(scope, receive)
            if error is not None:
                await self._send_error(send_counted, error, path)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.request_duration.labels(endpoint).observe(time.perf_counter() - start)

    def _check_key(self, scope, path: str) -> APIError | None:
        if not self.api_key or is_open(scope.get("method", "GET"), path):
            return None
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"authorization", b"").decode("latin-1")
        expected = f"Bearer {self.api_key}"
        if hmac.compare_digest(given.encode("latin-1"), expected.encode("latin-1")):
            return None
        return AuthenticationError("missing or invalid API key: send 'Authorization: Bearer <key>'")

    async def _limit_body(self, scope, receive):
        """Read the whole body up to the limit, then replay it to the app."""
        headers = dict(scope.get("headers") or ())
        too_large = BodyTooLargeError(f"request body larger than {self.max_body_bytes} bytes")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return receive, too_large
        if scope.get("method") in ("GET", "HEAD"):
            return receive, None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                chunks = None
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return receive, too_large
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = [False]

        async def replay():
            if not replayed[0] and chunks is not None:
                replayed[0] = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as Starlette expects

        return replay, None

    async def _send_error(self, send, error: APIError, path: str) -> None:
        import json

        body = json.dumps(error_body(error, path)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": error_status(error, path), "headers": headers})
        await send({"type": "http.response.body", "body": body})
