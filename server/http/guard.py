"""ASGI middleware in front of every route: request metrics, Host allowlist, API-key check, body
limits.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streamed responses pass through
untouched and their full duration is measured. In order, a request is refused with its API's
error body when its Host is not allowed (403: DNS rebinding), it lacks the key (401), its body
is larger than ``--max-body-bytes`` (413), has not arrived within ``--body-timeout`` (408), or
would take the bodies held in memory past ``--max-buffered-body-bytes`` (503). Connection-level
deadlines (headers, slow readers) are ``server.http.connections``'.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from server.http.errors import (APIError, AuthenticationError, BodyTooLargeError, ForbiddenError, RequestTimeoutError,
                           UnavailableError, error_body, error_status)
from server.http.metrics import ServerMetrics

PROBE_PATHS = frozenset({"/health", "/ready"})
"""Open to any method without a key: the probes (``/metrics`` too with ``--open-metrics``)."""
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1", "localhost"})


def is_open(method: str, path: str, open_metrics: bool = False) -> bool:
    """What needs no key: the probes, ``/metrics`` where opened, and GET of the page (``/``) and its
    assets (``/ui/...``); ``POST /`` (TGI's compat route) is guarded like every other route."""
    return (path in PROBE_PATHS or (open_metrics and path == "/metrics")
            or (method in ("GET", "HEAD") and (path == "/" or path.startswith("/ui/"))))


def allowed_hosts_for(listen_host: str, allowed: str | None) -> frozenset[str] | None:
    """The Host names accepted (lower case, without port), or None for any: ``--allowed-hosts``
    where given, else the loopback names when listening on loopback."""
    if allowed:
        names = {h.strip().lower() for h in allowed.split(",") if h.strip()}
        return None if "*" in names else frozenset(_without_port(h) for h in names)
    return LOOPBACK_HOSTS if listen_host in LOOPBACK_ADDRESSES or listen_host.startswith("127.") else None


def _without_port(host: str) -> str:
    if host.startswith("["):  # [::1]:8000
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class GuardMiddleware:
    def __init__(self, app, *, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int,
                 max_buffered_body_bytes: int, body_timeout_s: float, allowed_hosts: frozenset[str] | None,
                 open_metrics: bool):
        self.app = app
        self.metrics = metrics
        self.expected = f"Bearer {api_key}".encode("ascii") if api_key else None  # printable ASCII (server.config)
        self.max_body_bytes = max_body_bytes
        self.max_buffered = max_buffered_body_bytes
        self.buffered = 0  # body bytes held now, over every connection (one event loop: no lock)
        self.body_timeout_s = body_timeout_s
        self.allowed_hosts = allowed_hosts
        self.open_metrics = open_metrics

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

        held = [0]
        try:
            error = self._check_host(scope) or self._check_key(scope, path)
            if error is None:
                receive, error = await self._read_body(scope, receive, held)
            if error is not None:
                await self._send_error(send_counted, error, path)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            self._release(held)
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.request_duration.labels(endpoint).observe(time.perf_counter() - start)

    def _check_host(self, scope) -> APIError | None:
        if self.allowed_hosts is None:
            return None
        host = _header(scope, b"host")
        if host is None:  # HTTP/1.0 without Host: no browser sends that
            return None
        name = _without_port(host.decode("latin-1").strip().lower())
        if name in self.allowed_hosts:
            return None
        return ForbiddenError(f"Host {name!r} is not allowed: this server answers only "
                              f"{', '.join(sorted(self.allowed_hosts))} (--allowed-hosts)")

    def _check_key(self, scope, path: str) -> APIError | None:
        if self.expected is None or is_open(scope.get("method", "GET"), path, self.open_metrics):
            return None
        given = _header(scope, b"authorization") or b""
        if hmac.compare_digest(given, self.expected):  # bytes as sent: no decoding can fail
            return None
        return AuthenticationError("missing or invalid API key: send 'Authorization: Bearer <key>'")

    async def _read_body(self, scope, receive, held: list[int]):
        """Read the whole body within the limits and the deadline, then replay it to the app."""
        too_large = BodyTooLargeError(f"request body larger than {self.max_body_bytes} bytes (--max-body-bytes)",
                                      param="--max-body-bytes")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return receive, too_large
        if scope.get("method") in ("GET", "HEAD"):
            return receive, None
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.metrics.connections_timed_out.labels("body").inc()
                return receive, RequestTimeoutError(f"the request body did not arrive within "
                                                    f"{self.body_timeout_s:g} s (--body-timeout)")
            if message["type"] == "http.disconnect":
                chunks = None
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return receive, too_large
            if self.buffered + len(body) > self.max_buffered:
                return receive, UnavailableError(
                    "too many request bodies are being received at once; retry later (--max-buffered-body-bytes)",
                    headers={"Retry-After": "1"})
            self._hold(held, len(body))
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = [False]

        async def replay():
            if not replayed[0] and chunks is not None:
                replayed[0] = True
                body = b"".join(chunks)
                chunks.clear()
                self._release(held)  # the app holds the body from here
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as Starlette expects

        return replay, None

    def _hold(self, held: list[int], n: int) -> None:
        held[0] += n
        self.buffered += n
        self.metrics.buffered_body_bytes.set(self.buffered)

    def _release(self, held: list[int]) -> None:
        if held[0]:
            self.buffered -= held[0]
            held[0] = 0
            self.metrics.buffered_body_bytes.set(self.buffered)

    async def _send_error(self, send, error: APIError, path: str) -> None:
        body = json.dumps(error_body(error, path)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
        if isinstance(error, RequestTimeoutError):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error_status(error, path), "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value
    return None
