"""The fork server's children: each gets its own copy of what hivemind made to be shared between processes."""

import os

from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture

from swarm.dht import hivemind_futures
from swarm.local import forkserver


def _locks():
    return MPFuture._update_lock, MPFuture._initialization_lock, _AsyncContextWrapper.EXECUTOR_LOCK


def _in_a_child(run) -> int:
    """run() in a forked child (the locks it breaks are never this test process's); its exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(run())
        except BaseException:
            os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _a_server_whose_child_was_killed_holding_the_locks() -> int:
    """The fork server's position: a child took hivemind's shared locks and died (a SIGKILL) without releasing them;
    then the next child is forked. 0 if that child can take every lock, 1 if it would wait for ever."""
    # locks of this "server" only: the ones inherited from the pytest worker must never be left held, or the
    # worker's own DHTs would hang in the tests that follow
    hivemind_futures.start_a_new_family()

    def killed_while_holding_them() -> int:
        for lock in _locks():
            lock.acquire()
        return 0

    _in_a_child(killed_while_holding_them)

    def the_next_peer() -> int:
        forkserver.forget_the_servers_shared_state()  # what each forked peer does first
        return 0 if all(lock.acquire(timeout=1) for lock in _locks()) else 1

    return _in_a_child(the_next_peer)


def test_a_forked_peer_is_not_blocked_by_a_lock_that_a_killed_sibling_held():
    assert _in_a_child(_a_server_whose_child_was_killed_holding_the_locks) == 0, (
        "a peer forked after a sibling was killed holding hivemind's locks waits for ever (its DHT never starts)"
    )
