"""hivemind's futures, made safe for processes that are killed.

Every `MPFuture` (each DHT call, each averager step) takes a shared byte from `SharedBytes.next()`, which holds
`SharedBytes._lock` while it allocates. That lock is a `multiprocessing.Lock`: one semaphore shared by the process
that imported hivemind and every process forked from it (DHT nodes, averagers). A child killed while it holds the
lock (a DHT process terminated "the hard way" at shutdown, an averager stopped by SIGKILL) leaves the semaphore
taken for good, and the next future of any process in the family blocks forever. Seen here: a pytest worker
whose later `DHT(...)` calls hung for 300 s on `Lock(owner=SomeOtherProcess)`.

The state the lock guards (`_pid`, `_buffer`, `_index`) is per process anyway (fork copies it, and `next()`
starts a new buffer when the pid changes), so it only needs a lock per process: a thread lock, made afresh in each
forked child so that a fork taken while another thread held it cannot start locked either.
"""

from __future__ import annotations

import os
import threading

from hivemind.utils.mpfuture import SharedBytes

_installed = False


def _fresh_lock() -> None:
    SharedBytes._lock = threading.Lock()


def install() -> None:
    """Give SharedBytes a lock of this process only, and each forked child one of its own (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    _fresh_lock()
    os.register_at_fork(after_in_child=_fresh_lock)
