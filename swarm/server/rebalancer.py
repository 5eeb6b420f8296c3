"""Which stage this peer serves: the choice on join, balance checks, and moves when the swarm is unbalanced.

The Rebalancer decides and performs moves, nothing more: what the peer shares between its parts (its view of the
swarm, its traffic, its network position, its start time) is the peer's context (swarm/peer/context.py), which
the Rebalancer hands on to each StageServer it starts.

The decisions are swarm/balancing/moves.py's pure functions over the peers' announcements; this module does the I/O
around them: it reads the DHT, asks server/measurement.py for throughput and server/takeover.py for the stage's
state, and switches from one StageServer to the next. The order of a join and of a move (a move downloads the
target's state before it leaves the old stage, and is called off if it cannot): docs/ARCHITECTURE.md,
"One peer" and "Balancing". A peer serves only stages that fit in its memory (swarm/capacity/): it measures it once,
at start, and keeps the activations of as many microbatches as fit beside the stage.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from hivemind.utils import get_dht_time

from swarm.architectures.model import build_stage
from swarm.balancing.moves import PeerLoad, choose_stage, peer_loads, should_move, stage_totals
from swarm.capacity.budget import MemoryBudget, check_fits, usable_budget
from swarm.capacity.costs import MemorySettings, kept_microbatches, longest_span
from swarm.dht.records import PeerState
from swarm.errors import BalancingError, ManifestError, PeerStartError, SwarmError
from swarm.events import Event, EventKind, OnEvent, ignore
from swarm.peer.context import PeerContext
from swarm.server.announcer import announced_rate
from swarm.server.measurement import ThroughputMeter
from swarm.server.stage import ServingOptions, StageServer
from swarm.server.takeover import StateTakeover, other_online_peers
from swarm.throughput import Throughput

logger = logging.getLogger(__name__)

JOIN_DELAY = 2.0  # peers wait up to this long before their first look, and again before a move
DRAIN_TIMEOUT = 30.0


class Rebalancer:
    """Serves one stage at a time: `server` is the current one (None until `start`), `moves` counts the moves."""

    def __init__(
        self,
        context: PeerContext,
        options: ServingOptions,
        on_switch: Callable[[StageServer], None] = lambda server: None,
        on_event: OnEvent = ignore,
    ):
        self.context, self.options, self.on_switch, self.on_event = context, options, on_switch, on_event
        self.manifest, self.peer_id = context.manifest, context.peer_id
        self.meter = ThroughputMeter(self.manifest, context.p2p, self.peer_id, context.device, options, context.view)
        self.takeover = StateTakeover(self.manifest, context.p2p, context.view, self.peer_id, on_event)
        self.rng = random.Random()
        self.server: StageServer | None = None
        self.moves = 0
        self.memory = MemorySettings(cuda=context.device.type == "cuda")
        self.budget: MemoryBudget | None = None  # measured at start
        self.fitting: list[int] = []  # the stages this peer's memory holds

    # -------------------------------------------------------------------------------------------- join

    async def start(self) -> StageServer:
        """Choose a stage (or take the pinned one), take over its state, and serve it. Raises CapacityError if this
        peer's memory holds no stage (or not the pinned one)."""
        self._measure_memory()
        if self.options.stage is not None:
            stage = self.options.stage
        else:
            await asyncio.sleep(self.rng.uniform(0, JOIN_DELAY))
            stage = self._choose(await self._loads())
        server = await self._prepare(stage)  # measuring takes a while: peers that started with us announce meanwhile
        if self.options.stage is None:
            loads = await self._loads()
            if not self._is_bottleneck(loads, stage):
                stage = self._choose(loads)
                logger.info(f"at a second look another stage is the bottleneck; taking stage {stage}")
                server = await self._prepare(stage)
        await server.join(self.context.dht, self.context.p2p)
        if not await self.takeover.into(server, reason="join"):
            await server.shutdown()
            raise PeerStartError(
                f"could not download the state of stage {server.stage} from any of its online peers; "
                "check that they are reachable from here, then start again"
            )
        await server.start(self.context.view)
        self._switch_to(server)
        return server

    def _measure_memory(self) -> None:
        """The memory this peer may use, and the stages that fit in it; refuses in one line if none does."""
        manifest, device = self.manifest, self.context.device
        self.budget = budget = usable_budget(device, self.options.max_memory)
        self.fitting = [s for s in range(manifest.num_stages) if longest_span(manifest, s, budget.usable, self.memory)]
        if self.options.stage is not None or not self.fitting:  # the pinned stage, or the cheapest one: refused
            cheapest = self.options.stage if self.options.stage is not None else min(1, manifest.num_stages - 1)
            check_fits(manifest, cheapest, budget, self.memory)
        logger.info(f"memory: {budget.describe()}; stages that fit: {self.fitting}")

    def _choose(self, loads: list[PeerLoad]) -> int:
        return choose_stage(loads, self.manifest.num_stages, self.rng, exclude_peer=self.peer_id, allowed=self.fitting)

    def _is_bottleneck(self, loads: list[PeerLoad], stage: int) -> bool:
        others = [load for load in loads if load.peer_id != self.peer_id]
        totals = stage_totals(others, self.manifest.num_stages)
        return totals[stage] <= min(totals) * (1 + 1e-9)

    async def _prepare(self, stage: int) -> StageServer:
        """A server for `stage` with its seed-initialised model and measured throughput; not yet announced."""
        context = self.context
        kept = None
        if self.budget is not None:
            kept = kept_microbatches(self.manifest, stage, stage + 1, self.budget.usable, self.memory)
        model = build_stage(self.manifest, stage).to(context.device)
        throughput = await self.meter.measure(stage, model)
        return StageServer(
            self.manifest,
            stage,
            model,
            context.device,
            self.peer_id,
            throughput,
            self.options,
            simulated=self.meter.simulated.get(stage),
            started=context.started,
            traffic=context.traffic,
            on_event=self.on_event,
            position=context.position,
            kept_microbatches=kept,
        )

    # ---------------------------------------------------------------------------------------- moves

    async def run(self, stop: asyncio.Event) -> None:
        """Check the balance at random intervals until `stop` is set; move when the check says so. A pinned
        peer never moves, but still replaces the assumed bandwidth by a measurement once it can."""
        period = self.manifest.balancing.check_period
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=period * self.rng.uniform(0.5, 1.5))
                return
            except TimeoutError:
                pass
            try:
                if self.options.stage is not None:
                    if self.meter.network_is_assumed:
                        await self._refresh_network_figure()
                    continue
                target = await self.check()
                if target is not None and not stop.is_set():
                    await self.move(target)
            except BalancingError as e:  # records that make no sense (a throughput of NaN): not a reason to stop
                logger.warning(f"balance check failed: {e!r}")
            except SwarmError:
                raise  # serving nothing at all: swarm-peer stops with the error
            except Exception as e:  # a failed check, or a move called off: the peer goes on serving
                logger.warning(f"balance check failed: {e!r}")

    async def check(self) -> int | None:
        """The stage to move to, if the balance says so at two looks a short random time apart."""
        assert self.server is not None
        if self.meter.network_is_assumed:
            await self._refresh_network_figure()
        # checks are frequent and cheap: they read the cached records; only a decision to move reads them afresh
        target = should_move(
            self.peer_id, await self._loads(force=False), self.manifest.num_stages, self.manifest.balancing.min_gain
        )
        if target is None or target not in self.fitting:  # a stage its memory cannot hold is not a move
            return None
        await asyncio.sleep(self.rng.uniform(0, JOIN_DELAY))
        again = should_move(
            self.peer_id, await self._loads(), self.manifest.num_stages, self.manifest.balancing.min_gain
        )
        return target if again == target else None

    async def move(self, target: int) -> bool:
        """Move to `target` (see the module's docstring); False if the move was called off."""
        old = self.server
        assert old is not None
        logger.info(f"moving from stage {old.stage} to stage {target}")
        new = await self._prepare(target)
        try:
            await new.join(self.context.dht, self.context.p2p)
            # a target without online peers has lost its state anyway (they all died): start it afresh
            try:
                taken = await self.takeover.into(new, reason="move")
            except ManifestError as e:  # e.g. the stage would start from a pretrained folder this machine lacks
                logger.warning(f"move to stage {target} called off: {e}")
                await new.shutdown()
                return False
            if not taken:
                logger.warning(f"move to stage {target} called off: none of its peers could give its state")
                await new.shutdown()
                return False
            # plans chain moves (A goes to T, so B may leave T for U): never leave a stage before the peer that
            # replaces us is online, or T's trained state would go with us (the records were just read afresh)
            if not await other_online_peers(self.context.view, old.stage, self.peer_id):
                logger.warning(f"move to stage {target} called off: this peer is the last one of stage {old.stage}")
                await new.shutdown()
                return False
        except BaseException:
            await new.shutdown()
            raise
        await old.drain(DRAIN_TIMEOUT)
        await old.shutdown()
        try:
            await new.start(self.context.view)
        except Exception as e:
            await new.shutdown()
            raise SwarmError(f"after leaving stage {old.stage}, serving stage {target} failed: {e!r}") from e
        self._switch_to(new)
        self.moves += 1
        logger.info(f"now serving stage {target} ({new.throughput.serving:.1f} samples/s)")
        self.on_event(Event(EventKind.MOVED, {"from_stage": old.stage, "to_stage": target}))
        return True

    async def _refresh_network_figure(self) -> None:
        """Replace the assumed default bandwidth by a measurement once another peer is there."""
        assert self.server is not None
        network = await self.meter.network_figure(self.server.stage)
        if network is not None:
            self.server.throughput = Throughput(self.server.throughput.compute, network)

    async def _loads(self, force: bool = True) -> list[PeerLoad]:
        """Balancing's picture of the swarm: fresh from the DHT if `force`, else at most an announce period old."""
        loads = peer_loads(await self.context.view.all_stages(force=force), get_dht_time())
        if self.server is not None and self.server.state == PeerState.ONLINE:
            # this peer's own record in the DHT may be a few seconds old: use the truth
            loads = [load for load in loads if load.peer_id != self.peer_id]
            throughput = announced_rate(self.server.throughput.serving)  # exactly what others read
            loads.append(PeerLoad(self.peer_id, self.server.stage, throughput, True, not self.server.pinned))
        return loads

    def _switch_to(self, server: StageServer) -> None:
        self.server = server
        self.on_switch(server)

    async def shutdown(self) -> None:
        if self.server is not None:
            await self.server.shutdown()
