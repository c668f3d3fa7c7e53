"""Rank 0's HTTP listener: uvicorn on a thread of its own, with the connection deadlines and cap of
:mod:`server.http.connections`."""

from __future__ import annotations

import logging
import threading
import time

from server.config import ServeConfig

logger = logging.getLogger(__name__)

_HTTP_START_TIMEOUT_S = 30.0


def start_http_server(app, cfg: ServeConfig, metrics=None):
    """Run uvicorn on a daemon thread, with the connection timeouts and cap of ``cfg``
    (``server.http.connections``); returns once it listens, raises if it cannot."""
    import uvicorn

    from server.http.connections import guarded_protocol

    host, port = cfg.host, cfg.port
    protocol = guarded_protocol(header_timeout_s=cfg.header_timeout_s, slow_reader_timeout_s=cfg.slow_reader_timeout_s,
                                metrics=metrics)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, http=protocol,
        timeout_keep_alive=cfg.keep_alive_timeout_s, limit_concurrency=cfg.max_connections,
        # the listen backlog: connections the kernel queues before accept (uvicorn's default, 2048)
        backlog=2048))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + _HTTP_START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"cannot listen on {host}:{port} (in use, or not an address of this host)")
        time.sleep(0.05)
    logger.info("listening on http://%s:%d", host, port)
    return server

