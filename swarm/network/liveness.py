"""Whether a peer that owes this one a reply is still there, so that a vanished peer costs seconds, not the budget.

A peer can vanish without closing its connections: a laptop's lid closes, its Wi-Fi drops, its process is stopped.
Nothing resets the connection, so a call to it waits its whole budget (a trainer's route budget is minutes with
the default timeouts), and libp2p itself notices nothing for tens of seconds. A slow call is no proof of that: a
peer may be queueing the microbatch behind others, or waiting for a step of its stage. So a call that runs longer
than PATIENCE is watched: every PATIENCE seconds the caller pings the peer (an empty probe, answered by the peer's
event loop whatever its worker is doing), and a peer that does not answer within PROBE_TIMEOUT has vanished: the
caller gives the call up (PeerVanishedError) and moves on, as after a timeout. A peer heard from in the last FRESH
seconds is not pinged again, and the calls waiting on one peer share its ping.

What giving up early costs: a peer cut off only for a moment may still apply a gradient its caller gave up on
before its own deadline, as one whose reply is lost on the way does; its caller's retry elsewhere then applies it
at a second replica of that stage. That happens only to the microbatches in flight at the moment of the cut.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from swarm.errors import PeerVanishedError, RemoteStageError

logger = logging.getLogger(__name__)

PATIENCE = 3.0  # seconds a call runs before its peer is checked, and between two checks
PROBE_TIMEOUT = 3.0  # a peer that does not answer a ping within this has vanished
FRESH = 1.0  # a peer heard from this recently is taken as there, without a ping

T = TypeVar("T")
Ping = Callable[[str, float], Awaitable[object]]  # (peer id, timeout): returns once the peer answered


class Liveness:
    """What this peer heard from others recently, and the pings that check on a peer a call waits for."""

    def __init__(self, ping: Ping, patience: float = PATIENCE, probe_timeout: float = PROBE_TIMEOUT):
        self.ping, self.patience, self.probe_timeout = ping, patience, probe_timeout
        self.heard: dict[str, float] = {}  # peer id -> when it last answered (time.monotonic())
        self.probes: dict[str, asyncio.Future[bool]] = {}  # the ping in progress to each peer
        self.vanished = 0  # calls given up because their peer did not answer a ping

    def answered(self, peer_id: str) -> None:
        """The peer just answered a call."""
        self.heard[peer_id] = time.monotonic()

    async def there(self, peer_id: str) -> bool:
        """Whether the peer answers now: heard from within FRESH seconds, or answering a ping in time."""
        if time.monotonic() - self.heard.get(peer_id, -FRESH) < FRESH:
            return True
        probe = self.probes.get(peer_id)
        if probe is None:
            probe = self.probes[peer_id] = asyncio.ensure_future(self._probe(peer_id))
            probe.add_done_callback(lambda _: self.probes.pop(peer_id, None))
        return await asyncio.shield(probe)

    async def _probe(self, peer_id: str) -> bool:
        try:
            await asyncio.wait_for(self.ping(peer_id, self.probe_timeout), self.probe_timeout)
        except asyncio.CancelledError:
            raise
        except RemoteStageError:  # an error reply (a refusal, say) is an answer: it is there
            pass
        except Exception as e:  # no answer in time, a reset connection, an error reply: not there for this caller
            logger.debug(f"ping of {peer_id[-8:]} failed: {e!r}")
            return False
        self.answered(peer_id)
        return True

    async def watch(self, call: Awaitable[T], peer_id: str, what: str) -> T:
        """The call's result, or PeerVanishedError as soon as its peer stops answering pings (the call is then
        cancelled). Its own timeout still applies: a peer that answers pings but not the call waits that long."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.patience)
                if done:
                    break
                if not await self.there(peer_id) and not task.done():
                    self.vanished += 1
                    raise PeerVanishedError(
                        f"{what}: peer {peer_id[-8:]} stopped answering (no reply to a ping within "
                        f"{self.probe_timeout:.0f} s); its link is down or it stopped"
                    )
        finally:
            if not task.done():
                task.cancel()
        result = task.result()
        self.answered(peer_id)
        return result
