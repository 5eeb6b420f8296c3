"""The peer's cached view of the stages' announcements: one object per peer, shared by its trainer, its stage
servers, its rebalancer and its other parts, so that they cost one DHT read per announce period between them.

The keys and records themselves, and reading them from the DHT, are swarm/dht/records.py's.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.dht.records import Announcement, fetch_announcements

logger = logging.getLogger(__name__)


class AnnouncementCache:
    """A cached picture of the stages' announcements, refreshed from the DHT when older than `max_age`.

    Many microbatches share one view; a lock makes them wait for one refresh instead of each starting its own,
    and a forced refresh happens at most once per `min_refresh_interval` seconds.
    """

    def __init__(self, dht: DHT, swarm_id: str, num_stages: int, max_age: float, min_refresh_interval: float = 1.0):
        self.dht, self.swarm_id, self.num_stages = dht, swarm_id, num_stages
        self.max_age, self.min_refresh_interval = max_age, min_refresh_interval
        self._stages: list[list[Announcement]] = [[] for _ in range(num_stages)]
        # the most optimizer steps any peer of each stage announced, ever, as read here: how far a stage had come
        # before its peers left or vanished (what a state taken from a checkpoint is behind)
        self.furthest = [0] * num_stages
        self._updated = -float("inf")
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        results = await asyncio.gather(
            *[fetch_announcements(self.dht, self.swarm_id, s) for s in range(self.num_stages)], return_exceptions=True
        )
        for stage, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.warning(f"reading announcements of stage {stage} failed: {result!r}")
            else:
                self._stages[stage] = result
                steps = [a.optimizer_steps for a in result]
                self.furthest[stage] = max([self.furthest[stage], *steps])
        self._updated = get_dht_time()

    async def all_stages(self, force: bool = False) -> list[list[Announcement]]:
        """Announcements of every stage (all states), refreshed if stale, or if forced and not just refreshed."""
        async with self._lock:
            age = get_dht_time() - self._updated
            if age > self.max_age or (force and age >= self.min_refresh_interval):
                await self.refresh()
        return list(self._stages)

    async def stage(self, stage: int, force: bool = False) -> list[Announcement]:
        return (await self.all_stages(force))[stage]
