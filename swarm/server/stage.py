"""StageServer: one served stage, composed of its parts, from joining to shutdown.

The parts (one concern each): the worker that owns the model (server/compute.py), admission (server/admission.py),
the one request path through both (server/request_path.py), the RPC handlers (server/service.py) and forwarding
(server/forwarding.py), the announcement (server/announcer.py) and the averaging rounds
(server/rounds.py). This module starts and stops them in order, keeps the checkpoint timer, and takes the
stage's stats snapshot (swarm/watch/stats.py) that the announcement, the status line and the metrics read.

Lifecycle: `join` announces the peer as joining the stage (others count it in, and do not pick the stage too)
while server/takeover.py loads the stage's state into it (`load_state`); `start` registers the handlers and
announces it online; `drain` stops taking requests and waits for those in flight; `shutdown` announces it
offline, removes the handlers, lets the worker finish, saves a last checkpoint and stops the averager.

Out of memory while serving: the request that ran out is answered `busy` and the stage sheds (server/shedding.py);
this module reports each such error as an `out_of_memory` event and, when the policy says so, asks the peer's
rebalancer to drop the last stage of its span (`shorten_span`, set while the peer serves more than one stage).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from swarm.architectures.model import StageModel
from swarm.averaging.averager import StageAverager
from swarm.capacity.budget import memory_in_use
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import PeerState
from swarm.events import Event, EventKind, OnEvent, ignore
from swarm.manifests.manifest import Manifest
from swarm.network.coordinates import Vivaldi
from swarm.server.admission import Admission
from swarm.server.announcer import Announcer, PeerFacts
from swarm.server.checkpoint import save_checkpoint
from swarm.server.compute import StageCompute
from swarm.server.dispatch import StageDispatcher
from swarm.server.forwarding import Forwarder
from swarm.server.parking import Parked, park, unpark
from swarm.server.request_path import RequestPath
from swarm.server.rounds import AveragingRounds, RoundCounters
from swarm.server.service import StageService
from swarm.server.shedding import ShedAction, Shedding
from swarm.server.worker import StageWorker
from swarm.throughput import DeliveredThroughput, SimulatedSpeed, Throughput, device_name
from swarm.watch.stats import StageStats, Traffic

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingOptions:
    """How the user asked this peer to serve (swarm-peer's flags)."""

    stage: int | None = None  # --stage: pinned (the first stage of a pinned span)
    span: int = 1  # --span: how many stages from the pinned one (a swarm with balancing.spans)
    throughput: str = "auto"  # --throughput: auto (cached), eval (measure again), or a number of samples/s
    bandwidth_mbits: float | None = None  # --bandwidth: skip the network measurement
    simulated_speed: float = 1.0  # --simulated-speed (testing aid)
    public_name: str = ""
    checkpoint_dir: Path | None = None  # --checkpoint-dir; None: no checkpoints
    checkpoint_every: float = 300.0  # --checkpoint-every (seconds; 0: only on a clean exit)
    reachable: bool = True  # others can dial this peer (server/reachability.py)
    maddrs: tuple[str, ...] = ()  # its addresses, announced
    max_memory: int | None = None  # --max-memory: bytes this peer may use at most (capacity/budget.py)
    offload_optimizer: bool = False  # --offload-optimizer: the optimizer's statistics in RAM (server/offload.py)


class StageServer:
    def __init__(
        self,
        manifest: Manifest,
        stage: int,
        model: StageModel,
        device: torch.device,
        peer_id: str,
        throughput: Throughput,
        options: ServingOptions = ServingOptions(),
        *,
        simulated: SimulatedSpeed | None = None,
        started: float | None = None,
        traffic: Traffic | None = None,
        on_event: OnEvent = ignore,
        position: Vivaldi | None = None,
        kept_microbatches: int | None = None,  # whose activations fit in memory (capacity/costs.py); None: default
        dispatcher: StageDispatcher | None = None,  # the peer's RPC handlers (server/dispatch.py); None: its own
    ):
        self.manifest, self.stage, self.device, self.peer_id = manifest, stage, device, peer_id
        self.throughput, self.options, self.on_event = throughput, options, on_event
        self.pinned = options.stage is not None
        self.traffic = traffic if traffic is not None else Traffic()
        self.layers = model.layers
        self.parameter_count = sum(p.numel() for p in model.parameters())
        offload = options.offload_optimizer and device.type == "cuda"  # a CPU's optimizer is in RAM already
        self.worker = StageWorker(StageCompute(manifest, stage, model, device, simulated, kept_microbatches, offload))
        self.admission = Admission(manifest, peer_id)
        self.state = PeerState.JOINING
        self.steps_behind = 0  # set by server/takeover.py: how stale the state it took over was
        slots = manifest.training.microbatches_per_step if manifest.training.pipelining == "flush" else 0
        self.requests = RequestPath(self.admission, self.worker, lambda: self.state, slots)  # one path for all
        # the rebalancer's, while this peer serves several stages: drop the span's last one (False: it cannot now)
        self.shorten_span: Callable[[], bool] | None = None
        self.requests.can_shorten = lambda: self.shorten_span is not None
        self.requests.on_out_of_memory = self._out_of_memory
        self.forwarder = Forwarder(manifest, stage, peer_id, self.requests, self.traffic)
        self.service = StageService(manifest, stage, self.requests, self.traffic, self.forwarder)
        facts = PeerFacts(
            peer_id,
            device_name(device),
            self.pinned,
            options.public_name,
            options.reachable,
            options.maddrs,
            time.monotonic() if started is None else started,
        )
        self.announcer = Announcer(manifest, facts, self.stats, position)  # position: this peer's coordinate
        self.delivered = DeliveredThroughput()
        self.round_counters = RoundCounters()
        self.rounds: AveragingRounds | None = None  # created on join (it needs the DHT); none in mode "none"
        self.checkpoints_saved = 0
        self._tasks: list[asyncio.Task] = []
        self._p2p: P2P | None = None
        self.memory_available = 0  # bytes the peer may use (set by the rebalancer once it measured them)
        self._own_dispatcher = dispatcher is None
        self.dispatcher = dispatcher if dispatcher is not None else StageDispatcher(manifest)
        self._handlers_added = False  # its service is in the dispatcher
        self._went_online = False  # a server that never served has nothing worth a checkpoint
        self._parked: Parked | None = None  # what pausing moved to RAM (server/parking.py)

    # ------------------------------------------------------------------------------------------ lifecycle

    async def join(self, dht: DHT, p2p: P2P) -> None:
        """Announce this peer as joining the stage, and keep announcing while it takes over the stage's state."""
        self.announcer.dht, self._p2p = dht, p2p
        if self.manifest.averaging.mode != "none" and self.rounds is None:
            # created here, on the main thread, before the worker's first task: the averager forks a process
            averager = self.worker.before_first_task(
                lambda c: StageAverager(self.manifest, self.stage, dht, c.param_names, c.params, c.optimizer)
            )
            self.worker.before_first_task(lambda c: c.attach_averager(averager))
            self.rounds = AveragingRounds(
                self.manifest,
                self.stage,
                self.peer_id,
                self.worker,
                averager,
                self.traffic,
                self.round_counters,
                self.announcer.announce,
                self.on_event,
                self.requests.gate,
            )
        await self.announcer.announce()
        self._tasks.append(asyncio.create_task(self.announcer.run()))

    async def load_state(self, items: list[tuple[str, torch.Tensor]], counters: dict[str, int]) -> None:
        """Take over a stage's state (from a peer or a checkpoint) before serving. Raises BadRequestError,
        leaving everything untouched, if it does not fit."""
        await self.worker.run(lambda compute: compute.load_state(items, counters))

    async def start(self, view: AnnouncementCache | None = None) -> None:
        """Register the RPC handlers, announce online, and keep announcing, averaging and checkpointing in the
        background. `view` is the peer's shared picture of the swarm (averaging reads the stage's records)."""
        assert self._p2p is not None and self.announcer.dht is not None, "join first"
        view = (
            view
            if view is not None
            else AnnouncementCache(
                self.announcer.dht,
                self.manifest.swarm_id,
                self.manifest.num_stages,
                self.manifest.network.announce_period,
            )
        )
        self.forwarder.attach(self._p2p, view, self.dispatcher)
        await self.dispatcher.register(self._p2p)
        self.dispatcher.add(self.service)
        self._handlers_added = True
        self.state = PeerState.ONLINE
        self._went_online = True
        await self.announcer.announce()
        if self.rounds is not None:
            self._tasks.append(asyncio.create_task(self.rounds.run(self.announcer.dht, self._p2p, view)))
        if self.options.checkpoint_dir is not None and self.options.checkpoint_every > 0:
            self._tasks.append(asyncio.create_task(self._checkpoint_forever()))
        logger.info(f"serving stage {self.stage} (layers {list(self.layers)}) as {self.peer_id}")

    @property
    def in_flight(self) -> int:
        """Requests taken on and not yet answered (what a drain waits for)."""
        return self.admission.pending + self.forwarder.in_flight

    async def drain(self, timeout: float, state: PeerState = PeerState.OFFLINE) -> None:
        """Stop taking new requests (they get 'busy' replies) and wait, up to `timeout`, for those in flight."""
        self.state = state
        try:
            await asyncio.wait_for(self.announcer.announce(), timeout=timeout)
        except Exception as e:
            logger.warning(f"announcing {state} failed: {e!r}")
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def leave(self, timeout: float) -> None:
        """The peer stops and nobody else serves this stage (server/handover.py): announce leaving (balancing counts
        it out, so another peer comes), take no part in rounds, and drain, so that the state handed over is final."""
        if self.rounds is not None:
            self.rounds.active = False
        await self.drain(timeout, PeerState.LEAVING)

    async def pause(self, timeout: float) -> int:
        """The owner wants the device back: announce paused (routes avoid it, its stage's peers may still download
        its state), take no part in rounds, drain, and park the state in RAM (server/parking.py). Bytes freed."""
        if self.rounds is not None:
            self.rounds.active = False
        await self.drain(timeout, PeerState.PAUSED)
        self._parked = await self.worker.run(park)
        return self._parked.bytes_moved

    async def unpark(self) -> None:
        """After a pause: the state back on the device (still paused: the caller catches it up with the stage)."""
        parked, self._parked = self._parked, None
        if parked is not None:
            await self.worker.run(lambda compute: unpark(compute, parked))

    async def serve_again(self) -> None:
        """After a pause, unparked and caught up: online again."""
        self.state = PeerState.ONLINE
        if self.rounds is not None:
            self.rounds.active = True
        await self.announcer.announce()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Announce offline, stop taking requests, finish the work in flight.

        Every step has a timeout: on Ctrl-C the DHT process and the p2p daemon may already be gone."""
        self.state = PeerState.OFFLINE
        for task in self._tasks:
            task.cancel()
        steps = []
        dht = self.announcer.dht
        if dht is not None and dht.is_alive():
            steps.append(("announcing offline", self.announcer.announce()))
        if self._handlers_added:
            self._handlers_added = False
            self.dispatcher.remove(self.service)
            if self._own_dispatcher:
                steps.append(("removing handlers", self.dispatcher.unregister()))
        for what, step in steps:
            try:
                await asyncio.wait_for(step, timeout=timeout)
            except Exception as e:  # shutting down anyway; the record will expire
                logger.warning(f"{what} failed during shutdown: {e!r}")
        # let the work in flight finish, but not forever (a hung device must not hang the exit)
        if await self.worker.finish(timeout=self.manifest.training.timeouts.backward):
            if self._went_online and self.options.checkpoint_dir is not None:
                await self._save_checkpoint_of(self.worker.after_shutdown())
        else:
            logger.warning("work in flight did not finish in time; dropping it (and the checkpoint on exit)")
        if self.rounds is not None:
            averager, self.rounds = self.rounds.averager, None
            await asyncio.get_running_loop().run_in_executor(None, averager.shutdown)

    async def handle(self, kind: str, request, caller: str):
        """One request from this peer itself (libp2p cannot dial itself)."""
        return await self.service.handle(kind, request, caller)

    def _out_of_memory(self, shedding: Shedding, message: str) -> None:
        """A request ran out of memory and was answered busy; the worker has shed what `shedding` says. Report it,
        and ask for a shorter span if that is what it says (on the event loop, so the move may start at once)."""
        action = shedding.action
        if action == ShedAction.SHORTER_SPAN and not (self.shorten_span is not None and self.shorten_span()):
            action = ShedAction.BUSY  # a shortening is under way already, or the span became one stage meanwhile
        count = self.requests.out_of_memory
        logger.warning(
            f"stage {self.stage} ran out of memory ({message}); {action}: keeping {shedding.kept} microbatches' "
            f"activations ({count} out-of-memory errors so far)"
        )
        details = {"stage": self.stage, "action": str(action), "kept_microbatches": shedding.kept}
        self.on_event(Event(EventKind.OUT_OF_MEMORY, {**details, "out_of_memory": count, "error": message}))

    # -------------------------------------------------------------------------------------------- figures

    def stats(self) -> StageStats:
        counters, admission, traffic, rounds = self.worker.counters, self.admission, self.traffic, self.round_counters
        gate = self.requests.gate
        return StageStats(
            stage=self.stage,
            state=self.state,
            throughput=self.throughput.serving,
            compute_throughput=self.throughput.compute,
            network_throughput=self.throughput.network,
            delivered_throughput=self.delivered.update(counters.samples_served, time.monotonic()),
            samples_served=counters.samples_served,
            outstanding=max(admission.pending, 0),
            optimizer_steps=counters.optimizer_steps,
            recomputed_forwards=counters.recomputed_forwards,
            forwarded=self.forwarder.forwarded,
            rerouted=self.forwarder.rerouted,
            too_late=self.forwarder.too_late,
            duplicates=self.forwarder.duplicates,
            replayed=self.forwarder.replayed,
            bad_requests=admission.bad_requests,
            busy_replies=admission.busy_replies,
            banned_replies=admission.banned_replies,
            bans=admission.bans.total,
            averaging_round=counters.averaging_round,
            round_samples=counters.samples_served - rounds.round_started_at,
            averaging_rounds=rounds.rounds,
            averaging_rounds_failed=rounds.failed,
            last_group_size=rounds.last_group_size,
            checkpoints_saved=self.checkpoints_saved,
            activation_bytes_sent=traffic.activation_sent,
            activation_bytes_received=traffic.activation_received,
            averaging_bytes_sent=traffic.averaging_sent,
            averaging_bytes_received=traffic.averaging_received,
            averaging_strikes=self.rounds.averager.strikes if self.rounds is not None else 0,
            averaging_exclusions=self.rounds.averager.exclusions if self.rounds is not None else 0,
            staleness_mean=counters.staleness_mean,
            staleness_max=counters.staleness_max,
            out_of_memory=self.requests.out_of_memory,
            kept_microbatches=self.worker.kept_microbatches,
            steps_behind=self.steps_behind,
            gate_waiting=gate.waiting if gate is not None else 0,
            gate_waited=gate.waited if gate is not None else 0,
            gate_expired=gate.expired if gate is not None else 0,
            memory_used=memory_in_use(self.device) if self.memory_available else 0,
            memory_available=self.memory_available,
        )

    # ---------------------------------------------------------------------------------------- checkpoints

    async def save_checkpoint(self) -> Path | None:
        """Save the stage's state into the checkpoint folder (the copy is taken in the worker, between two
        requests; the file is written in another thread). The path, or None if saving failed (logged)."""
        try:
            items, counters = await self.worker.run(lambda compute: compute.snapshot())
        except Exception as e:
            logger.error(f"taking a snapshot of stage {self.stage} for a checkpoint failed: {e!r}")
            return None
        return await self._write_checkpoint(items, counters)

    async def _save_checkpoint_of(self, compute: StageCompute) -> Path | None:
        """On shutdown, once the worker is done: the state is read here. None if that failed (logged): a peer that
        drops a stage because it ran out of memory may not have the memory for the copy, and must go on serving."""
        try:
            items, counters = compute.snapshot()
        except Exception as e:
            logger.error(f"taking a snapshot of stage {self.stage} for its last checkpoint failed: {e!r}")
            return None
        return await self._write_checkpoint(items, counters)

    async def _write_checkpoint(self, items: list[tuple[str, torch.Tensor]], counters: dict[str, int]) -> Path | None:
        directory = self.options.checkpoint_dir
        assert directory is not None
        try:
            path = await asyncio.get_running_loop().run_in_executor(
                None, save_checkpoint, directory, self.manifest, self.stage, items, counters
            )
        except Exception as e:  # a full disk must not stop serving
            logger.error(f"saving a checkpoint of stage {self.stage} into {directory} failed: {e!r}")
            return None
        self.checkpoints_saved += 1
        logger.info(f"checkpoint of stage {self.stage} saved to {path} ({counters['optimizer_steps']} steps)")
        return path

    async def _checkpoint_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.checkpoint_every)
            await self.save_checkpoint()
