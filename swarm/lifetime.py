"""Processes that end when the process that started them is gone, however it ended (even by SIGKILL).

A program that starts others (swarm-demo starts peers and a monitor; tests and benchmarks start peers) names itself
in the child's environment (`child_environment`); the child, once started, watches for that parent to go
(`stop_when_parent_is_gone`) and then stops itself as SIGTERM stops it: cleanly, and by force if that hangs.
A peer's DHT process (with its p2pd daemon, in a process group of their own) watches the peer the same way
(`end_group_when_parent_is_gone`), so a peer killed outright leaves nothing running either.

Watching is a thread that compares os.getppid() with the parent's pid once a second: it works on macOS as on Linux
(prctl's parent-death signal is Linux-only and fires when the parent's *thread* ends). Only a child whose parent
asked is watched: a volunteer's `nohup swarm-peer ... &` must outlive the shell that started it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PARENT_ENV = "SWARM_PARENT_PID"  # set by the program that starts a child: its own pid
WATCH_EVERY = 1.0  # seconds between two looks at the parent
FORCE_AFTER = 60.0  # seconds a clean stop may take once the parent is gone, before the child kills itself


def child_environment(environment: dict[str, str] | None = None) -> dict[str, str]:
    """`environment` (default: this process's) for a child that must not outlive this process."""
    return {**(os.environ if environment is None else environment), PARENT_ENV: str(os.getpid())}


def _watch(parent_pid: int, on_gone: Callable[[], None]) -> threading.Thread:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_EVERY)
        on_gone()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def stop_when_parent_is_gone() -> threading.Thread | None:
    """If the program that started this one asked (PARENT_ENV), stop as SIGTERM stops this process once that
    parent is gone (at once if it is gone already); SIGKILL FORCE_AFTER seconds later if still running. Call it
    after the program installed its SIGTERM handling (and, in a peer, after its DHT process forked)."""
    value = os.environ.pop(PARENT_ENV, None)  # not passed on to this program's own children
    if not value:
        return None
    try:
        parent_pid = int(value)
    except ValueError:
        logger.warning(f"ignoring {PARENT_ENV}={value!r}: not a process id")
        return None

    def stop() -> None:
        logger.warning(f"the process that started this one ({parent_pid}) is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(FORCE_AFTER)
        os.kill(os.getpid(), signal.SIGKILL)

    return _watch(parent_pid, stop)


def end_group_when_parent_is_gone() -> threading.Thread:
    """Kill this process's group (this process and the children that share its group) once its parent is gone:
    for a DHT process and its p2pd daemon, whose peer stops them itself when it can."""
    return _watch(os.getppid(), lambda: os.killpg(0, signal.SIGKILL))
