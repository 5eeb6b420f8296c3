"""A served stage's announcement: the peer's facts and the stage's figures (one StageStats), kept in the DHT.

The record is refreshed every announce period without waiting for the previous store: a store that reaches an
unresponsive DHT node waits out hivemind's timeouts (seconds), and records live only LIFETIME_PERIODS periods, so
waiting would let a healthy peer drop out of everyone's view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind import DHT

from swarm.dht.records import MAX_THROUGHPUT, Announcement, announcement_lifetime, store_announcement
from swarm.manifests.manifest import Manifest
from swarm.network.coordinates import Coordinate, Vivaldi
from swarm.watch.stats import StageStats

logger = logging.getLogger(__name__)

MAX_ANNOUNCEMENTS_IN_FLIGHT = 3


@dataclass(frozen=True)
class PeerFacts:
    """What a peer announces about itself besides its stage's figures; the same for every stage it serves."""

    peer_id: str
    device: str = "cpu"
    pinned: bool = False  # serves its stage by the user's choice (--stage): never moves
    public_name: str = ""
    reachable: bool = True  # others can dial it (server/reachability.py)
    maddrs: tuple[str, ...] = ()  # its addresses; empty when nobody can dial it
    started: float = field(default_factory=time.monotonic)  # when the peer (not this stage) began


def announced_rate(value: float) -> float:
    """A throughput as records carry it (a fast loopback link measures above what records may carry)."""
    return round(min(value, MAX_THROUGHPUT), 3)


def announcement(facts: PeerFacts, stats: StageStats, coordinate: Coordinate | None = None) -> Announcement:
    rate = announced_rate
    return Announcement(
        peer_id=facts.peer_id,
        stage=stats.stage,
        state=stats.state,
        throughput=rate(stats.throughput),
        compute_throughput=rate(stats.compute_throughput),
        network_throughput=rate(stats.network_throughput),
        delivered_throughput=rate(stats.delivered_throughput),
        samples_served=stats.samples_served,
        outstanding=max(stats.outstanding, 0),
        uptime=round(time.monotonic() - facts.started, 1),
        pinned=facts.pinned,
        device=facts.device,
        public_name=facts.public_name,
        optimizer_steps=stats.optimizer_steps,
        averaging_round=stats.averaging_round,
        round_samples=stats.round_samples,
        averaging_rounds=stats.averaging_rounds,
        activation_bytes_sent=stats.activation_bytes_sent,
        activation_bytes_received=stats.activation_bytes_received,
        averaging_bytes_sent=stats.averaging_bytes_sent,
        averaging_bytes_received=stats.averaging_bytes_received,
        staleness_mean=round(stats.staleness_mean, 3),
        staleness_max=stats.staleness_max,
        memory_used=stats.memory_used,
        memory_available=stats.memory_available,
        steps_behind=stats.steps_behind,
        reachable=facts.reachable,
        maddrs=facts.maddrs,
        coordinate=coordinate,
    )


class Announcer:
    def __init__(
        self, manifest: Manifest, facts: PeerFacts, stats: Callable[[], StageStats], position: Vivaldi | None = None
    ):
        self.manifest, self.facts, self.stats, self.position = manifest, facts, stats, position
        self.dht: DHT | None = None

    def announcement(self) -> Announcement:
        return announcement(self.facts, self.stats(), self.position.coordinate if self.position else None)

    async def announce(self) -> None:
        # The same lifetime for every state: the DHT refuses a value that expires earlier than the one it replaces,
        # so a shorter-lived "offline" record would be dropped.
        assert self.dht is not None
        lifetime = announcement_lifetime(self.manifest.network.announce_period)
        await store_announcement(self.dht, self.manifest.swarm_id, self.announcement(), lifetime)

    async def run(self) -> None:
        """Refresh the record every announce period until cancelled (see the module's docstring)."""
        in_flight: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(self.manifest.network.announce_period)
                if len(in_flight) < MAX_ANNOUNCEMENTS_IN_FLIGHT:
                    task = asyncio.create_task(self._announce_logged())
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
        finally:
            for task in in_flight:
                task.cancel()

    async def _announce_logged(self) -> None:
        try:
            await self.announce()
        except Exception as e:  # a missed refresh is not fatal: the next one may succeed
            logger.warning(f"announcement failed: {e!r}")
