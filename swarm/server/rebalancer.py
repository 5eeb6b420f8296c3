"""Which stage this peer serves: the choice on join, the state download, and moves when the swarm is unbalanced.

The decisions are swarm/balancing.py's pure functions over the peers' announcements; this module does the I/O:
measuring throughput, reading the DHT, downloading a stage's state, switching the StageServer.

Join:  short random delay -> look -> choose the bottleneck stage -> measure (cached) -> look again (peers that
       started at the same time have announced by now) -> announce "joining" there -> download the stage's
       state from an online peer of it -> serve, announce "online".
Check: every check_period x U(0.5, 1.5) seconds: should_move over the current announcements; if it says move,
       wait a short random time and look again, then move only if the answer is still the same.
Move:  build and measure the target stage while still serving -> announce "joining" there -> download its
       state -> stop taking requests on the old stage, finish those in flight, announce it "offline" ->
       serve the target, announce "online". If no peer of the target can give its state, the move is called
       off and the peer stays where it was.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.balancing import PeerLoad, choose_stage, should_move, stage_totals
from swarm.checkpoint import find_checkpoint
from swarm.client.rpc import download_state, probe_bandwidth
from swarm.errors import PeerStartError, SwarmError
from swarm.manifest import Manifest
from swarm.model import build_stage
from swarm.records import Announcement, PeerState, SwarmView, announcement_lifetime
from swarm.routing import online_peers
from swarm.server.stage import STATE_SOURCES, StageServer, Traffic, announced_rate
from swarm.throughput import (
    DEFAULT_BANDWIDTH_MBITS,
    SimulatedSpeed,
    Throughput,
    cached_compute_throughput,
    default_cache_path,
    measure_compute_throughput,
    network_throughput,
)

logger = logging.getLogger(__name__)

JOIN_DELAY = 2.0  # peers wait up to this long before their first look, and again before a move
STATE_DOWNLOAD_TIMEOUT = 120.0
STATE_ATTEMPTS = 2  # tries per source peer
DRAIN_TIMEOUT = 30.0


@dataclass(frozen=True)
class ServingOptions:
    """How the user asked this peer to serve (swarm-peer's flags)."""

    stage: int | None = None  # --stage: pinned
    throughput: str = "auto"  # --throughput: auto (cached), eval (measure again), or a number of samples/s
    bandwidth_mbits: float | None = None  # --bandwidth: skip the network measurement
    simulated_speed: float = 1.0  # --simulated-speed (testing aid)
    public_name: str = ""
    checkpoint_dir: Path | None = None  # --checkpoint-dir; None: no checkpoints
    checkpoint_every: float = 300.0  # --checkpoint-every (seconds; 0: only on a clean exit)
    reachable: bool = True  # others can dial this peer (peers/reachability.py)
    maddrs: tuple[str, ...] = ()  # its addresses, announced


def _progress(counters: dict[str, int]) -> tuple[int, int]:
    """How far a stage's state has come: averaging rounds first (the swarm's clock), then local optimizer steps."""
    return counters.get("averaging_round", 0), counters.get("optimizer_steps", 0)


def peer_loads(stages: Sequence[Sequence[Announcement]], now: float) -> list[PeerLoad]:
    """What balancing needs of each announced peer: joining and online peers whose records have not expired."""
    return [
        PeerLoad(ann.peer_id, ann.stage, ann.throughput, online=ann.state == PeerState.ONLINE, movable=not ann.pinned)
        for anns in stages
        for ann in anns
        if ann.state in (PeerState.JOINING, PeerState.ONLINE) and ann.expiration > now
    ]


class Rebalancer:
    def __init__(
        self,
        manifest: Manifest,
        dht: DHT,
        p2p: P2P,
        peer_id: str,
        device: torch.device,
        options: ServingOptions,
        on_switch: Callable[[StageServer], None] = lambda server: None,
    ):
        self.manifest, self.dht, self.p2p, self.peer_id = manifest, dht, p2p, peer_id
        self.device, self.options, self.on_switch = device, options, on_switch
        self.view = SwarmView(dht, manifest.swarm_id, manifest.num_stages, max_age=manifest.network.announce_period)
        self.rng = random.Random()
        self.started = time.monotonic()
        self.server: StageServer | None = None
        self.moves = 0
        self.traffic = Traffic()  # bytes moved by this peer's servers and trainer
        self._bandwidth: tuple[float, float] | None = None  # (download, upload) bytes/s
        self._bandwidth_measured = False  # False while it is the stated default (nobody to measure against)
        self._simulated: dict[int, SimulatedSpeed] = {}  # per stage, with --simulated-speed

    # -------------------------------------------------------------------------------------------- join

    async def start(self) -> StageServer:
        """Choose a stage (or take the pinned one), take over its state, and serve it."""
        if self.options.stage is not None:
            stage = self.options.stage
        else:
            await asyncio.sleep(self.rng.uniform(0, JOIN_DELAY))
            stage = choose_stage(await self._loads(), self.manifest.num_stages, self.rng, exclude_peer=self.peer_id)
        server = await self._prepare(stage)  # measuring takes a while: peers that started with us announce meanwhile
        if self.options.stage is None:
            loads = await self._loads()
            if not self._is_bottleneck(loads, stage):
                stage = choose_stage(loads, self.manifest.num_stages, self.rng, exclude_peer=self.peer_id)
                logger.info(f"at a second look another stage is the bottleneck; taking stage {stage}")
                server = await self._prepare(stage)
        await server.join(self.dht, self.p2p)
        if not await self._take_over_state(server, fresh_start_allowed=True):
            await server.shutdown()
            raise PeerStartError(
                f"could not download the state of stage {server.stage} from any of its online peers; "
                "check that they are reachable from here, then start again"
            )
        await server.start(self.dht, self.p2p, self.view)
        self._switch_to(server)
        return server

    def _is_bottleneck(self, loads: list[PeerLoad], stage: int) -> bool:
        others = [load for load in loads if load.peer_id != self.peer_id]
        totals = stage_totals(others, self.manifest.num_stages)
        return totals[stage] <= min(totals) * (1 + 1e-9)

    async def _prepare(self, stage: int) -> StageServer:
        """A server for `stage` with its seed-initialised model and measured throughput; not yet announced."""
        model = build_stage(self.manifest, stage).to(self.device)
        throughput = await self._measure(stage, model)
        return StageServer(
            self.manifest,
            stage,
            model,
            self.device,
            self.peer_id,
            throughput,
            pinned=self.options.stage is not None,
            public_name=self.options.public_name,
            simulated=self._simulated.get(stage),
            started=self.started,
            traffic=self.traffic,
            checkpoint_dir=self.options.checkpoint_dir,
            checkpoint_every=self.options.checkpoint_every,
            reachable=self.options.reachable,
            maddrs=self.options.maddrs,
        )

    # ------------------------------------------------------------------------------------ measurement

    async def _measure(self, stage: int, model) -> Throughput:
        if self.options.throughput not in ("auto", "eval"):
            value = float(self.options.throughput)
            return Throughput(compute=value, network=value)
        compute = self._compute_throughput(stage, model)
        download, upload = await self._network_bandwidth()
        return Throughput(compute=compute, network=network_throughput(self.manifest, stage, download, upload))

    def _compute_throughput(self, stage: int, model) -> float:
        value, cached = cached_compute_throughput(
            model, self.manifest, stage, self.device, remeasure=self.options.throughput == "eval"
        )
        source = f"cached in {default_cache_path()}" if cached else "measured"
        logger.info(f"compute throughput of stage {stage}: {value:.1f} samples/s ({source})")
        if self.options.simulated_speed < 1.0:
            simulated = SimulatedSpeed(self.options.simulated_speed, reference=value)
            self._simulated[stage] = simulated
            value = measure_compute_throughput(model, self.manifest, self.device, simulated=simulated, rounds=1)
            logger.info(f"simulating a device {simulated.speed:g}x as fast: measured {value:.1f} samples/s")
        return value

    async def _network_bandwidth(self) -> tuple[float, float]:
        """(download, upload) bytes/s: --bandwidth, else measured against an online peer, else the default."""
        if self.options.bandwidth_mbits is not None:
            both = self.options.bandwidth_mbits * 1e6 / 8
            return both, both
        if self._bandwidth_measured and self._bandwidth is not None:
            return self._bandwidth
        others = [a for anns in await self.view.all_stages() for a in anns if a.state == PeerState.ONLINE]
        others = [a for a in others if a.peer_id != self.peer_id]
        for ann in self.rng.sample(others, k=min(len(others), 2)):
            try:
                self._bandwidth = await probe_bandwidth(self.p2p, ann.peer_id, self.manifest)
                self._bandwidth_measured = True
                down, up = self._bandwidth
                logger.info(f"bandwidth to peer {ann.peer_id[-8:]}: {down * 8e-6:.0f} Mbit/s down, {up * 8e-6:.0f} up")
                return self._bandwidth
            except Exception as e:  # that peer may be gone; try another
                logger.info(f"bandwidth probe of peer {ann.peer_id[-8:]} failed: {e!r}")
        default = DEFAULT_BANDWIDTH_MBITS * 1e6 / 8
        if self._bandwidth is None:  # said once; checks try again quietly until a peer is there
            logger.info(f"no peer to measure bandwidth against; assuming {DEFAULT_BANDWIDTH_MBITS:.0f} Mbit/s for now")
        self._bandwidth = (default, default)
        return self._bandwidth

    # ----------------------------------------------------------------------------------------- state

    async def _online_peers_of(self, stage: int) -> list[Announcement]:
        """Other online peers of `stage`, as last read from the DHT."""
        online = online_peers(await self.view.stage(stage), get_dht_time())
        return [a for a in online if a.peer_id != self.peer_id]

    async def _wait_for_sources(self, stage: int) -> list[Announcement]:
        period = self.manifest.network.announce_period
        deadline = time.monotonic() + announcement_lifetime(period)
        while time.monotonic() < deadline:
            await asyncio.sleep(period)
            await self.view.all_stages(force=True)
            if sources := await self._online_peers_of(stage):
                return sorted(sources, key=lambda a: -a.throughput)[:STATE_SOURCES]
        return []

    async def _take_over_state(self, server: StageServer, fresh_start_allowed: bool) -> bool:
        """Load the stage's state: from one of its online peers (fastest first), or from this peer's checkpoint of
        the stage if that is further ahead (or if no peer serves the stage any more). True if loaded, or if there
        is neither and `fresh_start_allowed` (the stage starts from its seed initialisation); else False."""
        await self.view.all_stages(force=True)
        sources = sorted(await self._online_peers_of(server.stage), key=lambda a: -a.throughput)[:STATE_SOURCES]
        checkpoint = find_checkpoint(self.options.checkpoint_dir, self.manifest, server.stage)
        if checkpoint is not None and not sources:
            # The stage trained before. Its peers' records may have lapsed for a moment (a DHT store that waits on an
            # unresponsive node): look again for one record lifetime before falling back to an older checkpoint.
            sources = await self._wait_for_sources(server.stage)
        # each source twice: a download can be cut short (the peer was busy starting up, a stream broke)
        for source in [s for s in sources for _ in range(STATE_ATTEMPTS)]:
            try:
                begin = time.monotonic()
                items, counters = await download_state(
                    self.p2p, source.peer_id, self.manifest, server.stage, server.state_shapes(), STATE_DOWNLOAD_TIMEOUT
                )
                if checkpoint is not None and _progress(checkpoint.counters) > _progress(counters):
                    logger.info(
                        f"this peer's checkpoint of stage {server.stage} is ahead of peer {source.peer_id[-8:]}"
                    )
                    break
                server.load_state(items, counters)
                logger.info(
                    f"took over the state of stage {server.stage} from peer {source.peer_id[-8:]} "
                    f"({counters['optimizer_steps']} optimizer steps) in {time.monotonic() - begin:.1f}s"
                )
                return True
            except Exception as e:  # a refusal, a timeout or a malformed state: try again, then another
                logger.warning(f"state download of stage {server.stage} from {source.peer_id[-8:]} failed: {e!r}")
                await asyncio.sleep(1.0)
        if checkpoint is not None:
            try:
                server.load_state(checkpoint.items, checkpoint.counters)
                age = (time.time() - checkpoint.saved_at) / 60
                logger.info(
                    f"resumed stage {server.stage} from checkpoint {checkpoint.path} "
                    f"({checkpoint.optimizer_steps} optimizer steps, saved {age:.1f} min ago)"
                )
                return True
            except Exception as e:  # it passed the file checks but does not fit this stage's model
                logger.error(f"checkpoint {checkpoint.path} does not fit stage {server.stage}: {e}; not loaded")
        if sources:
            return False
        if fresh_start_allowed:
            logger.info(f"no online peer serves stage {server.stage} and no checkpoint of it: starting afresh")
        return fresh_start_allowed

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
                    if not self._bandwidth_measured and self.options.bandwidth_mbits is None:
                        await self._refresh_network_figure()
                    continue
                target = await self.check()
                if target is not None and not stop.is_set():
                    await self.move(target)
            except SwarmError:
                raise  # serving nothing at all: swarm-peer stops with the error
            except Exception as e:  # a failed check, or a move called off: the peer goes on serving
                logger.warning(f"balance check failed: {e!r}")

    async def check(self) -> int | None:
        """The stage to move to, if the balance says so at two looks a short random time apart."""
        assert self.server is not None
        if not self._bandwidth_measured and self.options.bandwidth_mbits is None:
            await self._refresh_network_figure()
        # checks are frequent and cheap: they read the cached records; only a decision to move reads them afresh
        target = should_move(
            self.peer_id, await self._loads(force=False), self.manifest.num_stages, self.manifest.balancing.min_gain
        )
        if target is None:
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
            await new.join(self.dht, self.p2p)
            # a target without online peers has lost its state anyway (they all died): start it afresh
            if not await self._take_over_state(new, fresh_start_allowed=True):
                logger.warning(f"move to stage {target} called off: none of its peers could give its state")
                await new.shutdown()
                return False
            # plans chain moves (A goes to T, so B may leave T for U): never leave a stage before the peer that
            # replaces us is online, or T's trained state would go with us
            if not await self._online_peers_of(old.stage):  # records were just read afresh
                logger.warning(f"move to stage {target} called off: this peer is the last one of stage {old.stage}")
                await new.shutdown()
                return False
        except BaseException:
            await new.shutdown()
            raise
        await old.drain(DRAIN_TIMEOUT)
        await old.shutdown()
        try:
            await new.start(self.dht, self.p2p, self.view)
        except Exception as e:
            await new.shutdown()
            raise SwarmError(f"after leaving stage {old.stage}, serving stage {target} failed: {e!r}") from e
        self._switch_to(new)
        self.moves += 1
        logger.info(f"now serving stage {target} ({new.throughput.serving:.1f} samples/s)")
        return True

    async def _refresh_network_figure(self) -> None:
        """Replace the assumed default bandwidth by a measurement once another peer is there."""
        assert self.server is not None
        download, upload = await self._network_bandwidth()
        if self._bandwidth_measured:
            stage = self.server.stage
            self.server.throughput = Throughput(
                self.server.throughput.compute, network_throughput(self.manifest, stage, download, upload)
            )

    async def _loads(self, force: bool = True) -> list[PeerLoad]:
        """Balancing's picture of the swarm: fresh from the DHT if `force`, else at most an announce period old."""
        loads = peer_loads(await self.view.all_stages(force=force), get_dht_time())
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
