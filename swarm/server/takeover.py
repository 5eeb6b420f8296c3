"""Where a stage's state comes from when this peer starts serving it: an online peer of the stage (fastest
first; then a leaving or paused one, which keeps its state for the stage), this peer's own checkpoint when that is further
ahead or nobody serves the stage any more, or, when neither exists, the seed initialisation. A peer that resumes
after a pause catches up: an online peer's state if that went further than its own (`catch_up`). Every outcome is
reported as a `state_taken` event."""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.client.rpc import download_state, state_deadline
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import Announcement, PeerState, announcement_lifetime
from swarm.errors import CheckpointError
from swarm.events import Event, EventKind, OnEvent, StateSource
from swarm.hf import pretrained
from swarm.manifests.manifest import Manifest
from swarm.routing import online_peers
from swarm.server.checkpoint import Checkpoint, find_checkpoint
from swarm.server.checkpoint_sharing import fetch_checkpoint_records, freshest
from swarm.server.rounds import STATE_SOURCES
from swarm.server.stage import StageServer
from swarm.wire.state import stage_state_shapes

logger = logging.getLogger(__name__)

STATE_DOWNLOAD_FLOOR = 60.0  # seconds, plus the state's bytes at MIN_STATE_RATE (client/rpc.py's state_deadline)
STATE_ATTEMPTS = 2  # tries per source peer: a download can be cut short (the peer was busy, a stream broke)
RETRY_PAUSE = 1.0
CHECKPOINT_SOURCES = 3  # peers' checkpoints tried, the freshest first
CHECKPOINT_STALL = 20.0  # seconds a checkpoint's sender may send nothing (it reads the file first, then streams it)


def progress(counters: dict[str, int]) -> tuple[int, int]:
    """How far a stage's state has come: averaging rounds first (the swarm's clock), then local optimizer steps."""
    return counters.get("averaging_round", 0), counters.get("optimizer_steps", 0)


def sent_what_it_announced(announced: tuple[int, int], sent: dict[str, int]) -> bool:
    """Whether a checkpoint a peer sent is at least as far as its record said (`announced`: progress()). A peer
    that saved a newer one since its record (backups every few seconds, records every announce period) sends that,
    which is better; one that sends less than it announced is refused."""
    return progress(sent) >= announced


async def other_online_peers(view: AnnouncementCache, stage: int, peer_id: str) -> list[Announcement]:
    """Online peers of `stage` other than `peer_id`, as last read from the DHT."""
    return [a for a in online_peers(await view.stage(stage), get_dht_time()) if a.peer_id != peer_id]


