"""Rank 0's HTTP connections: uvicorn's h11 protocol with the deadlines a front end enforces.

uvicorn bounds an idle keep-alive connection (``--keep-alive-timeout``) and, with
``limit_concurrency``, the connections served at once (``--max-connections``: beyond it a request
gets 503), but nothing else: a client that never finishes its headers, or never reads its response,
holds a socket, a task and (for a stream) a sequence for ever. :func:`guarded_protocol` makes the
protocol class that adds the two missing deadlines, checked by one timer per connection every
:data:`TICK_S`:

- **headers**: a request's headers must be whole within ``header_timeout_s`` of the connection
  opening, or of the previous response's end plus the keep-alive wait; else the client gets 408
  (where it had sent anything) and the connection is closed.
- **slow reader**: a response whose bytes sit unsent (the kernel's socket buffer full, the
  transport's buffer not shrinking) for ``slow_reader_timeout_s`` is cut: the transport is
  aborted (``close`` would wait for the buffer to drain, which never happens) and the request is
  marked disconnected, so its route sees ``http.disconnect`` and cancels its sequences.

Probes (``GET /health``, ``GET /ready``) are answered past the connection cap: a flood of idle
sockets must not make an orchestrator restart a healthy group. The body deadline lives in ``server.http.guard`` (it reads bodies). This module knows uvicorn's h11
protocol from the inside (``cycle``, ``transport``, ``on_response_complete``, ``timeout_keep_alive``): it is pinned to the
uvicorn versions ``pyproject.toml`` allows and tested with real sockets (tests/test_hardening.py).
"""

from __future__ import annotations

import json
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

TICK_S = 0.5
"""How often a connection's deadlines are checked: a connection is closed at most this late."""
PROBES = (b"GET /health ", b"GET /health?", b"GET /ready ", b"GET /ready?", b"HEAD /health ", b"HEAD /ready ")
"""Request lines answered whatever the connection cap says."""

_TIMEOUT_BODY = json.dumps({"error": "request headers not received in time", "error_type": "timeout"}).encode()
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


def guarded_protocol(*, header_timeout_s: float, slow_reader_timeout_s: float, metrics=None) -> type:
    """The protocol class for ``uvicorn.Config(http=...)``; ``metrics`` (``ServerMetrics``)
    counts the connections each deadline closed."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            now = time.monotonic()
            self._awaiting_since: float | None = now  # waiting for a request's headers since then
            self._received = False  # bytes of the awaited request have arrived
            self._cycle_seen = None
            self._stalled_since: float | None = None  # the write buffer has not shrunk since then
            self._buffered = 0
            self._tick = self.loop.call_later(TICK_S, self._check)

        def connection_lost(self, exc) -> None:
            self._tick.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting_since is not None:
                if not self._received:  # a request's first bytes: its request line
                    # uvicorn's cap (limit_concurrency) is checked as the headers complete: lifted for a probe
                    self.limit_concurrency = None if data.startswith(PROBES) else self.config.limit_concurrency
                self._received = True
            super().data_received(data)
            self._note_new_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's headers are awaited from here
                self._awaiting_since = time.monotonic() + self.timeout_keep_alive
                self._received = False
            self._note_new_request()  # a pipelined request may have started in super()

        def _note_new_request(self) -> None:
            if self.cycle is not None and self.cycle is not self._cycle_seen:
                self._cycle_seen = self.cycle
                self._awaiting_since = None

        def _check(self) -> None:
            if self.transport.is_closing():
                return
            now = time.monotonic()
            if self._awaiting_since is not None and now - self._awaiting_since > header_timeout_s:
                self._count("headers")
                if self._received:
                    self.transport.write(_REQUEST_TIMEOUT)
                self.transport.close()
                return
            buffered = self.transport.get_write_buffer_size()
            if buffered == 0 or buffered < self._buffered:
                self._stalled_since = None if buffered == 0 else now
            elif self._stalled_since is None:
                self._stalled_since = now
            self._buffered = buffered
            if self._stalled_since is not None and now - self._stalled_since > slow_reader_timeout_s:
                self._count("slow_reader")
                # abort, not close (which waits for the buffer to drain): connection_lost follows,
                # which marks the request disconnected and wakes a send() waiting to write
                self.transport.abort()
                return
            self._tick = self.loop.call_later(TICK_S, self._check)

        @staticmethod
        def _count(deadline: str) -> None:
            if metrics is not None:
                metrics.connections_timed_out.labels(deadline).inc()

    return GuardedH11Protocol
