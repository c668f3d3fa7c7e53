"""Rank 0's watch over the group while it serves: load progress, the other step groups, failure, drain.

* :func:`load_progress_reporter`: every rank's loader reports ``done,total`` through the group's
  store, which rank 0's ``/ready`` reads.
* :func:`drive_other_groups`: a rank 0 thread per step group it is not in, stepping that group.
* :func:`fail_open_requests`: the group failing answers every open request with an error and
  turns the probes 503 first.
* :func:`watch_local_ranks`: ``/health`` fails the moment a rank of this node exits.
* :func:`install_drain_handler` / :func:`ignore_stop_signals`: SIGTERM/SIGINT drain the group on
  rank 0; the other ranks wait for rank 0's shutdown plan.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from shard_engine.torch_private import default_store

logger = logging.getLogger(__name__)

_FAILURE_LINGER_S = 2.0


LOAD_PROGRESS_EVERY_S = 0.25


def load_progress_reporter(state, rank: int):
    """The loader's progress callback: every rank writes its ``done,total`` into the group's store
    (at most every quarter second, and its last) for rank 0's /ready; rank 0 keeps its own too."""
    from server.http.state import LOAD_PROGRESS_KEY

    try:
        store = default_store()
    except Exception:  # noqa: BLE001 - progress is a nicety: without a store, rank 0's alone
        store = None
    if state is not None:
        state.load_store = store
    last = [0.0]

    def report(done: int, total: int) -> None:
        if state is not None:
            state.set_load_progress(done, total)
        now = time.monotonic()
        if store is not None and (now - last[0] >= LOAD_PROGRESS_EVERY_S or done >= total):
            last[0] = now
            try:
                store.set(f"{LOAD_PROGRESS_KEY}{rank}", f"{done},{total}")
            except Exception:  # noqa: BLE001
                pass

    return report


def drive_other_groups(state, router, channels, cfg) -> list[threading.Thread]:
    """Rank 0: a thread per step group it is not in (a replica, or a rank stepping alone),
    stepping that group (server.group.control). A failure there (a rank of the group gone, a step over
    the timeout) fails the whole group of ranks, as one on rank 0's own does: every open request
    answered, rank 0 out, non-zero."""
    from server.group.control import run_engine_loop
    from server.group.watchdog import StepWatchdog
    from shard_engine import remove_owned_now

    def drive(index: int) -> None:
        watchdog = StepWatchdog(cfg.step_timeout_s, on_timeout=lambda why: fail_open_requests(state, router, why))
        watchdog.start()
        try:
            run_engine_loop(None, channels[index], router.schedulers[index], watchdog)
        except BaseException as e:  # noqa: BLE001 - the group is broken: down, fast and loudly
            ranks = ",".join(map(str, router.replicas[index]))
            fail_open_requests(state, router, f"ranks {ranks}: {type(e).__name__}: {e}")
            logging.shutdown()
            remove_owned_now()
            os._exit(1)
        finally:
            watchdog.stop()

    threads = [threading.Thread(target=drive, args=(i,), name=f"hsdp-steps-{i}", daemon=True)
               for i in range(1, len(router.schedulers))]
    for thread in threads:
        thread.start()
    return threads


def fail_open_requests(state, scheduler, reason: str) -> None:
    """Rank 0, the group failing: answer every open request with an error and let probes see it."""
    if state is None:
        return
    state.set_phase("failed", reason)
    logger.error("the model group failed: %s", reason)
    if scheduler is not None:
        scheduler.fail_all(f"the model group failed: {reason}")
    time.sleep(_FAILURE_LINGER_S)  # the error responses flush; /health answers 503 meanwhile


LIVENESS_POLL_S = 0.2


def dead_local_rank(scheduler) -> str | None:
    """Why the group is broken, if a rank of this node has exited (its pid, as the rank reported
    it, is gone), else None. Ranks of a node are numbered from rank 0's up, as torchrun does."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for rank, stats in enumerate(scheduler.rank_stats[:local]):
        if stats is None:
            continue
        try:
            os.kill(stats.pid, 0)
        except ProcessLookupError:
            return f"rank {rank} (pid {stats.pid}) exited"
        except PermissionError:
            pass
    return None


def watch_local_ranks(state, scheduler) -> None:
    """Rank 0: /health turns 503 the moment a rank of this node dies, not when the collective that
    needs it fails or the launcher's SIGTERM comes (seconds later, and a drain looks alive)."""
    def watch() -> None:
        # while serving: once draining, the ranks leave on purpose (a failure then still shows in
        # the collective that needs the dead rank, and in the SIGTERM handler's check)
        while state.phase in ("warming_up", "ready"):
            reason = dead_local_rank(scheduler)
            if reason is not None:
                state.set_phase("failed", reason)
                logger.error("the model group failed: %s", reason)
                return
            time.sleep(LIVENESS_POLL_S)

    threading.Thread(target=watch, name="hsdp-liveness", daemon=True).start()


def install_drain_handler(scheduler, state, timeout_s: float) -> None:
    def drain(signum, _frame) -> None:
        if (reason := dead_local_rank(scheduler)) is not None:  # the launcher stopping a broken group
            state.set_phase("failed", reason)
        logger.warning("%s: draining (in-flight requests finish within %g s, new ones get 503)",
                       signal.Signals(signum).name, timeout_s)
        state.set_phase("draining")
        scheduler.request_shutdown(timeout_s)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)


def ignore_stop_signals() -> None:
    # The launcher (or torchrun) passes SIGTERM/SIGINT to every rank; only rank 0 decides when the
    # group stops, and its shutdown plan ends every rank's loop. A rank whose peers are gone still
    # ends: its next collective fails, and the launcher's SIGKILL follows its shutdown timeout.
    def note(signum, _frame) -> None:
        logger.info("%s: waiting for rank 0 to end the group", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)

