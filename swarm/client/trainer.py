"""Trainer: reads its data shard, pushes microbatches through one peer per stage and back.

The choice of a peer per stage is swarm/routing.py's (by the trainer's own observations); this module sends the
calls (swarm/client/rpc.py, or this peer's own server directly; the relay pipeline's are in
swarm/client/relay.py), retries and bans, and reports progress (TrainerStats, and a report in the DHT). Nothing
waits forever: every call has a timeout and every microbatch a deadline. The rules: docs/ARCHITECTURE.md,
"Trainer".
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
import uuid

import numpy as np
import torch
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.client.checks import CHECK_FRACTION, CONVICTION_BAN, CheckPlan, WorkChecks, gradient_prints
from swarm.client.relay import NO_PEER_WAIT, RelayedPipeline
from swarm.client.rpc import call_stage
from swarm.client.window import AdaptiveWindow
from swarm.dataset.shards import TrainingStream, sample_batch
from swarm.dht.records import (
    MAX_ATTESTED_PEERS,
    SwarmView,
    TrainerReport,
    announceable,
    announcement_lifetime,
    store_trainer_report,
)
from swarm.errors import MicrobatchFailedError, RemoteStageError
from swarm.manifests.manifest import Manifest
from swarm.network.coordinates import Vivaldi
from swarm.routing import ORIGIN, Router, online_peers
from swarm.server.forwarding import BLAMELESS, MIN_BUDGET, check_reply, grace, onward_budget
from swarm.server.stage import StageServer
from swarm.watch.stats import Traffic, TrainerStats
from swarm.wire import protocol

logger = logging.getLogger(__name__)

REPORT_WINDOW = 30.0


class Trainer:
    def __init__(
        self,
        manifest: Manifest,
        dht: DHT,
        p2p: P2P,
        peer_id: str,
        seed: int | None = None,
        local_server: StageServer | None = None,
        view: SwarmView | None = None,
        traffic: Traffic | None = None,
        reachable: bool = True,
        position: Vivaldi | None = None,
        check_fraction: float = CHECK_FRACTION,
    ):
        self.manifest = manifest
        self.reachable = reachable  # others can dial it: its reports carry its addresses
        self.traffic = traffic if traffic is not None else Traffic()  # shared with the peer's servers
        self.local_server = local_server  # this peer's own stage server: called directly, not over the network
        self.dht, self.p2p, self.peer_id = dht, p2p, peer_id
        # a private swarm's peers serve only its members (tests may leave p2p out)
        self.proof = manifest.proof(str(p2p.peer_id)) if p2p is not None else None
        # a peer shares one view between its trainer and its rebalancer: one DHT refresh per announce period
        self.view = view or SwarmView(
            dht, manifest.swarm_id, manifest.num_stages, max_age=manifest.network.announce_period
        )
        self.rng = random.Random(seed)
        self.max_elements = protocol.max_request_elements(manifest)
        adaptive = manifest.training.adaptive_window and manifest.training.pipeline == "forward"
        self.window = AdaptiveWindow(  # microbatches in flight
            manifest.training.max_in_flight, adaptive, stages=manifest.num_stages
        )
        self.router = Router(network_aware=manifest.training.routing == "network_aware")
        self.position = position  # this peer's network coordinate (client/pinger.py keeps it), for route estimates
        self.unserved_stages: set[int] = set()  # stages with no online peer at the last look
        self.samples = 0
        self.microbatches = 0
        self.failed_microbatches = 0
        self.bytes_sent = 0  # activations, gradients and tokens sent to stage peers (not counting local calls)
        self.bytes_received = 0
        self.recent: collections.deque[tuple[float, float, int]] = collections.deque()  # (time, loss, samples)
        self.served: collections.Counter[str] = collections.Counter()  # samples each stage peer trained for us
        self.checks = WorkChecks(check_fraction)  # microbatches sent twice to find peers that compute wrong results
        self.relay = RelayedPipeline(
            manifest,
            self.router,
            self.view,
            self.rng,
            self._send,
            self._ban,
            self.proof,
            self.unserved_stages,
            self.served,
        )

    # ------------------------------------------------------------------------------------------- training

    async def train(
        self, tokens: np.ndarray | TrainingStream, stop: asyncio.Event, max_samples: int | None = None
    ) -> None:
        """Train on the windows a TrainingStream hands out (or random windows of `tokens`) until `stop` is set (or
        max_samples are done)."""
        training = self.manifest.training
        data_rng = np.random.default_rng(self.rng.getrandbits(64))
        reporter = asyncio.create_task(self._report_forever())
        tasks: set[asyncio.Task] = set()
        try:
            while not stop.is_set() and (max_samples is None or self.samples < max_samples):
                while len(tasks) < self.window.size:
                    length = self.manifest.model.context_length
                    if isinstance(tokens, TrainingStream):
                        batch = tokens.next_batch(training.microbatch_size, length)
                    else:
                        batch = sample_batch(tokens, training.microbatch_size, length, data_rng)
                    tasks.add(asyncio.create_task(self._train_microbatch(*batch)))
                done, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._collect(task)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)

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
            return await self._forwarded_microbatch(inputs, targets)
        return await self.relay.microbatch(inputs, targets)

    # ------------------------------------------------------------------ forwarded: stage to stage

    async def _forwarded_microbatch(
        self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True, timeout: float | None = None
    ) -> tuple[float, int]:
        """Send the microbatch to stage 0 with a route; the stages pass it on and back (server/forwarding.py).
        If stage 0's peer fails, the microbatch starts again elsewhere, under the same id (so a stage that applied
        its gradient already refuses it: nothing is applied twice)."""
        microbatch_id = uuid.uuid4().hex
        timeouts = self.manifest.training.timeouts
        deadline = time.monotonic() + (timeout if timeout is not None else timeouts.microbatch)
        stages = self.manifest.num_stages
        samples = inputs.shape[0]
        tried: set[str] = set()
        last_error: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            budget = onward_budget(remaining, 0.0, stages, timeouts.forward + timeouts.backward)
            if budget < MIN_BUDGET:
                raise MicrobatchFailedError(
                    f"the microbatch did not finish before its deadline (last error: {last_error!r})"
                )
            route = await self._route(samples, tried)
            if not route:
                tried.clear()
                await asyncio.sleep(NO_PEER_WAIT)
                continue
            plan = self.checks.plan(route, await self._online_ids(), self.rng) if train else None
            if plan is not None:  # a checked microbatch goes through the check's pair of replicas
                route = list(plan.route)
            tried.add(route[0])
            request = protocol.make_request(
                self.manifest,
                0,
                microbatch_id,
                [inputs, targets],
                train=train,
                proof=self.proof,
                route=route[1:],
                budget=budget,
            )
            for peer_id in route:
                self.router.started(peer_id, samples)
            check = asyncio.create_task(self._check_copy(plan, inputs, targets, budget)) if plan else None
            begin = time.monotonic()
            try:
                reply = await self._send(route[0], "train", request, budget + grace(budget))
                (loss,) = check_reply(reply, [()], self.max_elements)
                took = time.monotonic() - begin
                hops = protocol.decode_hops(reply, stages)
                self._learn(hops, took, samples)
                if train:
                    self.window.observe(took, time.monotonic())
                    self._attest(route[0], hops, samples)
                if check is not None and plan is not None:
                    other, check = await check, None
                    if other is not None:
                        self._judge(plan, float(loss), hops, *other)
                return float(loss), samples
            except RemoteStageError as e:
                last_error = e
                if e.code == "duplicate":  # an earlier attempt is still in progress there: its reply will be
                    tried.discard(route[0])  # replayed once it is done (nothing is applied twice)
                    await asyncio.sleep(NO_PEER_WAIT)
                if e.code not in BLAMELESS:
                    self._ban(route[0], f"train on stage 0: {e}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # timeouts, connection errors
                last_error = e
                self._ban(route[0], f"train on stage 0 failed: {type(e).__name__}: {e}")
            finally:
                for peer_id in route:
                    self.router.finished(peer_id, samples)
                if check is not None:  # the microbatch failed: its check means nothing
                    check.cancel()

    async def _online_ids(self) -> list[list[str]]:
        now = get_dht_time()
        return [[a.peer_id for a in online_peers(anns, now)] for anns in await self.view.all_stages()]

    async def _check_copy(
        self, plan: CheckPlan, inputs: torch.Tensor, targets: torch.Tensor, budget: float
    ) -> tuple[float, list[protocol.HopTiming]] | None:
        """The check's copy of a microbatch, an ordinary training microbatch through the other route; its loss and
        hops, or None if it failed (a failure says nothing of honesty: the usual bans handle it)."""
        request = protocol.make_request(
            self.manifest,
            0,
            uuid.uuid4().hex,
            [inputs, targets],
            train=True,
            proof=self.proof,
            route=list(plan.other_route[1:]),
            budget=budget,
        )
        try:
            reply = await self._send(plan.other_route[0], "train", request, budget + grace(budget))
            (loss,) = check_reply(reply, [()], self.max_elements)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug(f"a check's copy failed: {e!r}")
            return None
        hops = protocol.decode_hops(reply, self.manifest.num_stages)
        self._attest(plan.other_route[0], hops, inputs.shape[0])
        self.samples += inputs.shape[0]  # trained like any other: the stages' counts and the trainer's agree
        return float(loss), hops

    def _judge(
        self,
        plan: CheckPlan,
        loss: float,
        hops: list[protocol.HopTiming],
        other_loss: float,
        other_hops: list[protocol.HopTiming],
    ) -> None:
        prints = gradient_prints(plan, hops, other_hops)
        for peer_id in self.checks.record(plan, loss, other_loss, prints):
            self.router.ban(peer_id, time.monotonic() + CONVICTION_BAN)
            logger.warning(
                f"peer {peer_id[-8:]} of stage {plan.stage} computes wrong results (its losses or gradients disagreed with "
                f"{len(self.checks.disagreed.get(peer_id, ()))} peers that agree with others): left out of routes "
                f"for {CONVICTION_BAN / 60:.0f} minutes"
            )

    async def _route(self, samples: int, tried: set[str]) -> list[str]:
        """The route expected to finish soonest (swarm/routing.py); it stops before a stage without peers (a hop
        chooses itself there) and is empty if stage 0 has none left to try."""
        stages = self.manifest.num_stages
        origin = self.position.coordinate if self.position is not None else None
        for force in (False, True):  # peers may have joined since the last look
            online = [online_peers(await self.view.stage(s, force=force), get_dht_time()) for s in range(stages)]
            route = self.router.choose_route(online, samples, time.monotonic(), self.rng, tried, origin)
            if len(route) == stages:
                break
        for stage, peers in enumerate(online):
            if peers:
                self.unserved_stages.discard(stage)
            elif stage not in self.unserved_stages:
                self.unserved_stages.add(stage)
                logger.warning(f"no online peer serves stage {stage}; waiting for one to join")
        return [a.peer_id for a in route]

    def _attest(self, first: str, hops: list[protocol.HopTiming], samples: int) -> None:
        """Count a trained microbatch for the peers that did it: the stage-0 peer this trainer called, and the
        later hops as the reply names them (each a different peer of the next stage; the reply comes from the
        peers, so a dishonest stage-0 peer could name others: it cannot name itself twice)."""
        peers = [first, *(hop.peer_id for hop in hops[1:])]
        if len(set(peers)) == len(peers) and (not hops or hops[0].peer_id == first):
            for peer_id in peers:
                self.served[peer_id] += samples

    def attested(self) -> tuple[tuple[str, int], ...]:
        """What this trainer's report vouches for: the peers that served it most, at most MAX_ATTESTED_PEERS; not
        this peer's own server (a peer vouching for itself would prove nothing)."""
        others = collections.Counter({p: n for p, n in self.served.items() if p != self.peer_id})
        return tuple(others.most_common(MAX_ATTESTED_PEERS))

    def _learn(self, hops: list[protocol.HopTiming], took: float, samples: int) -> None:
        """What a reply's hop timings say of each peer on the way: its compute, and the transfer to it from the
        hop before (or from this trainer) and back."""
        for index, hop in enumerate(hops):
            reached = took if index == 0 else hops[index - 1].total - hops[index - 1].compute
            source = ORIGIN if index == 0 else hops[index - 1].peer_id
            self.router.observed_hop(source, hop.peer_id, samples, hop.compute, max(reached - hop.total, 0.0))

    async def _send(
        self, peer_id: str, kind: str, request: runtime_pb2.ExpertRequest, timeout: float
    ) -> runtime_pb2.ExpertResponse:
        """One call: to this peer's own server directly, else over the network (its bytes counted)."""
        if self.local_server is not None and peer_id == self.peer_id:
            return await asyncio.wait_for(self.local_server.handle(kind, request, self.peer_id), timeout)
        reply = await call_stage(self.p2p, peer_id, kind, request, timeout, self.max_elements)
        self.bytes_sent += request.ByteSize()
        self.bytes_received += reply.ByteSize()
        self.traffic.activation_sent += request.ByteSize()
        self.traffic.activation_received += reply.ByteSize()
        return reply

    # ---------------------------------------------------------------------------------------- evaluation

    async def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]], timeout: float = 120.0) -> float:
        """Mean loss of the swarm's current model on the given batches (forward only, nothing is trained)."""
        deadline = time.monotonic() + timeout
        semaphore = asyncio.Semaphore(self.manifest.training.max_in_flight)

        async def one(inputs: torch.Tensor, targets: torch.Tensor) -> float:
            async with semaphore:
                if self.manifest.training.pipeline == "forward":
                    loss, _ = await self._forwarded_microbatch(
                        inputs, targets, train=False, timeout=max(deadline - time.monotonic(), 0.1)
                    )
                    return loss
                return await self.relay.evaluate(inputs, targets, deadline)

        async with asyncio.TaskGroup() as group:  # the first failure cancels the rest
            tasks = [group.create_task(one(*batch)) for batch in batches]
        return float(np.mean([task.result() for task in tasks]))

    def _ban(self, peer_id: str, reason: str) -> None:
        seconds = self.router.failed(peer_id, time.monotonic())
        logger.info(f"banning peer {peer_id[-8:]} for {seconds:.0f}s: {reason}")

    # ------------------------------------------------------------------------------------------- reports

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
