"""Which stage this peer serves: the choice on join, balance checks, and moves when the swarm is unbalanced.

The Rebalancer decides and performs moves, nothing more: what the peer shares between its parts (its view of the
swarm, its traffic, its network position, its start time) is the peer's context (swarm/server/context.py), which
the Rebalancer hands on to each StageServer it starts.

The decisions are swarm/balancing/moves.py's pure functions over the peers' announcements; this module does the I/O
around them: it reads the DHT, asks server/measurement.py for throughput and server/takeover.py for the stage's
state, and switches from one StageServer to the next. The order of a join and of a move: docs/ARCHITECTURE.md, "A
peer's life", and docs/BALANCING.md. A peer serves only stages that fit in its memory (swarm/capacity/), measured
once at start, and keeps the activations of as many microbatches as fit beside the stage.

In a swarm with `balancing.spans`, a peer serves a span: as many consecutive stages as its memory holds, each by
a StageServer of its own (its worker, step gate, averaging rounds and state), all behind the peer's one set of RPC
handlers (server/dispatch.py); balancing/spans.py chooses where. One stage is the span of length one, so the join,
the checks and the moves below are the same code for both.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from hivemind.utils import get_dht_time

from swarm.architectures.model import build_stage
from swarm.balancing.moves import PeerLoad, choose_stage, peer_loads, should_move, stage_totals
from swarm.balancing.spans import SpanPeer, better_span, choose_span, span_peers
from swarm.capacity.budget import MemoryBudget, check_fits, usable_budget
from swarm.capacity.costs import MemorySettings, kept_microbatches, span_lengths
from swarm.capacity.plan import stage_work
from swarm.capacity.role import slow_serving_reason
from swarm.dht.records import PeerState
from swarm.errors import BalancingError, CapacityError, ManifestError, PeerStartError, SwarmError, TooSlowToServeError
from swarm.events import Event, EventKind, OnEvent, ignore
from swarm.server.announcer import announced_rate
from swarm.server.context import PeerContext
from swarm.server.measurement import ThroughputMeter
from swarm.server.stage import ServingOptions, StageServer
from swarm.server.takeover import StateTakeover, other_online_peers
from swarm.throughput import Throughput

logger = logging.getLogger(__name__)

JOIN_DELAY = 2.0  # peers wait up to this long before their first look, and again before a move
EMPTY_STAGE_DELAY = 0.5  # ... and before a move that fills a stage nobody holds
DRAIN_TIMEOUT = 30.0


class Rebalancer:
    """Serves one span at a time (one stage, unless the swarm has spans): `servers` are its stages' servers
    (empty until `start`), `server` the first of them; `moves` counts the moves."""

    def __init__(
        self,
        context: PeerContext,
        options: ServingOptions,
        on_switch: Callable[[list[StageServer]], None] = lambda servers: None,
        on_event: OnEvent = ignore,
    ):
        self.context, self.options, self.on_switch, self.on_event = context, options, on_switch, on_event
        self.manifest, self.peer_id = context.manifest, context.peer_id
        self.meter = ThroughputMeter(self.manifest, context.p2p, self.peer_id, context.device, options, context.view)
        self.takeover = StateTakeover(self.manifest, context.p2p, context.view, self.peer_id, on_event)
        self.rng = random.Random()
        self.servers: list[StageServer] = []
        self.moves = 0
        cuda = context.device.type == "cuda"
        self.memory = MemorySettings(offload_optimizer=options.offload_optimizer and cuda, cuda=cuda)
        self.budget: MemoryBudget | None = None  # measured at start
        self.lengths: list[int] = []  # how many stages fit from each start (at most 1 without spans)
        self.work = stage_work(self.manifest)  # each stage's compute, in blocks
        self.per_block: Throughput | None = None  # measured: compute through one block, and the network
        self.moving = asyncio.Lock()  # a balance check's move, one that sheds a stage and a pause never interleave
        self.paused = False  # the owner paused the peer (swarm/peer/pausing.py): no balance checks meanwhile
        self._shortening: asyncio.Task | None = None  # dropping a stage after running out of memory

    @property
    def server(self) -> StageServer | None:
        return self.servers[0] if self.servers else None

    @server.setter
    def server(self, server: StageServer | None) -> None:
        self.servers = [server] if server is not None else []

    @property
    def fitting(self) -> list[int]:
        """The stages this peer's memory holds."""
        return [stage for stage, length in enumerate(self.lengths) if length > 0]

    @property
    def span(self) -> tuple[int, int] | None:
        return (self.servers[0].stage, self.servers[-1].stage + 1) if self.servers else None

    # -------------------------------------------------------------------------------------------- join

    async def start(self, may_train_instead: bool = False) -> StageServer:
        """Choose a span (or take the pinned one), take over its stages' state, and serve them. Raises
        CapacityError if this peer's memory holds no stage (or not the pinned ones); with `may_train_instead` (a CPU
        peer that trains), TooSlowToServeError if it computes too slowly beside the serving peers to help them."""
        self._measure_memory()
        if self.options.stage is not None:
            start, end = self.options.stage, self.options.stage + self.options.span
        else:
            await asyncio.sleep(self.rng.uniform(0, JOIN_DELAY))
            start, end = self._choose(await self._loads())
        servers = await self._prepare(start, end)  # measuring takes a while: peers that started with us announce
        if self.options.stage is None:
            loads = await self._loads()
            if may_train_instead:
                others = [peer.compute for peer in span_peers(loads, self.work, exclude=self.peer_id)]
                reason = slow_serving_reason(self.per_block.compute, others)
                if reason is not None:
                    raise TooSlowToServeError(reason)
            again = self._second_look(loads, start, end)
            if again is not None:
                start, end = again
                logger.info(f"at a second look the swarm is weakest elsewhere; taking {self._describe(again)}")
                servers = await self._prepare(start, end)
        for server in servers:
            await server.join(self.context.dht, self.context.p2p)
        for server in servers:
            if not await self.takeover.into(server, reason="join"):
                for each in servers:
                    await each.shutdown()
                raise PeerStartError(
                    f"could not download the state of stage {server.stage} from any of its online peers; "
                    "check that they are reachable from here, then start again"
                )
        for server in servers:
            await server.start(self.context.view)
        self._switch_to(servers)
        return servers[0]

    def _measure_memory(self) -> None:
        """The memory this peer may use, and how many stages fit from each start; refuses in one line if no stage
        fits (or the pinned ones do not)."""
        manifest, device, options = self.manifest, self.context.device, self.options
        self.budget = budget = usable_budget(device, options.max_memory)
        lengths = span_lengths(manifest, budget.usable, self.memory)
        self.lengths = lengths if manifest.balancing.spans else [min(length, 1) for length in lengths]
        if options.stage is not None:
            fits = lengths[options.stage]  # how many stages from the pinned one fit, spans or not
            if fits < options.span:
                check_fits(manifest, options.stage, budget, self.memory)  # none: the refusal with the numbers
                raise CapacityError(
                    f"stages {options.stage}-{options.stage + options.span - 1} do not fit together: "
                    f"{fits} of them do in {budget.describe()}; pin a shorter --span"
                )
        elif not self.fitting:  # the cheapest stage (a middle one) is refused with the numbers
            check_fits(manifest, min(1, manifest.num_stages - 1), budget, self.memory)
        logger.info(f"memory: {budget.describe()}; stages that fit from each start: {self.lengths}")

    def _me(self) -> SpanPeer:
        """This peer as balancing sees it: its compute through one block and its network (1 and no limit until
        measured: then it takes where the swarm is weakest), and its span."""
        start, end = self.span or (0, 0)
        if self.per_block is None:
            return SpanPeer(self.peer_id, 1.0, float("inf"), start, end)
        return SpanPeer(self.peer_id, self.per_block.compute, self.per_block.network, start, end)

    def _choose(self, loads: list[PeerLoad]) -> tuple[int, int]:
        if not self.manifest.balancing.spans:
            stage = choose_stage(
                loads,
                self.manifest.num_stages,
                self.rng,
                exclude_peer=self.peer_id,
                allowed=self.fitting,
                min_holders=self.manifest.balancing.min_holders,
            )
            return stage, stage + 1
        others = span_peers(loads, self.work, exclude=self.peer_id)
        span = choose_span(self._me(), others, self.lengths, self.work, self.rng, self.manifest.balancing.min_holders)
        assert span is not None, "a peer that holds no stage was refused at start"
        return span

    def _second_look(self, loads: list[PeerLoad], start: int, end: int) -> tuple[int, int] | None:
        """Another span, if the records read after measuring (this peer's own rate now known, peers that started
        with it announced) say the first choice helps the swarm less: a peer that read a swarm half announced would
        otherwise serve a short span where one stage looked empty."""
        if not self.manifest.balancing.spans:
            return None if self._is_bottleneck(loads, start) else self._choose(loads)
        assert self.per_block is not None
        me = SpanPeer(self.peer_id, self.per_block.compute, self.per_block.network, start, end)
        others = span_peers(loads, self.work, exclude=self.peer_id)
        return better_span(me, others, self.lengths, self.work, self.rng, 0.0, self.manifest.balancing.min_holders)

    def _is_bottleneck(self, loads: list[PeerLoad], stage: int) -> bool:
        others = [load for load in loads if load.peer_id != self.peer_id]
        totals = stage_totals(others, self.manifest.num_stages)
        return totals[stage] <= min(totals) * (1 + 1e-9)

    async def _prepare(self, start: int, end: int) -> list[StageServer]:
        """Servers for stages [start, end) with their seed-initialised models; not yet announced. The first stage's
        throughput is measured; every stage of a span announces the span's rate (the peer's device computes them
        all: a microbatch takes the span's blocks' time)."""
        context, budget = self.context, self.budget
        kept = kept_microbatches(self.manifest, start, end, budget.usable, self.memory) if budget is not None else None
        models = [build_stage(self.manifest, stage).to(context.device) for stage in range(start, end)]
        measured = await self.meter.measure(start, models[0])
        self.per_block = Throughput(measured.compute * self.work[start], measured.network)
        throughput = measured if end - start == 1 else self._span_rate(start, end)
        return [
            StageServer(
                self.manifest,
                stage,
                model,
                context.device,
                self.peer_id,
                throughput,
                self.options,
                simulated=self.meter.simulated.get(start),
                started=context.started,
                traffic=context.traffic,
                on_event=self.on_event,
                position=context.position,
                kept_microbatches=kept,
                dispatcher=context.stages,
            )
            for stage, model in zip(range(start, end), models)
        ]

    def _span_rate(self, start: int, end: int) -> Throughput:
        assert self.per_block is not None
        return Throughput(self.per_block.compute / sum(self.work[start:end]), self.per_block.network)

    # ---------------------------------------------------------------------------------------- moves

    async def run(self, stop: asyncio.Event) -> None:
        """Check the balance at random intervals until `stop` is set; move when the check says so. A pinned
        peer never moves, but still replaces the assumed bandwidth by a measurement once it can. Between two
        checks it looks at the cached records every announce period: a stage that nobody holds any more (its
        only peer vanished, or leaves and waits for someone to take its state: server/handover.py) is checked
        for at once, not at the next check."""
        period, look = self.manifest.balancing.check_period, self.manifest.network.announce_period
        next_check = time.monotonic() + period * self.rng.uniform(0.5, 1.5)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, min(next_check - time.monotonic(), look)))
                return
            except TimeoutError:
                pass
            if self.paused:
                continue
            if time.monotonic() < next_check and not await self._stage_is_empty():
                continue
            next_check = time.monotonic() + period * self.rng.uniform(0.5, 1.5)
            try:
                if self.options.stage is not None:
                    if self.meter.network_is_assumed:
                        await self._refresh_network_figure()
                    continue
                target = await self.check()
                if target is not None and not stop.is_set():
                    await self.move(*target)
            except BalancingError as e:  # records that make no sense (a throughput of NaN): not a reason to stop
                logger.warning(f"balance check failed: {e!r}")
            except SwarmError:
                raise  # serving nothing at all: swarm-peer stops with the error
            except Exception as e:  # a failed check, or a move called off: the peer goes on serving
                logger.warning(f"balance check failed: {e!r}")

    async def _stage_is_empty(self) -> bool:
        """Whether some stage has no online or joining peer in the cached records (a movable peer only)."""
        if self.options.stage is not None:
            return False
        try:
            loads = await self._loads(force=False)
        except Exception as e:  # a DHT timeout: the regular check will look again
            logger.debug(f"reading the records failed: {e!r}")
            return False
        return bool(unheld(loads, range(self.manifest.num_stages)))

    async def check(self) -> tuple[int, int] | None:
        """The span (start, end) to move to, if the balance says so at two looks a short random time apart."""
        assert self.server is not None
        if self.meter.network_is_assumed and not await self._stage_is_empty():  # (a measurement takes seconds)
            await self._refresh_network_figure()
        # checks are frequent and cheap: they read the cached records; only a decision to move reads them afresh
        loads = await self._loads(force=False)
        target = self._target(loads)
        if target is None:
            return None
        # a stage nobody holds stalls every route: its movers wait least (a second one becomes its spare holder)
        await asyncio.sleep(self.rng.uniform(0, EMPTY_STAGE_DELAY if unheld(loads, range(*target)) else JOIN_DELAY))
        return target if self._target(await self._loads()) == target else None

    def _target(self, loads: list[PeerLoad]) -> tuple[int, int] | None:
        min_gain, min_holders = self.manifest.balancing.min_gain, self.manifest.balancing.min_holders
        if not self.manifest.balancing.spans:
            stage = should_move(self.peer_id, loads, self.manifest.num_stages, min_gain, min_holders)
            # a stage its memory cannot hold is not a move
            return (stage, stage + 1) if stage is not None and stage in self.fitting else None
        others = span_peers(loads, self.work, exclude=self.peer_id)
        return better_span(self._me(), others, self.lengths, self.work, self.rng, min_gain, min_holders)

    async def move(self, start: int, end: int | None = None) -> bool:
        """Move to stages [start, end) (one stage if `end` is None; see the module's docstring): the stages it does
        not serve yet are taken over first, then it leaves the ones it no longer serves. False if called off."""
        async with self.moving:
            if self.paused:  # decided before the owner paused the peer
                return False
            return await self._move(start, end)

    def shorten_span(self) -> bool:
        """Out of memory with the fewest kept microbatches (server/shedding.py): drop the span's last stage in the
        background (a move, called off if this peer is that stage's last online one); balancing keeps it shorter.
        False if it cannot now: it serves one stage, or a shortening is under way."""
        if self.span is None or len(self.servers) < 2 or (self._shortening and not self._shortening.done()):
            return False
        self._shortening = asyncio.ensure_future(self._shorten(*self.span))
        return True

    async def _shorten(self, start: int, end: int) -> None:
        async with self.moving:
            if self.span != (start, end):  # it moved meanwhile: the new span is another question
                return
            try:
                shorter = await self._move(start, end - 1)
            except Exception as e:  # the peer goes on serving its span, answering what runs out 'busy'
                logger.warning(f"dropping stage {end - 1} after running out of memory failed: {e!r}")
                return
        if shorter:  # what its memory was measured to hold at start, it did not: balancing keeps it shorter
            self.lengths = [min(length, end - 1 - start) for length in self.lengths]

    async def _move(self, start: int, end: int | None = None) -> bool:
        end = start + 1 if end is None else end
        old = {server.stage: server for server in self.servers}
        assert old, "start first"
        before = self.span
        target = "stage" + (f" {start}" if end - start == 1 else f"s {start}-{end - 1}")
        logger.info(f"moving from {self._describe(before)} to {target}")
        new: list[StageServer] = []
        for stage in range(start, end):
            if stage not in old:
                new += await self._prepare_one(stage, start, end)
        leaving = [server for stage, server in old.items() if not start <= stage < end]
        try:
            for server in new:
                await server.join(self.context.dht, self.context.p2p)
                # a target without online peers has lost its state anyway (they all died): start it afresh
                try:
                    taken = await self.takeover.into(server, reason="move")
                except ManifestError as e:  # e.g. a stage would start from a pretrained folder this machine lacks
                    logger.warning(f"move to {target} called off: {e}")
                    taken = None
                if not taken:
                    if taken is not None:
                        logger.warning(f"move to {target} called off: no peer of stage {server.stage} gave its state")
                    await _shutdown(new)
                    return False
            # plans chain moves (A goes to T, so B may leave T for U): never leave a stage before the peer that
            # replaces us is online, or T's trained state would go with us (the records were just read afresh)
            for server in leaving:
                if not await other_online_peers(self.context.view, server.stage, self.peer_id):
                    logger.warning(f"move to {target} called off: this peer is the last one of stage {server.stage}")
                    await _shutdown(new)
                    return False
        except BaseException:
            await _shutdown(new)
            raise
        # The old stages announce that they stop at once (no peer may count on them any more), but drain while the
        # new ones start serving: a microbatch in flight through an old stage may wait for one of the new ones (its
        # only holder vanished, which is why this peer moves there).
        drains = [asyncio.ensure_future(server.drain(DRAIN_TIMEOUT)) for server in leaving]
        try:
            for server in new:
                await server.start(self.context.view)
        except Exception as e:
            await _shutdown(new)
            await asyncio.gather(*drains)
            raise SwarmError(f"after leaving {self._describe(before)}, serving {target} failed: {e!r}") from e
        await asyncio.gather(*drains)
        for server in leaving:
            await server.shutdown()
        servers = sorted([s for s in self.servers if start <= s.stage < end] + new, key=lambda s: s.stage)
        if self.manifest.balancing.spans:
            for server in servers:  # the span's length changed: so did its rate
                server.throughput = self._span_rate(start, end)
        self._switch_to(servers)
        self.moves += 1
        logger.info(f"now serving {target} ({servers[0].throughput.serving:.1f} samples/s)")
        details = {"from_stage": before[0] if before else None, "to_stage": start}
        if self.manifest.balancing.spans:
            details.update(from_span=list(before) if before else None, to_span=[start, end])
        self.on_event(Event(EventKind.MOVED, details))
        return True

    async def _prepare_one(self, stage: int, start: int, end: int) -> list[StageServer]:
        """A server for one stage of the span [start, end) this peer moves to."""
        (server,) = await self._prepare(stage, stage + 1)
        if end - start > 1:
            server.throughput = self._span_rate(start, end)
        return [server]

    @staticmethod
    def _describe(span: tuple[int, int] | None) -> str:
        if span is None:
            return "nothing"
        start, end = span
        return f"stage {start}" if end - start == 1 else f"stages {start}-{end - 1}"

    async def _refresh_network_figure(self) -> None:
        """Replace the assumed default bandwidth by a measurement once another peer is there."""
        assert self.server is not None and self.per_block is not None
        network = await self.meter.network_figure(self.server.stage)
        if network is not None:
            self.per_block = Throughput(self.per_block.compute, network)
            start, end = self.span or (0, 1)
            for server in self.servers:
                server.throughput = self._span_rate(start, end)

    async def _loads(self, force: bool = True) -> list[PeerLoad]:
        """Balancing's picture of the swarm: fresh from the DHT if `force`, else at most an announce period old."""
        loads = peer_loads(await self.context.view.all_stages(force=force), get_dht_time())
        online = [server for server in self.servers if server.state == PeerState.ONLINE]
        if online:
            # this peer's own records in the DHT may be a few seconds old: use the truth
            loads = [load for load in loads if load.peer_id != self.peer_id]
            for server in online:
                throughput = announced_rate(server.throughput.serving)  # exactly what others read
                loads.append(PeerLoad(self.peer_id, server.stage, throughput, True, not server.pinned))
        return loads

    def _switch_to(self, servers: list[StageServer]) -> None:
        self.servers = servers
        for server in servers:
            server.memory_available = self.budget.limit if self.budget is not None else 0
            server.shorten_span = self.shorten_span if len(servers) > 1 else None  # a stage that runs out of memory
        self.on_switch(servers)

    async def shutdown(self) -> None:
        if self._shortening is not None:
            self._shortening.cancel()
        await _shutdown(self.servers)


def unheld(loads: list[PeerLoad], stages: range) -> list[int]:
    """The stages among `stages` that no online or joining peer holds in `loads`."""
    held = {load.stage for load in loads}
    return [stage for stage in stages if stage not in held]


async def _shutdown(servers: list[StageServer]) -> None:
    for server in servers:
        await server.shutdown()
