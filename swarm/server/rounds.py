"""When a served stage averages with the stage's other peers, and catching up with rounds it missed.

Every ROUND_CHECK_PERIOD seconds the stage looks at its peers' announcements: once the stage has served
`averaging.every_samples` samples in the current round, counted over everyone's announcements
(swarm/averaging/rules.py's pure functions), it takes part in a round. The math of a round is swarm/averaging/rules.py's, the
hivemind averager swarm/averaging/averager.py's; the model's side of a round runs in the stage's worker
(server/compute.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.averaging.averager import StageAverager
from swarm.averaging.rules import (
    ProgressSeen,
    RoundProgress,
    current_round,
    progress_seen,
    round_payload_bytes,
    swarm_samples_in_round,
)
from swarm.client.rpc import download_state, state_deadline
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import PeerState, announcement_lifetime
from swarm.errors import AveragingError
from swarm.events import Event, EventKind, OnEvent, RoundOutcome, StateSource
from swarm.manifests.manifest import Manifest
from swarm.server.step_gate import StepGate
from swarm.server.worker import StageWorker
from swarm.watch.stats import Traffic
from swarm.wire.state import stage_state_shapes

logger = logging.getLogger(__name__)

STATE_SOURCES = 3  # peers tried, one after another, for a stage's state
CATCH_UP_BY_DOWNLOAD = 2  # rounds behind the stage from which a peer takes the stage's state (parameters mode)
ROUND_CHECK_PERIOD = 1.0  # seconds between two looks at whether an averaging round is due
NEAR_ROUND = 0.75  # past this share of a round's samples, those looks read fresh records
CATCH_UP_FLOOR = 60.0  # seconds, plus the state's bytes at MIN_STATE_RATE (client/rpc.py's state_deadline)
ALONE_AFTER_LIFETIMES = 2  # a peer is alone once no other peer of the stage was seen for this many record lifetimes


@dataclass
class RoundCounters:
    """Where this peer stands in its stage's averaging (the round's number travels with the state: it is in
    ComputeCounters)."""

    round_started_at: int = 0  # samples_served when the current round's count began
    weight_started_at: int = 0  # samples_served at this peer's last successful round (its weight counts from here)
    rounds: int = 0  # rounds averaged with at least one other peer
    failed: int = 0  # rounds that did not happen (no group, a peer left, a timeout)
    last_group_size: int = 0


class AveragingRounds:
    """One served stage's rounds, counted in `counters` (the server's, which it reports). `announce` refreshes
    the peer's record (others join a due round sooner)."""

    def __init__(
        self,
        manifest: Manifest,
        stage: int,
        peer_id: str,
        worker: StageWorker,
        averager: StageAverager,
        traffic: Traffic,
        counters: RoundCounters,
        announce: Callable[[], Awaitable[None]],
        on_event: OnEvent,
        gate: StepGate | None = None,
    ):
        self.manifest, self.stage, self.peer_id = manifest, stage, peer_id
        self.gate = gate  # the stage's step gate: a round is applied between two steps (server/step_gate.py)
        self.worker, self.averager, self.traffic, self.counters = worker, averager, traffic, counters
        self.announce, self.on_event = announce, on_event
        self.active = True  # False while the owner has the peer paused (server/stage.py: no rounds then)
        self._view: AnnouncementCache | None = None
        self._p2p: P2P | None = None
        self._last_seen: dict[str, float] = {}  # peer id -> DHT time this peer last saw it online in the stage
        self._progress: dict[str, ProgressSeen] = {}  # peer id -> its last announced round progress

    def _between_steps(self) -> AbstractAsyncContextManager:
        """No microbatch in flight through this stage while the round changes its weights (with a step gate)."""
        if self.gate is None:
            return nullcontext()
        timeouts = self.manifest.training.timeouts
        return self.gate.between_steps(timeouts.forward + timeouts.backward)

    @property
    def round(self) -> int:
        return self.worker.counters.averaging_round

    def round_samples(self) -> int:
        return self.worker.counters.samples_served - self.counters.round_started_at

    async def run(self, dht: DHT, p2p: P2P, view: AnnouncementCache | None) -> None:
        """Take part in the stage's rounds, whenever one is due; a failed round is logged and skipped."""
        self._p2p = p2p
        self._view = view or AnnouncementCache(
            dht, self.manifest.swarm_id, self.manifest.num_stages, self.manifest.network.announce_period
        )
        while True:
            await asyncio.sleep(ROUND_CHECK_PERIOD)
            if not self.active:  # paused by its owner: its state is parked, it catches up on resuming
                continue
            try:
                await self._check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never fatal: serving goes on
                logger.warning(f"averaging round check failed: {e!r}")

    async def _check(self) -> None:
        target = self.manifest.averaging.every_samples
        others = await self._round_progress_of_others()
        stage_round = current_round(self.round, others)
        if stage_round > self.round:  # others averaged without us
            await self._catch_up(stage_round, [o.peer_id for o in others if o.round == stage_round])
            return
        mine, horizon = self.round_samples(), self.manifest.network.announce_period
        total = swarm_samples_in_round(self.round, mine, others, horizon)
        if NEAR_ROUND * target <= total < target:  # close: look at fresh records, to meet the others in time
            others = await self._round_progress_of_others(fresh=True)
            total = swarm_samples_in_round(self.round, mine, others, horizon)
        if total >= target:
            await self.average_round(alone=self._alone())

    def _alone(self) -> bool:
        """No other peer of the stage seen online for a while. A record that lapsed for a moment (a loaded peer
        announces late, a DHT read failed) does not make a peer alone: a round alone in diloco mode moves the
        stage's round on and the others catch up, so a false 'alone' costs them (rounds.py, _catch_up)."""
        now = get_dht_time()
        window = ALONE_AFTER_LIFETIMES * announcement_lifetime(self.manifest.network.announce_period)
        return not any(now - seen < window for seen in self._last_seen.values())

    async def _round_progress_of_others(self, fresh: bool = False) -> list[RoundProgress]:
        assert self._view is not None
        now, lifetime = get_dht_time(), announcement_lifetime(self.manifest.network.announce_period)
        online = []
        for a in await self._view.stage(self.stage, force=fresh):
            if a.peer_id == self.peer_id:
                continue
            if a.state == PeerState.ONLINE and a.expiration > now:
                online.append(a)
                self._last_seen[a.peer_id] = now
            elif a.state != PeerState.ONLINE:  # it said it leaves (or moves): it is not waited for
                self._last_seen.pop(a.peer_id, None)
        # kept for the online peers only (a SIGKILLed peer's record just expires): a peer missed by one read
        # starts again at rate 0, which makes a round due a little later, never too early
        self._progress = {
            a.peer_id: progress_seen(
                self._progress.get(a.peer_id), a.averaging_round, a.round_samples, a.expiration - lifetime
            )
            for a in online
        }
        return [
            RoundProgress(seen.round, seen.samples, seen.rate, now - seen.announced_at, peer_id)
            for peer_id, seen in self._progress.items()
        ]

    async def _catch_up(self, stage_round: int, ahead: list[str]) -> None:
        """This peer missed rounds (it was alone, busy, or its round failed while others' succeeded). In parameters
        mode, one round behind, it just counts from the stage's round on: the next round pulls it back to the
        others; further behind (e.g. restarted from an old checkpoint), it takes the stage's state from a peer at
        that round, since averaging with parameters that far apart would move it too far at once (and rounds that
        move parameters by more than their norm are dropped). In diloco mode the replicas must share one anchor:
        one round behind, it takes the stage's anchor and outer momentum and keeps its own local steps on top
        (they go into its next pseudo-gradient: dropping them throws away a replica's work at every round it
        misses); further behind, the whole state."""

        behind = stage_round - self.round
        served = self.worker.counters.samples_served
        diloco = self.manifest.averaging.mode == "diloco"
        if not diloco and behind < CATCH_UP_BY_DOWNLOAD:
            logger.info(f"stage {self.stage} is at averaging round {stage_round}; catching up")
            await self.worker.run(lambda c: c.set_round(stage_round))
            self.counters.round_started_at = served
            self._report(stage_round - 1, RoundOutcome.CAUGHT_UP, 0, 0.0)
            return
        # DiLoCo one round behind: the stage's anchor and momentum, with this peer's local steps kept on top
        rebase = diloco and behind == 1
        assert self._p2p is not None
        shapes = stage_state_shapes(self.manifest, self.stage)
        for peer_id in ahead[:STATE_SOURCES]:
            try:
                begin = time.monotonic()
                items, counters = await download_state(
                    self._p2p, peer_id, self.manifest, self.stage, shapes, state_deadline(shapes, CATCH_UP_FLOOR)
                )
                if rebase:  # noqa: B023 below: each lambda is awaited at once
                    await self.worker.run(lambda c: c.rebase(items, counters))  # noqa: B023
                else:
                    await self.worker.run(lambda c: c.load_state(items, counters))  # noqa: B023
            except Exception as e:  # that peer may be gone or busy: try another, or again at the next look
                logger.warning(f"taking the state of stage {self.stage} from {peer_id[-8:]} failed: {e!r}")
                continue
            self.counters.round_started_at = self.worker.counters.samples_served
            if rebase:  # the local steps are kept: they count towards this peer's weight in its next round
                logger.info(
                    f"stage {self.stage} is at averaging round {stage_round}: took its anchor from peer "
                    f"{peer_id[-8:]} and kept this peer's local steps on top of it"
                )
            else:
                self.counters.weight_started_at = self.worker.counters.samples_served
                logger.info(
                    f"stage {self.stage} is at averaging round {stage_round}: took its state from peer "
                    f"{peer_id[-8:]} (this peer was {behind} rounds behind; its local steps since its last round "
                    "are dropped)"
                )
            self.on_event(
                Event(
                    EventKind.STATE_TAKEN,
                    {
                        "stage": self.stage,
                        "source": str(StateSource.PEER),
                        "peer_id": peer_id,
                        "optimizer_steps": counters["optimizer_steps"],
                        "averaging_round": counters["averaging_round"],
                        "seconds": round(time.monotonic() - begin, 2),
                        "reason": "rebase" if rebase else "catch_up",
                    },
                )
            )
            return

    async def average_round(self, alone: bool = False) -> bool:
        """One round: contribute, all-reduce with whoever of the stage joins, apply. True if averaged with others.

        Alone (no other online peer of the stage) there is nobody to average with: the round is skipped, except
        for DiLoCo's outer step, which is applied to this peer's own pseudo-gradient. A failed round leaves the
        model and the round number as they were (the peer catches up if the others' round succeeded)."""
        loop = asyncio.get_running_loop()
        number, counters = self.round, self.counters
        begin_served = self.worker.counters.samples_served
        weight = max(begin_served - counters.weight_started_at, 1)
        averager = self.averager if not alone or self.averager.diloco else None  # alone: only DiLoCo acts
        averaged, outcome, size = False, RoundOutcome.ALONE, 0
        if averager is not None:
            if not alone:  # tell the others at once that the round is due here: they join sooner
                try:
                    await self.announce()
                except Exception as e:
                    logger.debug(f"announcing a round failed: {e!r}")
            await self.worker.run(lambda c: c.begin_round())
            try:
                if alone:
                    raise AveragingError("no other peer serves this stage")
                begin = time.monotonic()
                size = await loop.run_in_executor(None, averager.run_round, weight)
                averaged = True
                payload = round_payload_bytes(averager.numels, self.manifest.averaging.compression, size)
                self.traffic.averaging_sent += payload
                self.traffic.averaging_received += payload
                counters.last_group_size = size
                logger.info(
                    f"averaging round {number} of stage {self.stage}: {size} peers, weight {weight}, "
                    f"{payload / 1e6:.2f} MB sent, {time.monotonic() - begin:.1f}s (group found in "
                    f"{averager.last_matchmaking_seconds:.1f}s, all-reduce {averager.last_allreduce_seconds:.1f}s)"
                )
            except AveragingError as e:
                if not alone:
                    counters.failed += 1
                    outcome = RoundOutcome.SKIPPED
                    logger.warning(f"averaging round {number} of stage {self.stage} skipped: {e}")
            try:
                async with self._between_steps():
                    await self.worker.run(lambda c: c.finish_round(averaged, alone))
            except AveragingError as e:
                averaged = False
                counters.failed += 1
                outcome = RoundOutcome.DROPPED
                logger.warning(f"averaging round {number} of stage {self.stage} dropped: {e}")
            if averaged:
                counters.rounds += 1
                counters.weight_started_at = begin_served
                outcome = RoundOutcome.APPLIED
                logger.info(f"round {number} of stage {self.stage} applied: moved by {averager.last_change:.2%}")
        # the next count starts now (samples served during the round belong to it); after a failed round, with the
        # same round number
        if averaged or alone:
            await self.worker.run(lambda c: c.set_round(number + 1))
        counters.round_started_at = begin_served
        change = averager.last_change if averaged and averager is not None else 0.0
        seconds = (averager.last_matchmaking_seconds, averager.last_allreduce_seconds) if averaged else (0.0, 0.0)
        self._report(number, outcome, size if averaged else 0, change, *seconds)
        return averaged

    def _report(
        self,
        number: int,
        outcome: RoundOutcome,
        group_size: int,
        change: float,
        matchmaking_seconds: float = 0.0,
        allreduce_seconds: float = 0.0,
    ) -> None:
        fields = {"stage": self.stage, "round": number, "outcome": str(outcome), "group_size": group_size}
        fields["change"] = round(float(change), 6)
        fields["matchmaking_seconds"] = round(matchmaking_seconds, 3)
        fields["allreduce_seconds"] = round(allreduce_seconds, 3)
        self.on_event(Event(EventKind.AVERAGING_ROUND, fields))
