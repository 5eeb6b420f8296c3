"""One peer of a swarm, as a `swarm-peer` process runs it: its context and its parts, started and stopped in order.

The Peer owns the peer-wide context (swarm/server/context.py: identity, swarm view, traffic, network position, start
time) and hands it to its parts: the reachability service (it answers other peers' "can you dial me?"), a reverse
connector when others cannot dial this peer, the pinger (which keeps the network position), the Prometheus metrics
endpoint if asked for, the rebalancer (which serves a stage and moves between stages) and the trainer. The program
(peers/swarm_peer.py) parses flags, prints, and calls `start_services`, `join`, `check`, `snapshot` and `shutdown`;
everything else the peer reports comes back through callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from swarm.client.checks import CHECK_FRACTION
from swarm.client.pinger import Pinger
from swarm.client.rpc import tokenizer_from_peers
from swarm.client.trainer import Trainer
from swarm.dataset import tokenizer_source
from swarm.dataset.cache import DEFAULT_CAP, ChunkCache
from swarm.dataset.fetching import ChunkFetcher, PeerSource
from swarm.dataset.opening import open_data
from swarm.dataset.sharing import DataService
from swarm.dataset.stream import ChunkStream
from swarm.dataset.tokenizer import Tokenizer
from swarm.dht.records import PeerState
from swarm.errors import CapacityError, TooSlowToServeError
from swarm.events import Event, EventKind, OnEvent, ignore
from swarm.manifests.manifest import Manifest
from swarm.server import handover
from swarm.server.backups import StageBackups
from swarm.server.checkpoint_sharing import CheckpointAnnouncer, CheckpointService
from swarm.server.context import PeerContext
from swarm.server.reachability import ReachabilityService, ReverseConnector
from swarm.server.rebalancer import Rebalancer
from swarm.server.stage import ServingOptions, StageServer
from swarm.throughput import device_name
from swarm.trust.signing import rejected_records, rejected_records_soon
from swarm.watch.metrics import MetricsServer, PeerInfo, start_metrics_server
from swarm.watch.stats import PeerSnapshot

logger = logging.getLogger(__name__)

CONNECT_PERIOD = 5.0  # seconds between a peer's looks for peers to connect to, when others cannot dial it
REFUSED_RECORDS_TIMEOUT = 2.0  # seconds the status line waits for the DHT's count of refused records
PAUSE_DRAIN_TIMEOUT = 30.0  # seconds a pausing peer waits for the microbatches in flight
DATA_LOOK_PERIOD = 5.0  # seconds between a trainer's reads of the others' data progress, at least


@dataclass(frozen=True)
class TrainingOptions:
    """Whether and how the peer trains (swarm-peer's --trainer, --data, --seed)."""

    enabled: bool = True
    data: str | None = None  # a text file or folder instead of the manifest's data source
    data_cache: int = DEFAULT_CAP  # bytes of verified chunks this machine keeps (--data-cache)
    seed: int | None = None  # of the trainer's data order; None: its peer id's order
    only: bool = False  # train only, serve no stage (--trainer-only)
    check_fraction: float = CHECK_FRACTION  # of microbatches sent twice to catch wrong results (client/checks.py)


class Peer:
    """One peer: `context` is what its parts share, `rebalancer` serves its stage, `trainer` (once it trains) feeds
    microbatches through the swarm, `metrics` (if asked for) serves its Prometheus endpoint."""

    def __init__(
        self,
        manifest: Manifest,
        dht: DHT,
        p2p: P2P,
        device: torch.device,
        serving: ServingOptions,
        training: TrainingOptions = TrainingOptions(),
        on_switch: Callable[[list[StageServer]], None] = lambda servers: None,
        on_event: OnEvent = ignore,
        *,
        peer_id: str | None = None,  # default: the DHT node's (tests without a DHT name one)
    ):
        peer_id = peer_id if peer_id is not None else str(dht.peer_id)
        self.context = PeerContext.create(manifest, dht, p2p, peer_id, device)
        self.serving, self.training = serving, training
        self.trainer: Trainer | None = None
        self.joining = "starting"  # what join() does now, for its progress lines (a join can take minutes)
        self.metrics: MetricsServer | None = None
        self.data: ChunkFetcher | None = None  # the chunks the trainer reads (and hands to other peers)
        self.stream: ChunkStream | None = None  # which of them it reads, and how far the swarm has read
        self.data_service = DataService(manifest)  # hands this machine's chunks to other peers
        self.checkpoint_service = CheckpointService(manifest, serving.checkpoint_dir)  # and its checkpoints

        self.rebalancer = Rebalancer(self.context, serving, on_switch=on_switch, on_event=on_event)
        self._reachability = ReachabilityService(manifest)
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}
        self.on_event = on_event
        self.paused = False  # by its owner (pause / resume)
        self._pausing = asyncio.Lock()  # a pause and a resume never interleave

    async def start_services(self, metrics_address: tuple[str, int] | None = None) -> None:
        """What runs before the peer has a stage: reachability answers, the reverse connector (peers it downloads
        state from or measures against may call back), and metrics (a join may take minutes: scrapes show the
        peer joining meanwhile). Raises PeerStartError if the metrics address is unusable."""
        context = self.context
        await self._reachability.add_p2p_handlers(context.p2p, namespace=ReachabilityService.NAMESPACE)
        await self.data_service.add_p2p_handlers(context.p2p, namespace=DataService.NAMESPACE)
        await self.checkpoint_service.add_p2p_handlers(context.p2p, namespace=CheckpointService.NAMESPACE)
        checkpoints = CheckpointAnnouncer(
            context.manifest,
            context.dht,
            context.peer_id,
            self.serving.checkpoint_dir,
            served=lambda: {server.stage for server in self.rebalancer.servers},
        )
        self._tasks["checkpoints"] = asyncio.create_task(checkpoints.run(self._stop))
        backups = StageBackups(
            context.manifest,
            context.p2p,
            context.view,
            context.peer_id,
            self.serving.checkpoint_dir,
            every=self.serving.checkpoint_every,
            served=lambda: {server.stage for server in self.rebalancer.servers},
        )
        self._tasks["backups"] = asyncio.create_task(backups.run(self._stop))
        if not self.serving.reachable:
            connector = ReverseConnector(context.p2p, context.view, context.peer_id, CONNECT_PERIOD)
            self._tasks["connector"] = asyncio.create_task(connector.run(self._stop))
        # this peer's network coordinate: announced by its stage server, used by its trainer's routes
        pinger = Pinger(context.manifest, context.p2p, context.view, context.peer_id, context.position)
        self._tasks["pinger"] = asyncio.create_task(pinger.run(self._stop))
        if metrics_address is not None:
            refused = lambda: rejected_records(context.dht)  # noqa: E731
            self.metrics = start_metrics_server(*metrics_address, self.info(), self.snapshot, refused)

    async def get_tokenizer(self) -> Tokenizer:
        """The swarm's tokenizer, which this machine then keeps (to tokenize raw data, and to hand it to peers that
        join later): from its cache or next to the manifest, else from the swarm's peers. Raises TokenizerError."""
        context = self.context
        # (the byte vocabulary needs no file); a URL is fetched in a thread: Ctrl-C is heard meanwhile
        local = await asyncio.to_thread(tokenizer_source.local_tokenizer, context.manifest)
        if local is not None:
            return local  # no DHT read at start for it
        peer_ids = [address.rsplit("/p2p/", 1)[1] for address in context.manifest.initial_peers]
        stages = await context.view.all_stages(force=True)
        peer_ids += [a.peer_id for announcements in stages for a in announcements if a.peer_id not in peer_ids]
        peer_ids = [peer_id for peer_id in peer_ids if peer_id != context.peer_id]
        return await tokenizer_from_peers(context.p2p, context.manifest, peer_ids)

    async def open_training_data(self, tokenizer: Tokenizer | None) -> None:
        """The trainer's data, opened and its first chunk fetched and verified: a peer that cannot get its data
        says so (DataError) before it takes over a stage. Its chunks are handed to other peers from then on."""
        context = self.context
        cache = ChunkCache(cap_bytes=self.training.data_cache)
        peers = PeerSource(
            context.p2p,
            context.manifest,
            holders=lambda chunk: self.stream.holders(chunk) if self.stream is not None else [],
            anyone=self._data_peers,
        )
        await self.refresh_data_peers()
        self.data = await open_data(context.manifest, tokenizer, cache, peers, self.training.data)
        self.data_service.holdings = self.data.holdings
        self.stream = ChunkStream(
            self.data,
            context.peer_id,
            context.manifest.swarm_id,
            context.dht,
            seed=self.training.seed or 0,
            # a chunk takes minutes to read: its progress need not be as fresh as a stage's announcement
            announce_period=max(DATA_LOOK_PERIOD, context.manifest.network.announce_period),
        )
        await self.stream.first_chunk()

    async def refresh_data_peers(self) -> None:
        """The peers that may hold the data's index: trainers that read it, initial peers, stage peers."""
        peer_ids = [address.rsplit("/p2p/", 1)[1] for address in self.context.manifest.initial_peers]
        try:
            stages = await self.context.view.all_stages(force=True)
            peer_ids += [a.peer_id for announcements in stages for a in announcements]
        except Exception as e:  # a DHT timeout: the initial peers will do
            logger.debug(f"reading the stage peers failed: {e!r}")
        self._known_peers = [p for p in dict.fromkeys(peer_ids) if p != self.context.peer_id]

    def _data_peers(self) -> list[str]:
        readers = self.stream.readers() if self.stream is not None else []
        return list(dict.fromkeys([*readers, *getattr(self, "_known_peers", [])]))

    async def join(self) -> None:
        """Choose a stage, take over its state and serve it; then keep balancing, and train if asked to. A
        trainer-only peer just trains."""
        self.joining = "getting the swarm's tokenizer"
        tokenizer = await self.get_tokenizer()
        if self.training.enabled:
            self.joining = "getting the swarm's training data (its index and first chunk)"
            await self.open_training_data(tokenizer)
        if not self.training.only:
            self.joining = "measuring this machine and taking over a stage's state"
            # a CPU that trains and was not pinned to a stage takes the role it can fill (swarm/capacity/role.py)
            may_train_instead = (
                self.context.device.type == "cpu" and self.training.enabled and self.serving.stage is None
            )
            try:
                await self.rebalancer.start(may_train_instead)
                self._tasks["balancing"] = asyncio.create_task(self.rebalancer.run(self._stop))
            except CapacityError as e:
                if not may_train_instead:
                    raise
                self.training = replace(self.training, only=True)
                reason = str(e).split(": try ")[0]  # the remedies are for a peer that wants to serve
                self.on_event(
                    Event(EventKind.TRAINS_ONLY, {"reason": reason, "too_slow": isinstance(e, TooSlowToServeError)})
                )
        if not self.training.enabled:
            return
        context = self.context
        self.trainer = Trainer(
            context.manifest,
            context.dht,
            context.p2p,
            context.peer_id,
            seed=self.training.seed,
            local_server=context.stages,  # the stages this peer serves, whichever they are at the time
            view=context.view,
            traffic=context.traffic,
            reachable=self.serving.reachable,
            position=context.position,
            check_fraction=self.training.check_fraction,
        )
        self._tasks["training"] = asyncio.create_task(self.trainer.train(self.stream, self._stop))

    def info(self) -> PeerInfo:
        """What the metrics say about this peer itself."""
        context, manifest = self.context, self.context.manifest
        return PeerInfo(
            manifest.swarm_id,
            manifest.name,
            context.peer_id,
            device_name(context.device),
            self.serving.public_name,
            manifest.num_stages,
            context.started,
        )

    def snapshot(self) -> PeerSnapshot:
        """This moment of the peer, for its status line and its metrics; call it on the peer's event loop."""
        stages = tuple(server.stats() for server in self.rebalancer.servers)
        return PeerSnapshot.of(
            stages[0] if stages else None,
            self.trainer.stats() if self.trainer is not None else None,
            self.rebalancer.moves,
            self.context.traffic,
            self.rebalancer.span,
            stages,
            self.stream.stats() if self.stream is not None else None,
        )

    async def refused_records(self) -> int | None:
        """How many records this peer's DHT node refused (unsigned or forged); None if the DHT's process did not
        answer in time (it is busy or stopping)."""
        try:
            return await asyncio.wait_for(rejected_records_soon(self.context.dht), timeout=REFUSED_RECORDS_TIMEOUT)
        except Exception:
            return None

    def check(self) -> None:
        """Raise what made the trainer or the balancing loop fail (e.g. a SwarmError: serving nothing at all)."""
        for name in ("training", "balancing"):
            task = self._tasks.get(name)
            if task is not None and task.done() and not self._stop.is_set():
                task.result()

    # ------------------------------------------------------------------------------ the owner comes first

    async def pause(self, reason: str = "asked to") -> None:
        """The owner wants the machine back: the trainer sends no new microbatches, the stages announce paused
        (routes avoid them; their state can still be downloaded), drain, and park their state in RAM, freeing the
        device's memory (server/parking.py); the peer stays in the swarm's DHT. A `paused` event says how long
        that took and how much device memory it freed."""
        async with self._pausing:
            if self.paused:
                return
            begin, self.paused = time.monotonic(), True
            if self.trainer is not None:
                self.trainer.paused = True
            stages = [server.stage for server in self.rebalancer.servers]
            fields = {"stages": stages, "in_flight": sum(server.in_flight for server in self.rebalancer.servers)}
            fields.update(trainer_in_flight=self.trainer.in_flight if self.trainer is not None else 0, reason=reason)
            self.on_event(Event(EventKind.PAUSING, fields))  # at once: the drain below can take a while
            if self.rebalancer.moving.locked():  # a move's state download can take minutes: say why it waits
                logger.info(f"pausing ({reason}) once the move to another stage in progress has finished")
            async with self.rebalancer.moving:  # not in the middle of a move
                self.rebalancer.paused = True
                freed = [await server.pause(PAUSE_DRAIN_TIMEOUT) for server in self.rebalancer.servers]
            drained = await self.trainer.drained(PAUSE_DRAIN_TIMEOUT) if self.trainer is not None else True
            seconds = time.monotonic() - begin  # the whole pause, drains included: what the owner waited
            stages = [server.stage for server in self.rebalancer.servers]
            logger.info(
                f"paused ({reason}): stages {stages} drained and parked in RAM; {seconds:.1f}s in all "
                f"({sum(freed)} device bytes freed)"
            )
            fields = {"seconds": round(seconds, 2), "device_bytes_freed": sum(freed), "stages": stages}
            fields["reason"] = reason
            self.on_event(Event(EventKind.PAUSED, {**fields, "trainer_drained": drained}))

    async def resume(self) -> None:
        """Back to work: each stage's state goes back on the device and catches up with the stage (an online
        peer's state if it went further while this one was paused), then the stages serve and the trainer trains
        again. A `resumed` event says how long that took and where each stage's state came from."""
        async with self._pausing:
            if not self.paused:
                return
            begin = time.monotonic()
            async with self.rebalancer.moving:
                sources = []
                for server in self.rebalancer.servers:
                    await server.unpark()
                    sources.append(str(await self.rebalancer.takeover.catch_up(server)))
                    await server.serve_again()
                self.rebalancer.paused = False
            if self.trainer is not None:
                self.trainer.paused = False
            self.paused = False
            seconds = time.monotonic() - begin
            logger.info(f"resumed: serving again in {seconds:.1f}s (state from: {', '.join(sources) or 'nothing'})")
            self.on_event(Event(EventKind.RESUMED, {"seconds": round(seconds, 2), "sources": sources}))

    async def _hand_over(self, hurry: asyncio.Event) -> None:
        """The stages only this peer serves, to the peers that take them over (a `leaving` event first, then a
        `handed_over` one); nothing when every stage has other online peers, or the peer is paused (its stages
        hand their state out already, and others took them over or will from its checkpoints)."""
        servers = [server for server in self.rebalancer.servers if server.state == PeerState.ONLINE]
        if not servers or hurry.is_set():
            return
        try:
            sole = await handover.sole_stages(servers, self.context.view, self.context.peer_id)
            if sole and not await handover.someone_could_take(self.context.view, self.context.peer_id):
                stages = [server.stage for server in sole]
                logger.info(f"only this peer serves stages {stages}, and no peer could take them over")
                return  # nobody to hand them to (its checkpoints keep them)
        except Exception as e:  # the DHT did not answer: nothing to wait for that could be seen
            logger.warning(f"could not tell which stages only this peer serves: {e!r}")
            return
        if not sole:
            return
        stages = [server.stage for server in sole]
        self.on_event(Event(EventKind.LEAVING, {"stages": stages, "start_within": handover.HANDOVER_START}))
        # and its other stages: one that others serve too now may be left to it alone while it waits
        shared = [server for server in servers if server not in sole]
        result = await handover.hand_over(sole, shared, self.context.view, self.context.peer_id, hurry)
        fields = {"stages": list(result.sole), "taken": list(result.taken), "left_behind": list(result.left_behind)}
        fields.update(seconds=round(result.seconds, 2), hurried=result.hurried)
        self.on_event(Event(EventKind.HANDED_OVER, fields))

    async def shutdown(self, hurry: asyncio.Event | None = None) -> None:
        """Stop everything, each step bounded: first the stages only this peer serves are handed over to other
        peers (server/handover.py) unless `hurry` is set meanwhile (the owner's second Ctrl-C)."""
        self._stop.set()
        if "balancing" in self._tasks:  # a move in progress (a state download) must not delay the exit
            self._tasks["balancing"].cancel()
        await asyncio.gather(
            *[self._tasks[name] for name in ("balancing", "training") if name in self._tasks], return_exceptions=True
        )
        await self._hand_over(hurry or asyncio.Event())
        for name in ("connector", "pinger", "backups"):
            if name in self._tasks:
                self._tasks[name].cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.stream is not None:
            await self.stream.close()
        await self.rebalancer.shutdown()
        await self._reachability.shutdown()
        try:
            await asyncio.wait_for(self.context.p2p.shutdown(), timeout=5)
        except Exception as e:
            logger.warning(f"p2p shutdown failed: {e!r}")
        if self.metrics is not None:
            self.metrics.stop()
