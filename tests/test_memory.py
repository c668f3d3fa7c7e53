"""Rank 0 gives back what its HTTP side left in the allocator once the group is quiet
(``server.group.memory.QuietReclaimer``); no server, one process."""

import gc
import threading

import pytest

from server.group.memory import QuietReclaimer, process_memory

pytestmark = pytest.mark.skipif(not process_memory()["anon"], reason="needs /proc/self/smaps_rollup (Linux)")

BIG = 96 << 20


def _garbage_cycle() -> None:
    """A reference cycle holding BIG bytes, unreachable: only a full collection frees it."""
    a, b = [bytearray(BIG)], []
    a.append(b)
    b.append(a)


def test_a_pass_collects_cycles_and_trims():
    gc.disable()  # the cycle must still be there when the pass comes
    try:
        _garbage_cycle()
        shrank = QuietReclaimer(lambda: True).pass_now()
    finally:
        gc.enable()
    assert shrank >= BIG * 3 // 4, shrank


def test_the_thread_reclaims_only_while_quiet():
    quiet = threading.Event()
    reclaimer = QuietReclaimer(quiet.is_set, every_s=0.05, grow_bytes=BIG // 2)
    gc.disable()
    try:
        reclaimer.start()
        _garbage_cycle()
        for _ in range(10):  # busy: the garbage stays
            threading.Event().wait(0.05)
        assert reclaimer.passes == 0
        quiet.set()
        for _ in range(200):
            if reclaimer.passes:
                break
            threading.Event().wait(0.05)
        assert reclaimer.passes == 1
    finally:
        reclaimer.stop()
        gc.enable()
