"""A clean leave: before a peer stops, the stages that only it serves are handed over to another peer.

A peer that stops (Ctrl-C, SIGTERM, the end of its run) is often the only online holder of some of its stages: with
spans, a volunteer with a large GPU holds many blocks that nobody else does. Stopping at once would leave those
stages to be restarted from an older checkpoint, or afresh. So, for each such stage, the leaving peer:

1. announces `leaving` (balancing no longer counts it, so the stage looks empty and another peer takes it over:
   balancing/spans.py's `toward_full_cover`, or moves.py's bottleneck; routes avoid it), takes no more microbatches
   and leaves the averaging rounds, so that its state stops changing;
2. hands its state to the peer that takes the stage over (rpc_download_state answers while it is leaving;
   server/takeover.py downloads from leaving peers when no online peer has the stage);
3. stops once another peer announces the stage online, or when nobody started to take it over within
   `start_within` seconds (no peer joining the stage, no download of its state in flight), or when no peer that
   could take it is left (the swarm stops too, or the others are pinned to their stages), or when its owner asks
   again (a second Ctrl-C: `hurry`). Its last checkpoint is saved either way, and other peers can fetch it from
   there while it is back (server/checkpoint_sharing.py).

Stages that other online peers serve too announce `leaving` at once (no holder may move off one counting on this
peer), and are not waited for unless they become this peer's alone: the others have their state already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import PeerState
from swarm.server.stage import StageServer
from swarm.server.takeover import other_online_peers

logger = logging.getLogger(__name__)

HANDOVER_START = 60.0  # seconds a leaving peer waits for another peer to start taking a stage over
DRAIN_TIMEOUT = 30.0  # seconds a leaving stage waits for the microbatches in flight
LOOK_PERIOD = 1.0  # seconds between two reads of the stage's records while waiting


@dataclass(frozen=True)
class Handover:
    """What a leave did: the stages that only this peer served, those another peer took over, and how long it took."""

    sole: tuple[int, ...]
    taken: tuple[int, ...]
    seconds: float
    hurried: bool  # the owner asked to stop at once

    @property
    def left_behind(self) -> tuple[int, ...]:
        """Stages nobody took over: their state since their last checkpoint stays on this machine only."""
        return tuple(stage for stage in self.sole if stage not in self.taken)


async def sole_stages(servers: Sequence[StageServer], view: AnnouncementCache, peer_id: str) -> list[StageServer]:
    """The servers of stages that no other online peer serves (read afresh)."""
    await view.all_stages(force=True)
    return [server for server in servers if not await other_online_peers(view, server.stage, peer_id)]


async def anyone_else(view: AnnouncementCache, peer_id: str) -> bool:
    """Whether any other peer could take a stage over: one that serves (or joins) a stage and may move (a peer
    pinned to its stage with --stage never does). A peer with nobody to hand its stages to stops at once; so does
    one whose swarm stops with it (the others announce that they leave)."""
    now = get_dht_time()
    states = (PeerState.ONLINE, PeerState.JOINING)
    return any(
        a.peer_id != peer_id and a.state in states and not a.pinned and a.expiration > now
        for announcements in await view.all_stages()
        for a in announcements
    )


LOOKS_FOR_TAKERS = 3  # reads of the records before a peer concludes that nobody could take its stages


async def someone_could_take(view: AnnouncementCache, peer_id: str) -> bool:
    """`anyone_else`, read afresh up to LOOKS_FOR_TAKERS times a second apart: a DHT read can miss a record that
    was just written (another node answered), and a peer that stops for nobody must be sure of it."""
    for look in range(LOOKS_FOR_TAKERS):
        if look:
            await asyncio.sleep(LOOK_PERIOD)
            await view.all_stages(force=True)
        if await anyone_else(view, peer_id):
            return True
    return False


async def _being_taken(view: AnnouncementCache, server: StageServer, peer_id: str) -> bool:
    """Whether another peer is taking the stage over now: it announced joining it, or downloads its state here."""
    now = get_dht_time()
    joining = [
        a
        for a in await view.stage(server.stage)
        if a.state == PeerState.JOINING and a.peer_id != peer_id and a.expiration > now
    ]
    return bool(joining) or server.service.sending_state > 0


async def hand_over(
    sole: Sequence[StageServer],
    shared: Sequence[StageServer],
    view: AnnouncementCache,
    peer_id: str,
    hurry: asyncio.Event,
    start_within: float = HANDOVER_START,
) -> Handover:
    """Hand the stages of `sole` (those only this peer serves: `sole_stages`) to other peers (see the module's
    docstring); they are left leaving (drained), for the caller to shut down.

    The `shared` servers' stages have other online holders when the leave begins; they announce leaving too, at
    once, so that no holder moves off one of them counting on this peer to stay. A holder may still have moved away
    just before (to take over one of the stages handed over here): a stage that becomes this peer's alone is handed
    over too, and the leave ends only after a last look finds none."""
    begin = time.monotonic()
    if not sole:
        return Handover((), (), 0.0, False)
    stages = [server.stage for server in sole]
    logger.info(f"leaving: handing stages {stages} over to other peers (waiting up to {start_within:.0f}s for one)")
    await asyncio.gather(*(server.leave(DRAIN_TIMEOUT) for server in (*sole, *shared)))
    waiting, taken = list(sole), []
    shared = list(shared)
    last_activity = time.monotonic()
    last_look = False  # the one more look after the last stage was taken
    while (waiting or last_look) and not hurry.is_set():
        try:
            await asyncio.wait_for(hurry.wait(), timeout=LOOK_PERIOD)
            break
        except TimeoutError:
            pass
        await view.all_stages(force=True)
        for server in list(shared):
            if not await other_online_peers(view, server.stage, peer_id):
                shared.remove(server)
                stages.append(server.stage)
                logger.info(f"stage {server.stage} is served by this peer alone now: handing it over too")
                waiting.append(server)
                last_activity = time.monotonic()
        last_look = False
        for server in list(waiting):
            if await other_online_peers(view, server.stage, peer_id):
                waiting.remove(server)
                taken.append(server.stage)
                logger.info(f"stage {server.stage} was taken over by another peer")
                last_look = not waiting and bool(shared)
            elif await _being_taken(view, server, peer_id):
                last_activity = time.monotonic()
        if time.monotonic() - last_activity > start_within or not await anyone_else(view, peer_id):
            break
    handover = Handover(tuple(stages), tuple(sorted(taken)), time.monotonic() - begin, hurry.is_set())
    if handover.left_behind:
        logger.warning(
            f"stages {list(handover.left_behind)} were not taken over by any peer "
            f"({'asked to stop at once' if handover.hurried else f'nobody came within {start_within:.0f}s'})"
        )
    return handover
