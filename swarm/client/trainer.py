"""Trainer: reads its data (every shard, in its own order), pushes microbatches through one peer per stage and back.

The choice of a peer per stage is swarm/routing.py's (by the trainer's own observations); the microbatches go
through one of two pipelines (swarm/client/forwarded.py, the stages pass them on; swarm/client/relay.py, the
trainer carries them), which share the trainer's parts (swarm/client/pipeline.py). This module keeps as many
microbatches in flight as its window allows (swarm/client/window.py), sends the calls (swarm/client/rpc.py, or
this peer's own server directly), bans peers that fail, and reports progress (TrainerStats, and a report in the
DHT). Nothing waits forever: every call has a timeout and every microbatch a deadline. The rules:
docs/PIPELINE.md, "The trainer".
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time

import numpy as np
import torch
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.client.checks import CHECK_FRACTION, WorkChecks
from swarm.client.forwarded import ForwardedPipeline
from swarm.client.pipeline import LocalStage, TrainerParts
from swarm.client.relay import RelayedPipeline
from swarm.client.rpc import call_stage, ping
from swarm.client.window import AdaptiveWindow
from swarm.dataset.shards import TrainingStream, sample_batch
from swarm.dataset.stream import ChunkStream
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import (
    MAX_ATTESTED_PEERS,
    TrainerReport,
    announceable,
    announcement_lifetime,
    store_trainer_report,
)
from swarm.errors import MicrobatchFailedError
from swarm.manifests.manifest import Manifest
from swarm.network.coordinates import Vivaldi
from swarm.network.liveness import Liveness
from swarm.routing import Router
from swarm.watch.stats import Traffic, TrainerStats
from swarm.wire.validation import max_request_elements

logger = logging.getLogger(__name__)

PAUSED_LOOK = 0.2  # seconds between two looks of a paused trainer with nothing in flight at whether it resumed

REPORT_WINDOW = 30.0


class Trainer:
    def __init__(
        self,
        manifest: Manifest,
        dht: DHT,
        p2p: P2P,
        peer_id: str,
        seed: int | None = None,
        local_server: LocalStage | None = None,
        view: AnnouncementCache | None = None,
        traffic: Traffic | None = None,
        reachable: bool = True,
        position: Vivaldi | None = None,
        check_fraction: float = CHECK_FRACTION,
        router: Router | None = None,
    ):
        self.manifest = manifest
        self.reachable = reachable  # others can dial it: its reports carry its addresses
        self.traffic = traffic if traffic is not None else Traffic()  # shared with the peer's servers
        self.local_server = local_server  # this peer's own stage server: called directly, not over the network
        self.dht, self.p2p, self.peer_id = dht, p2p, peer_id
        # a private swarm's peers serve only its members (tests may leave p2p out)
        self.proof = manifest.proof(str(p2p.peer_id)) if p2p is not None else None
        # a peer shares one view between its trainer and its rebalancer: one DHT refresh per announce period
        self.view = view or AnnouncementCache(
            dht, manifest.swarm_id, manifest.num_stages, max_age=manifest.network.announce_period
        )
        self.rng = random.Random(seed)
        self.max_elements = max_request_elements(manifest)
        adaptive = manifest.training.adaptive_window and manifest.training.pipeline == "forward"
        self.window = AdaptiveWindow(  # microbatches in flight
            manifest.training.window_limit(), adaptive, stages=manifest.num_stages
        )
        self.router = router or Router(network_aware=manifest.training.routing == "network_aware")
        self.samples = 0
        self.microbatches = 0
        self.failed_microbatches = 0
        self.paused = False  # the owner paused the peer: no new microbatches (those in flight finish)
        self.in_flight = 0  # microbatches sent and not yet finished
        self.bytes_sent = 0  # activations, gradients and tokens sent to stage peers (not counting local calls)
        self.bytes_received = 0
        self.recent: collections.deque[tuple[float, float, int]] = collections.deque()  # (time, loss, samples)
        self.checks = WorkChecks(check_fraction)  # microbatches sent twice to find peers that compute wrong results
        self.parts = TrainerParts(manifest, self.router, self.view, self.rng, self._send, self._ban, self.proof)
        self.unserved_stages = self.parts.unserved_stages  # stages with no online peer at the last look
        self.served = self.parts.served  # samples each stage peer trained for this trainer
        self.forwarded = ForwardedPipeline(self.parts, self.window, self.checks, position, self._count_checked)
        self.relay = RelayedPipeline(self.parts)
        # a stage peer that vanished mid-call (its link cut) is given up in seconds, not at the call's timeout
        self.liveness = Liveness(lambda peer_id, timeout: ping(self.p2p, peer_id, manifest, timeout))

    # ------------------------------------------------------------------------------------------- training

    async def train(
        self, tokens: np.ndarray | TrainingStream | ChunkStream, stop: asyncio.Event, max_samples: int | None = None
    ) -> None:
        """Train on the windows a ChunkStream or TrainingStream hands out (or random windows of `tokens`) until
        `stop` is set (or max_samples are done)."""
        training = self.manifest.training
        data_rng = np.random.default_rng(self.rng.getrandbits(64))
        reporter = asyncio.create_task(self._report_forever())
        tasks: set[asyncio.Task] = set()
        try:
            while not stop.is_set() and (max_samples is None or self.samples < max_samples):
                while len(tasks) < self.window.size and not self.paused:
                    length = self.manifest.model.context_length
                    if isinstance(tokens, ChunkStream):  # may wait for a chunk to arrive
                        batch = await tokens.next_batch(training.microbatch_size, length)
                    elif isinstance(tokens, TrainingStream):
                        batch = tokens.next_batch(training.microbatch_size, length)
                    else:
                        batch = sample_batch(tokens, training.microbatch_size, length, data_rng)
                    tasks.add(asyncio.create_task(self._train_microbatch(*batch)))
                self.in_flight = len(tasks)
                if not tasks:  # paused, with nothing in flight
                    await asyncio.sleep(PAUSED_LOOK)
                    continue
                done, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._collect(task)
                self.in_flight = len(tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)

    async def drained(self, timeout: float) -> bool:
        """Paused: wait up to `timeout` for the microbatches in flight to finish; whether they did."""
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def _collect(self, task: asyncio.Task) -> None:
        try:
            loss, samples = task.result()
        except MicrobatchFailedError as e:
            self.failed_microbatches += 1
            self.window.failed()
            logger.warning(f"microbatch dropped: {e}")
            return
        except Exception:
            self.failed_microbatches += 1
            logger.exception("microbatch failed unexpectedly")
            return
        self.samples += samples
        self.microbatches += 1
        self.recent.append((time.monotonic(), loss, samples))

    async def _train_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        if self.manifest.training.pipeline == "forward":
            return await self.forwarded.microbatch(inputs, targets)
        return await self.relay.microbatch(inputs, targets)

    def _count_checked(self, samples: int) -> None:
        """The samples of a check's copy, trained like any other (the stages' counts and the trainer's agree)."""
        self.samples += samples

    async def _send(
        self, peer_id: str, kind: str, request: runtime_pb2.ExpertRequest, timeout: float
    ) -> runtime_pb2.ExpertResponse:
        """One call: to this peer's own server directly, else over the network (its bytes counted)."""
        if self.local_server is not None and peer_id == self.peer_id:
            return await asyncio.wait_for(self.local_server.handle(kind, request, self.peer_id), timeout)
        call = call_stage(self.p2p, peer_id, kind, request, timeout, self.max_elements)
        reply = await self.liveness.watch(call, peer_id, f"{kind} call")
        self.bytes_sent += request.ByteSize()
        self.bytes_received += reply.ByteSize()
        self.traffic.activation_sent += request.ByteSize()
        self.traffic.activation_received += reply.ByteSize()
        return reply

    # ---------------------------------------------------------------------------------------- evaluation

    async def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]], timeout: float = 120.0) -> float:
        """Mean loss of the swarm's current model on the given batches (forward only, nothing is trained)."""
        deadline = time.monotonic() + timeout
        semaphore = asyncio.Semaphore(self.manifest.training.window_limit())

        async def one(inputs: torch.Tensor, targets: torch.Tensor) -> float:
            async with semaphore:
                if self.manifest.training.pipeline == "forward":
                    loss, _ = await self.forwarded.microbatch(
                        inputs, targets, train=False, timeout=max(deadline - time.monotonic(), 0.1)
                    )
                    return loss
                return await self.relay.evaluate(inputs, targets, deadline)

        async with asyncio.TaskGroup() as group:  # the first failure cancels the rest
            tasks = [group.create_task(one(*batch)) for batch in batches]
        return float(np.mean([task.result() for task in tasks]))

    def _ban(self, peer_id: str, reason: str, wasted: float = 0.0) -> None:
        seconds = self.router.failed(peer_id, time.monotonic(), wasted)
        logger.info(f"banning peer {peer_id[-8:]} for {seconds:.0f}s: {reason}")

    # ------------------------------------------------------------------------------------------- reports

    def attested(self) -> tuple[tuple[str, int], ...]:
        """What this trainer's report vouches for: the peers that served it most, at most MAX_ATTESTED_PEERS; not
        this peer's own server (a peer vouching for itself would prove nothing)."""
        others = collections.Counter({p: n for p, n in self.served.items() if p != self.peer_id})
        return tuple(others.most_common(MAX_ATTESTED_PEERS))

    def recent_stats(self) -> tuple[float, float]:
        """(mean loss, samples per second) over the last REPORT_WINDOW seconds."""
        now = time.monotonic()
        while self.recent and now - self.recent[0][0] > REPORT_WINDOW:
            self.recent.popleft()
        if not self.recent:
            return float("nan"), 0.0
        loss = float(np.mean([r[1] for r in self.recent]))
        span = max(now - self.recent[0][0], 1.0)
        return loss, sum(r[2] for r in self.recent) / span

    def stats(self) -> TrainerStats:
        loss, speed = self.recent_stats()
        return TrainerStats(
            loss=loss,
            samples_per_second=speed,
            samples=self.samples,
            microbatches=self.microbatches,
            failed_microbatches=self.failed_microbatches,
            unserved_stages=tuple(sorted(self.unserved_stages)),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            window=self.window.size,
            round_trip=self.window.recent or 0.0,
            checks=self.checks.checks,
            check_disagreements=self.checks.disagreements,
            convicted=tuple(sorted(self.checks.convicted)),
        )

    async def _report_forever(self) -> None:
        period = self.manifest.network.announce_period
        maddrs: tuple[str, ...] = ()
        if (
            self.reachable
        ):  # so that stage peers that others cannot dial can dial this trainer (swarm/server/reachability.py)
            try:
                maddrs = announceable([str(a) for a in await self.p2p.get_visible_maddrs()])
            except ValueError:  # a node that does not listen has no address
                pass
        while True:
            await asyncio.sleep(period)
            loss, speed = self.recent_stats()
            report = TrainerReport(
                peer_id=self.peer_id,
                loss=loss,
                samples_per_second=speed,
                samples=self.samples,
                failed_microbatches=self.failed_microbatches,
                maddrs=maddrs,
                served=self.attested(),
                own_samples=self.served.get(self.peer_id, 0),
            )
            try:
                await store_trainer_report(self.dht, self.manifest.swarm_id, report, announcement_lifetime(period))
                announced = {a.peer_id for anns in await self.view.all_stages() for a in anns}
                self.router.forget(keep=announced)  # what was learnt of peers long gone
            except Exception as e:
                logger.warning(f"trainer report failed: {e!r}")
