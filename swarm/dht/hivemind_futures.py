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

Those shared bytes live in shared memory that torch hands out through a helper process, torch_shm_manager, which it
starts at the first use, in the caller's process group. A terminal's Ctrl-C reaches the whole group: the manager
dies, and the program's next future waits for it forever (seen: a peer stopped by Ctrl-C during its start hung
there). `start_memory_manager_deaf_to_terminal` starts it with the terminal's signals ignored, which it keeps.

hivemind's other family locks (`MPFuture._update_lock`, around each write of a result to the origin process's pipe,
`MPFuture._initialization_lock` and `_AsyncContextWrapper.EXECUTOR_LOCK`) are shared on purpose within one
program's family. A process forked from a server that only imported hivemind (swarm/local/forkserver.py) is a new
program: `start_a_new_family` gives it locks of its own, or a sibling killed while writing a result would block
every later peer of that server.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import torch
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture, SharedBytes

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


def start_a_new_family() -> None:
    """For a process forked from a server of processes rather than from its own program: hivemind's family locks of
    its own (shared with the processes it forks in turn, as in any program), and no future of the server's."""
    MPFuture._active_pid = None
    MPFuture._initialization_lock = multiprocessing.Lock()
    MPFuture._update_lock = multiprocessing.Lock()
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()
    _fresh_lock()


def start_memory_manager_deaf_to_terminal() -> None:
    """Start torch's shared-memory manager now, with SIGINT and SIGHUP ignored (dispositions that an exec keeps), so
    that a terminal's Ctrl-C to the program's group does not end it. For programs: call it from the main thread,
    before the first future."""
    if threading.current_thread() is not threading.main_thread():
        return
    ignored = (signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    try:
        torch.zeros(1).share_memory_()  # under hivemind's file_system strategy: starts the manager
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
