"""hivemind's futures after a forked child was killed while allocating one (swarm/dht/hivemind_futures.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

from hivemind.utils.mpfuture import MPFuture, SharedBytes

import swarm  # noqa: F401 (installs the fix, as any use of the library does)


def _hold_the_lock_forever(ready):
    SharedBytes._lock.acquire()
    ready.set()
    threading.Event().wait()


def test_a_child_killed_inside_shared_bytes_does_not_block_the_next_future():
    """With hivemind's process-shared lock, the future below waits forever (a pytest worker once hung 300 s)."""
    context = mp.get_context("fork")
    ready = context.Event()
    child = context.Process(target=_hold_the_lock_forever, args=(ready,), daemon=True)
    child.start()
    try:
        assert ready.wait(30), "the child never took the lock"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    made: list[MPFuture] = []
    maker = threading.Thread(target=lambda: made.append(MPFuture()), daemon=True)
    maker.start()
    maker.join(30)
    assert made, "a new future blocked on the lock the killed child held"
