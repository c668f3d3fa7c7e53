"""The step watchdog: a step that outlasts ``--step-timeout`` takes the whole group down.

A stuck collective (a rank that stopped answering, a hung device) would otherwise hold every
rank until the process-group timeout. Each rank watches its own steps; the first to see one
overrun dumps its Python stacks to the log and exits, and the launcher (or torchrun) then
stops the others, whose own watchdogs fire too if they are stuck as well.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)
STEP_TIMEOUT_EXIT_CODE = 3


class StepWatchdog(threading.Thread):
    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None] | None = None):
        super().__init__(name="step-watchdog", daemon=True)
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._started_at: float | None = None
        # Not ``_stop``: threading.Thread has a method of that name, called by join() and is_alive().
        self._halted = threading.Event()

    def step_started(self) -> None:
        self._started_at = time.monotonic()

    def step_finished(self) -> None:
        self._started_at = None

    def stop(self) -> None:
        self._halted.set()

    def run(self) -> None:
        interval = min(1.0, self.timeout_s / 4)
        while not self._halted.wait(interval):
            started = self._started_at
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        reason = f"a step ran longer than the step timeout ({self.timeout_s:g} s)"
        logger.error("%s: dumping every thread's stack, then exiting", reason)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.on_timeout is not None:
            try:
                self.on_timeout(reason)
            except Exception:  # noqa: BLE001 - exiting regardless
                logger.exception("while failing open requests")
        sys.stderr.flush()
        from shard_engine import remove_owned_now

        remove_owned_now()  # os._exit skips atexit: this rank's /dev/shm directories go now
        os._exit(STEP_TIMEOUT_EXIT_CODE)
