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
- **slow reader**: a response whose client has taken none of its bytes for
  ``slow_reader_timeout_s`` while some wait for it is cut: the transport is aborted (``close``
  would wait for the buffer to drain, which never happens) and the request is marked
  disconnected, so its route sees ``http.disconnect`` and cancels its sequences. "Taken" is the
  kernel's count of bytes the peer acknowledged (``TCP_INFO``'s ``tcpi_bytes_acked``, Linux) and
  "waiting" its send queue (``SIOCOUTQ``) plus the transport's buffer: a stream that produces
  slowly (a busy server: a few KB a second) fills the kernel's send buffer, which grows to
  hundreds of KB, for minutes before the transport's own buffer grows at all, and a client that
  reads nothing was held for the whole 300 s of a soak's slow readers that way. Where the kernel
  says nothing (not Linux, not TCP), the transport's buffer not shrinking is the sign.

Probes (``GET /health``, ``GET /ready``) are answered past the connection cap: a flood of idle
sockets must not make an orchestrator restart a healthy group. The body deadline lives in ``server.http.guard`` (it reads bodies). This module knows uvicorn's h11
protocol from the inside (``cycle``, ``transport``, ``on_response_complete``, ``timeout_keep_alive``): it is pinned to the
uvicorn versions ``pyproject.toml`` allows and tested with real sockets (tests/test_hardening.py).
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

TICK_S = 0.5
"""How often a connection's deadlines are checked: a connection is closed at most this late."""
PROBES = (b"GET /health ", b"GET /health?", b"GET /ready ", b"GET /ready?", b"HEAD /health ", b"HEAD /ready ")
"""Request lines answered whatever the connection cap says."""

_TIMEOUT_BODY = json.dumps({"error": "request headers not received in time", "error_type": "timeout"}).encode()
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)
_LINGER_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on with a zero timeout: close() resets the connection and drops the send queue."""
_TCP_INFO_LEN = 128
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
"""``struct tcp_info``: ``tcpi_bytes_acked`` (u64) at byte 120 (Linux 4.1 on; the layout only grows)."""


def kernel_send_state(sock) -> tuple[int, int] | None:
    """(bytes in the kernel's send queue, not yet acknowledged by the peer; bytes the peer has
    acknowledged so far) of a TCP socket, or None where the kernel does not say (not Linux, not
    TCP, a closed socket)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        if len(info) < _BYTES_ACKED_AT + _BYTES_ACKED.size:
            return None
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, AttributeError, ValueError):
        return None
    return queued, _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0]


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
            self._stalled_since: float | None = None  # the client has taken nothing since then
            self._buffered = 0
            self._acked = 0  # bytes the peer had acknowledged at the last check (the kernel's count)
            sock = transport.get_extra_info("socket")
            self._kernel = sock if sock is not None and kernel_send_state(sock) is not None else None
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
            responding = self.cycle is not None and not self.cycle.response_complete
            state = kernel_send_state(self._kernel) if self._kernel is not None and responding else None
            if state is not None:  # the kernel's word: what waits in its queue, what the peer took
                queued, acked = state
                waiting, took = buffered + queued, acked > self._acked
                self._acked = acked
            else:
                waiting, took = buffered, buffered < self._buffered
            if waiting == 0 or took:
                self._stalled_since = None if waiting == 0 else now
            elif self._stalled_since is None:
                self._stalled_since = now
            self._buffered = buffered
            if self._stalled_since is not None and now - self._stalled_since > slow_reader_timeout_s:
                self._count("slow_reader")
                # a reset, not a FIN queued behind bytes the client will never take: the kernel drops
                # its send queue at once (else the orphaned socket holds it for minutes), the client
                # learns at once. abort, not close (which waits for the buffer to drain):
                # connection_lost follows, which marks the request disconnected and wakes a send()
                # waiting to write
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                    except OSError:
                        pass
                self.transport.abort()
                return
            self._tick = self.loop.call_later(TICK_S, self._check)

        @staticmethod
        def _count(deadline: str) -> None:
            if metrics is not None:
                metrics.connections_timed_out.labels(deadline).inc()

    return GuardedH11Protocol
