"""hivemind's unary calls, made safe for a caller that gives up on one just as its reply arrives.

Every unary call of a hivemind P2P (a stage's forward and backward, a ping, every DHT request) goes through one
persistent connection to its p2pd daemon, and one task, `ControlClient._read_from_persistent_conn`, hands each
reply to the future its caller awaits. A caller that is cancelled (its timeout, a trainer that stops, a watch
that gave up on a peer) cancels that future at once, but removes it from `_pending_calls` only when its own task
runs next. A reply read in between finds the cancelled future, `set_result` raises InvalidStateError, and the
reading task dies: from then on no unary call of that P2P ever gets a reply, and each waits its whole timeout.
Seen here: a trainer stopped with calls in flight, and every later call of its evaluation timed out for 120 s.

`install` makes `_pending_calls` of every ControlClient a mapping that hides finished futures, so the reader takes
such a reply as one for an unknown call (hivemind logs it at debug level and reads on). It is installed in this
process; the DHT's and the averager's processes are forked from it, so they have it too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

_installed = False


class PendingCalls(dict):
    """call id -> the future of a call still waiting for its reply; a finished (cancelled) one counts as absent
    to the reader, which only ever asks `call_id in pending` before it sets a result."""

    def __contains__(self, call_id: object) -> bool:
        future: asyncio.Future[Any] | None = self.get(call_id)
        return future is not None and not future.done()


def install() -> None:
    """Give every ControlClient made from now on a PendingCalls (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    original_init = ControlClient.__init__

    def init(self: ControlClient, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._pending_calls = PendingCalls(self._pending_calls)

    ControlClient.__init__ = init
