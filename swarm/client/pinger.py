"""Pinger: measures round trips to a few announced peers and refines this peer's network coordinate.

Every PING_PERIOD seconds it pings one announced peer (an empty bandwidth probe, a few hundred bytes), chosen at
random among the online ones, and feeds the round trip and that peer's announced coordinate to this peer's Vivaldi
(swarm/network/coordinates.py). The peer's stage server announces the coordinate; its trainer (and a trainer-only peer's)
estimates from coordinates the latency to peers it has never called. A failed ping is ignored: routing bans
and balancing handle dead peers, this only positions.
"""

from __future__ import annotations

import asyncio
import logging
import random

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.client.rpc import ping
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.manifests.manifest import Manifest
from swarm.network.coordinates import Coordinate, Vivaldi
from swarm.routing import online_peers

logger = logging.getLogger(__name__)

PING_PERIOD = 2.0
PING_TIMEOUT = 5.0


class Pinger:
    def __init__(self, manifest: Manifest, p2p: P2P, view: AnnouncementCache, peer_id: str, position: Vivaldi):
        self.manifest, self.p2p, self.view, self.peer_id, self.position = manifest, p2p, view, peer_id, position
        self.rng = random.Random()
        self.pings = 0
        self.failed = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=PING_PERIOD * self.rng.uniform(0.75, 1.25))
            except TimeoutError:
                pass
            if not stop.is_set():
                await self.ping_one()

    async def ping_one(self) -> float | None:
        """Ping one random online peer other than this one; the round trip, or None."""
        try:
            candidates = [
                a
                for stage in await self.view.all_stages()
                for a in online_peers(stage, get_dht_time())
                if a.peer_id != self.peer_id
            ]
        except Exception as e:  # the DHT is slow or gone: try again next period
            logger.debug(f"no peers to ping: {e!r}")
            return None
        if not candidates:
            return None
        target = self.rng.choice(candidates)
        try:
            rtt = await ping(self.p2p, target.peer_id, self.manifest, PING_TIMEOUT)
        except Exception as e:
            self.failed += 1
            logger.debug(f"ping of {target.peer_id[-8:]} failed: {e!r}")
            return None
        self.pings += 1
        self.position.observe(target.coordinate or Coordinate(), rtt)
        return rtt
