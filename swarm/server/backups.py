"""Backups of the stages that only one peer serves: another peer keeps a recent copy of their state as a checkpoint,
so that a holder that vanishes (its link cut, its machine off: no chance to hand over, server/handover.py) takes
at most one backup interval of training with it.

Every `every` seconds each peer looks at the stages that have exactly one online peer. For each, the peers that
keep its backup are chosen by rendezvous hashing (`backup_keepers`: the same choice at every peer that reads the
same records, and a choice that changes little when peers come and go) among the swarm's online peers other than
the holder. A chosen peer downloads the state from the holder (rpc_download_state, as a peer that takes the stage
over would), checks its layout, and saves it as its checkpoint of the stage, which it then announces and hands
out (server/checkpoint_sharing.py); server/takeover.py takes the freshest such checkpoint when nobody serves the
stage any more.

A backup costs the holder's uplink the stage's state each time, which on a home link is minutes: a stage is backed
up at most once per `every` seconds and at most at BACKUP_RATE bytes per second on average (a 3 GB stage: once
every 50 minutes), and peers never back up a stage they serve, or one that several peers serve (they have it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.client.rpc import download_state, state_bytes, state_deadline
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.manifests.manifest import Manifest
from swarm.routing import online_peers
from swarm.server.checkpoint import save_checkpoint
from swarm.wire.state import check_state_layout, stage_state_shapes

logger = logging.getLogger(__name__)

BACKUP_COPIES = 1  # peers that keep a backup of each stage that has a single online peer
BACKUP_RATE = 1_000_000  # bytes per second a peer's backups of one stage may average, at most (8 Mbit/s)
DOWNLOAD_FLOOR = 60.0  # seconds a backup's download may take, plus its bytes at the slowest rate a state travels


def backup_keepers(swarm_id: str, stage: int, candidates: list[str], copies: int = BACKUP_COPIES) -> list[str]:
    """The `copies` peers among `candidates` that keep the backup of `stage`: those whose hash with the stage is
    highest (rendezvous hashing)."""

    def score(peer_id: str) -> bytes:
        return hashlib.sha256(f"{swarm_id}/{stage}/{peer_id}".encode()).digest()

    return sorted(set(candidates), key=score, reverse=True)[:copies]


def backup_interval(every: float, stage_bytes: int, rate: float = BACKUP_RATE) -> float:
    """Seconds between two backups of a stage of `stage_bytes`: `every`, or longer for a large state."""
    return max(every, stage_bytes / rate)


class StageBackups:
    """Keeps this peer's backups of the stages that only one other peer serves (see the module's docstring)."""

    def __init__(
        self,
        manifest: Manifest,
        p2p: P2P,
        view: AnnouncementCache,
        peer_id: str,
        directory: Path | None,
        every: float,
        served: Callable[[], set[int]],
    ):
        self.manifest, self.p2p, self.view, self.peer_id = manifest, p2p, view, peer_id
        self.directory, self.every, self.served = directory, every, served
        self.last: dict[int, float] = {}  # stage -> when this peer last backed it up (time.monotonic())
        self.saved = 0  # backups saved

    async def run(self, stop: asyncio.Event) -> None:
        if self.directory is None or self.every <= 0:
            return
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.every)
                return
            except TimeoutError:
                pass
            try:
                await self.back_up_due()
            except Exception as e:  # a DHT timeout, a holder gone meanwhile: the next look will do
                logger.warning(f"backing up the stages only one peer serves failed: {e!r}")

    async def due(self) -> list[tuple[int, str]]:
        """(stage, its one online peer) of the stages this peer should back up now."""
        stages = await self.view.all_stages(force=True)
        now = get_dht_time()
        online = [online_peers(announcements, now) for announcements in stages]
        everyone = {a.peer_id for announcements in online for a in announcements}
        if self.peer_id not in everyone:  # only serving peers keep backups (all peers then make the same choice)
            return []
        served, found = self.served(), []
        for stage, holders in enumerate(online):
            if len(holders) != 1 or stage in served:
                continue
            holder = holders[0].peer_id
            if holder == self.peer_id or self.peer_id not in backup_keepers(
                self.manifest.swarm_id, stage, [p for p in everyone if p != holder]
            ):
                continue
            interval = backup_interval(self.every, state_bytes(stage_state_shapes(self.manifest, stage)))
            if time.monotonic() - self.last.get(stage, -float("inf")) >= interval:
                found.append((stage, holder))
        return found

    async def back_up_due(self) -> None:
        for stage, holder in await self.due():
            await self.back_up(stage, holder)

    async def back_up(self, stage: int, holder: str) -> bool:
        """Download `stage`'s state from `holder` and keep it as this peer's checkpoint of the stage."""
        assert self.directory is not None
        shapes = stage_state_shapes(self.manifest, stage)
        begin = time.monotonic()
        self.last[stage] = begin  # a failed try waits for the next interval too: the holder may be busy
        try:
            items, counters = await download_state(
                self.p2p, holder, self.manifest, stage, shapes, state_deadline(shapes, DOWNLOAD_FLOOR)
            )
            check_state_layout(items, shapes)
            await asyncio.to_thread(save_checkpoint, self.directory, self.manifest, stage, items, counters)
        except Exception as e:  # a refusal, a timeout, a state that fails its checks, a full disk
            logger.warning(f"backing up stage {stage} from peer {holder[-8:]} failed: {e!r}")
            return False
        self.saved += 1
        logger.info(
            f"backed up stage {stage}, which only peer {holder[-8:]} serves ({counters['optimizer_steps']} optimizer "
            f"steps) in {time.monotonic() - begin:.1f}s"
        )
        return True