class StateTakeover:
    def __init__(self, manifest: Manifest, p2p: P2P, view: AnnouncementCache, peer_id: str, on_event: OnEvent):
        self.manifest, self.p2p, self.view, self.peer_id, self.on_event = manifest, p2p, view, peer_id, on_event
        self._online = 0  # other online peers of the stage at the last takeover

    async def into(self, server: StageServer, reason: str) -> bool:
        """Load the stage's state into `server` (see the module's docstring). True if loaded or started afresh;
        False if the stage has online peers but none could give its state (and there is no checkpoint)."""
        taken, last_steps = await self._take(server, reason)
        if taken is None and last_steps > 0:
            # The stage trained, and nobody seems to have its state: a search made just after a peer vanished can come
            # back empty (it waits on the vanished DHT node while the records it looks for lapse). Look again, every
            # announce period for a record lifetime, before the stage loses its training.
            logger.info(f"found no state of stage {server.stage}, which had trained {last_steps} steps: looking again")
            period = self.manifest.network.announce_period
            deadline = time.monotonic() + announcement_lifetime(period)
            while taken is None and time.monotonic() < deadline:
                await asyncio.sleep(period)
                taken, last_steps = await self._take(server, reason)
        if taken is not None:
            return taken
        return await self._start_without_state(server, reason, last_steps)

    async def _take(self, server: StageServer, reason: str) -> tuple[bool | None, int]:
        """(True if the state of an online peer or of a checkpoint was loaded, False if the stage has online peers
        but none gave its state, None if no state of it was found; the optimizer steps the stage had come to)."""
        stage = server.stage
        await self.view.all_stages(force=True)
        # how far the stage had come as its peers last announced it: what a checkpoint is behind
        last_steps = max([*(a.optimizer_steps for a in await self.view.stage(stage)), self.view.furthest[stage]])
        sources = self._fastest(await other_online_peers(self.view, stage, self.peer_id))
        self._online = len(sources)  # reported with the outcome: a state taken while nobody served the stage
        sources += await self._handing_out(stage)  # the stage's state as their owners paused them, or as they left
        checkpoint = find_checkpoint(server.options.checkpoint_dir, self.manifest, stage)
        if checkpoint is not None and not sources and reason == "join":
            # The stage trained before. Its peers' records may have lapsed for a moment (a DHT store that waits on an
            # unresponsive node): look again for one record lifetime before falling back to an older checkpoint.
            # (A move to a stage nobody serves follows two looks that found it empty: no need to wait again.)
            sources = await self._wait_for_sources(stage)
        shapes = stage_state_shapes(self.manifest, stage)
        for source in [s for s in sources for _ in range(STATE_ATTEMPTS)]:
            try:
                begin = time.monotonic()
                items, counters = await download_state(
                    self.p2p, source.peer_id, self.manifest, stage, shapes, state_deadline(shapes, STATE_DOWNLOAD_FLOOR)
                )
                if checkpoint is not None and progress(checkpoint.counters) > progress(counters):
                    logger.info(f"this peer's checkpoint of stage {stage} is ahead of peer {source.peer_id[-8:]}")
                    break
                await server.load_state(items, counters)
                seconds = time.monotonic() - begin
                logger.info(
                    f"took over the state of stage {stage} from peer {source.peer_id[-8:]} "
                    f"({counters['optimizer_steps']} optimizer steps) in {seconds:.1f}s"
                )
                self._report(server, StateSource.PEER, source.peer_id, counters, seconds, reason)
                return True, last_steps
            except Exception as e:  # a refusal, a timeout or a malformed state: try again, then another
                logger.warning(f"state download of stage {stage} from {source.peer_id[-8:]} failed: {e!r}")
                await asyncio.sleep(RETRY_PAUSE)
        if await self._from_checkpoints(server, checkpoint, last_steps, reason):
            return True, last_steps
        if checkpoint is not None:
            try:
                await server.load_state(checkpoint.items, checkpoint.counters)
                age = (time.time() - checkpoint.saved_at) / 60
                behind = max(0, last_steps - checkpoint.optimizer_steps)
                logger.info(
                    f"resumed stage {stage} from checkpoint {checkpoint.path} "
                    f"({checkpoint.optimizer_steps} optimizer steps, saved {age:.1f} min ago, {behind} steps behind "
                    "the stage's last announced state)"
                )
                self._report(server, StateSource.CHECKPOINT, "", checkpoint.counters, 0.0, reason, behind)
                return True, last_steps
            except Exception as e:  # it passed the file checks but does not fit this stage's model
                logger.error(f"checkpoint {checkpoint.path} does not fit stage {stage}: {e}; not loaded")
        return (False if sources else None), last_steps

    async def _start_without_state(self, server: StageServer, reason: str, last_steps: int) -> bool:
        """No state of the stage anywhere: the pretrained model's parameters if the swarm has one, else its initial
        parameters (the stage's training so far, `last_steps` optimizer steps, is lost: said loudly)."""
        stage = server.stage
        if last_steps > 0:
            logger.warning(
                f"stage {stage} had trained {last_steps} optimizer steps, and no peer has its state or a checkpoint "
                "of it any more: it starts again"
            )
        if self.manifest.pretrained.path:
            begin = time.monotonic()
            params = await asyncio.to_thread(pretrained.stage_parameters, self.manifest, stage)
            await server.load_state([(f"param/{name}", tensor) for name, tensor in params.items()], {})
            logger.info(
                f"no online peer serves stage {stage} and no checkpoint of it: started from the pretrained model"
            )
            self._report(server, StateSource.PRETRAINED, "", {}, time.monotonic() - begin, reason, last_steps)
            return True
        logger.info(f"no online peer serves stage {stage} and no checkpoint of it: starting afresh")
        self._report(server, StateSource.FRESH, "", {}, 0.0, reason, last_steps)
        return True

    async def _from_checkpoints(
        self, server: StageServer, own: Checkpoint | None, last_steps: int, reason: str
    ) -> bool:
        """The freshest checkpoint of the stage that another peer keeps (server/checkpoint_sharing.py), if it went
        further than this peer's own (`own`): loaded, and reported with how many optimizer steps it is behind the
        stage's last announced state. False if there is none, or none could be had."""
        stage = server.stage
        try:
            records = await fetch_checkpoint_records(self.view.dht, self.manifest)
        except Exception as e:  # a DHT timeout: as if nobody kept one
            logger.warning(f"reading which peers keep checkpoints of stage {stage} failed: {e!r}")
            return False
        own_progress = progress(own.counters) if own is not None else (-1, -1)
        shapes = stage_state_shapes(self.manifest, stage)
        # only peers still announced (a vanished peer's checkpoint record outlives its stage records: asking it
        # would wait for nothing), the freshest first
        now = get_dht_time()
        live = {
            a.peer_id
            for announcements in await self.view.all_stages()
            for a in announcements
            if a.state != PeerState.OFFLINE and a.expiration > now
        }
        candidates = [(peer_id, kept) for peer_id, kept in freshest(records, stage, self.peer_id) if peer_id in live]
        for peer_id, kept in candidates[:CHECKPOINT_SOURCES]:
            if kept.progress <= own_progress:
                break
            begin = time.monotonic()
            try:
                deadline = state_deadline(shapes, STATE_DOWNLOAD_FLOOR)
                items, counters = await download_state(
                    self.p2p, peer_id, self.manifest, stage, shapes, deadline, CHECKPOINT_STALL, from_checkpoint=True
                )
                if not sent_what_it_announced(kept.progress, counters):
                    raise CheckpointError(f"it announced {kept.counters} and sent {counters}, which is behind")
                await server.load_state(items, counters)
            except Exception as e:  # a refusal, a timeout, a state that fails its checks: the next one
                logger.warning(f"the checkpoint of stage {stage} at peer {peer_id[-8:]} could not be had: {e!r}")
                continue
            steps = counters.get("optimizer_steps", 0)
            seconds, behind = time.monotonic() - begin, max(0, last_steps - steps)
            age = (time.time() - kept.saved_at) / 60
            logger.info(
                f"recovered stage {stage} from the checkpoint of peer {peer_id[-8:]} in {seconds:.1f}s "
                f"({steps} optimizer steps, announced {age:.1f} min ago, {behind} steps behind the "
                "stage's last announced state)"
            )
            self._report(server, StateSource.CHECKPOINT, peer_id, counters, seconds, reason, behind)
            return True
        return False

    async def catch_up(self, server: StageServer) -> StateSource:
        """On resuming after a pause: the state of an online peer of the stage that went further than this peer's
        own (averaging rounds, then optimizer steps), else its own. Where the state came from."""
        stage, counters = server.stage, server.worker.counters
        own = (counters.averaging_round, counters.optimizer_steps)
        await self.view.all_stages(force=True)
        shapes = stage_state_shapes(self.manifest, stage)
        for source in self._fastest(await other_online_peers(self.view, stage, self.peer_id)):
            begin = time.monotonic()
            try:
                items, theirs = await download_state(
                    self.p2p, source.peer_id, self.manifest, stage, shapes, state_deadline(shapes, STATE_DOWNLOAD_FLOOR)
                )
                if progress(theirs) <= own:
                    break  # the stage went no further than this peer while it was paused
                await server.load_state(items, theirs)
            except Exception as e:  # a refusal, a timeout or a malformed state: another peer, or its own
                logger.warning(f"state download of stage {stage} from {source.peer_id[-8:]} failed: {e!r}")
                continue
            seconds = time.monotonic() - begin
            logger.info(f"caught up with stage {stage}: the state of peer {source.peer_id[-8:]} in {seconds:.1f}s")
            self._report(server, StateSource.PEER, source.peer_id, theirs, seconds, "resume")
            return StateSource.PEER
        fields = {"optimizer_steps": own[1], "averaging_round": own[0]}
        self._report(server, StateSource.OWN, "", fields, 0.0, "resume")
        return StateSource.OWN

    async def _handing_out(self, stage: int) -> list[Announcement]:
        """Peers of the stage that keep its state without serving it: paused ones, and leaving ones (a leaving
        peer, server/handover.py, waits for someone to take its state: those first)."""
        now = get_dht_time()
        found = [
            a
            for a in await self.view.stage(stage)
            if a.state in (PeerState.PAUSED, PeerState.LEAVING) and a.expiration > now and a.peer_id != self.peer_id
        ]
        return sorted(found, key=lambda a: a.state != PeerState.LEAVING)

    @staticmethod
    def _fastest(sources: list[Announcement]) -> list[Announcement]:
        return sorted(sources, key=lambda a: -a.throughput)[:STATE_SOURCES]

    async def _wait_for_sources(self, stage: int) -> list[Announcement]:
        period = self.manifest.network.announce_period
        deadline = time.monotonic() + announcement_lifetime(period)
        while time.monotonic() < deadline:
            await asyncio.sleep(period)
            await self.view.all_stages(force=True)
            if sources := await other_online_peers(self.view, stage, self.peer_id):
                return self._fastest(sources)
        return []

    def _report(
        self,
        server: StageServer,
        source: StateSource,
        peer_id: str,
        counters: dict[str, int],
        seconds: float,
        reason: str,
        behind: int = 0,
    ) -> None:
        server.steps_behind = behind  # announced, so that peer-status can say what was lost
        fields = {"stage": server.stage, "source": str(source), "peer_id": peer_id, "steps_behind": behind}
        fields["online_peers"] = self._online if reason != "resume" else 0
        fields.update(optimizer_steps=counters.get("optimizer_steps", 0))
        fields.update(averaging_round=counters.get("averaging_round", 0), seconds=round(seconds, 2), reason=reason)
        self.on_event(Event(EventKind.STATE_TAKEN, fields))
