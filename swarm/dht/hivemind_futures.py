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

Those shared bytes live in torch's shared memory. hivemind sets torch's "file_system" sharing strategy, under which
a helper process, torch_shm_manager, hands the memory out: one more process per peer, started in the caller's
process group (a terminal's Ctrl-C killed it, and the program's next future waited for it forever), which at the
peer's exit printed `terminate called after throwing an instance of 'std::system_error'` into the volunteer's
terminal in about a third of the stops. `install` sets the "file_descriptor" strategy instead (torch's default on
Linux: the memory is a file descriptor, inherited by forked children, and no helper process), and raises this
process's soft limit of open files to its hard limit (one descriptor per shared tensor: the parameters and
optimizer state an averager shares); HIVEMIND_MEMORY_SHARING_STRATEGY=file_system, set by the user, keeps hivemind's
choice, and `start_memory_manager_deaf_to_terminal` then starts its manager with the terminal's signals ignored.

hivemind's other family locks (`MPFuture._update_lock`, around each write of a result to the origin process's pipe,
`MPFuture._initialization_lock` and `_AsyncContextWrapper.EXECUTOR_LOCK`) are shared on purpose within one
program's family. A process forked from a server that only imported hivemind (swarm/local/forkserver.py) is a new
program: `start_a_new_family` gives it locks of its own, or a sibling killed while writing a result would block
every later peer of that server.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
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
    strategy = os.environ.get(SHARING_STRATEGY_ENV, "file_descriptor")
    if strategy in torch.multiprocessing.get_all_sharing_strategies():
        torch.multiprocessing.set_sharing_strategy(strategy)
    if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
        _raise_open_file_limit()


SHARING_STRATEGY_ENV = "HIVEMIND_MEMORY_SHARING_STRATEGY"  # hivemind's own name for it


def _raise_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass  # as it was: enough for a small model's tensors


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
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        return  # no manager: the memory is a file descriptor
    ignored = (signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    try:
        torch.zeros(1).share_memory_()  # under hivemind's file_system strategy: starts the manager
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
