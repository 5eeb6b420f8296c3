"""The forward pipeline, from the trainer's side: a microbatch goes to a stage-0 peer with a route, and the stages
pass it on to each other and bring back the loss (swarm/server/forwarding.py is the stages' side).

For each microbatch the trainer picks the route expected to finish soonest (swarm/routing.py) and sends stage 0
the tokens, the targets, the route and a budget (the hop rules of swarm/wire/hops.py); the reply carries the loss
and each hop's timings, from which the trainer learns the compute of each peer and the transfer time of each
link on the way. If stage 0's peer fails, the microbatch starts again elsewhere under the same id, so a stage
that applied it already refuses it: nothing is applied twice. A few microbatches go twice, through two
replicas of one stage, to catch peers that compute wrong results (swarm/client/checks.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import torch
from hivemind.utils import get_dht_time

from swarm.client.checks import CONVICTION_BAN, CheckPlan, WorkChecks, gradient_prints
from swarm.client.pipeline import NO_PEER_WAIT, TrainerParts
from swarm.client.window import AdaptiveWindow
from swarm.errors import MicrobatchFailedError, RemoteStageError
from swarm.network.coordinates import Vivaldi
from swarm.routing import ORIGIN, online_peers
from swarm.wire.boundary import token_tensor
from swarm.wire.codes import ErrorCode
from swarm.wire.hops import BLAMELESS, MIN_BUDGET, HopTiming, check_reply, decode_hops, grace, onward_budget
from swarm.wire.messages import make_request

logger = logging.getLogger(__name__)


class ForwardedPipeline:
    """Runs microbatches through routes of stage peers that forward them, for a Trainer (whose parts it uses)."""

    def __init__(
        self,
        parts: TrainerParts,
        window: AdaptiveWindow,
        checks: WorkChecks,
        position: Vivaldi | None,
        count_samples: Callable[[int], None],
    ):
        self.parts, self.manifest = parts, parts.manifest
        self.max_elements = parts.max_elements
        self.window = window  # the trainer's microbatches in flight: it learns from their round trips
        self.checks = checks  # microbatches sent twice to find peers that compute wrong results
        self.position = position  # this peer's network coordinate (client/pinger.py keeps it), for route estimates
        self.count_samples = count_samples  # the trainer counts the samples of a check's copy as trained

    async def microbatch(
        self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True, timeout: float | None = None
    ) -> tuple[float, int]:
        """Send the microbatch to stage 0 with a route, and retry elsewhere until it succeeds or its deadline
        passes (MicrobatchFailedError); its loss and samples."""
        parts = self.parts
        targets = token_tensor(self.manifest, inputs, targets)  # the window in a subspace swarm
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
            plan = self.checks.plan(route, await self._online_ids(), parts.rng) if train else None
            if plan is not None:  # a checked microbatch goes through the check's pair of replicas
                route = list(plan.route)
            tried.add(route[0])
            request = make_request(
                self.manifest,
                0,
                microbatch_id,
                [inputs, targets],
                train=train,
                proof=parts.proof,
                route=route[1:],
                budget=budget,
            )
            for peer_id in route:
                parts.router.started(peer_id, samples)
            check = asyncio.create_task(self._check_copy(plan, inputs, targets, budget)) if plan else None
            begin = time.monotonic()
            try:
                reply = await parts.send(route[0], "train", request, budget + grace(budget))
                (loss,) = check_reply(reply, [()], self.max_elements)
                took = time.monotonic() - begin
                hops = decode_hops(reply, stages)
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
                if e.code == ErrorCode.BUSY and train:  # a full stage: the window is more than it can take
                    self.window.busy()
                if e.code == ErrorCode.DUPLICATE:  # an earlier attempt is still in progress there: its reply will
                    tried.discard(route[0])  # be replayed once it is done (nothing is applied twice)
                    await asyncio.sleep(NO_PEER_WAIT)
                if e.code not in BLAMELESS:
                    parts.ban(route[0], f"train on stage 0: {e}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # timeouts, connection errors
                last_error = e
                parts.ban(route[0], f"train on stage 0 failed: {type(e).__name__}: {e}", time.monotonic() - begin)
            finally:
                for peer_id in route:
                    parts.router.finished(peer_id, samples)
                if check is not None:  # the microbatch failed: its check means nothing
                    check.cancel()

    async def _route(self, samples: int, tried: set[str]) -> list[str]:
        """The route expected to finish soonest (swarm/routing.py); it stops before a stage without peers (a hop
        chooses itself there) and is empty if stage 0 has none left to try."""
        parts, stages = self.parts, self.manifest.num_stages
        origin = self.position.coordinate if self.position is not None else None
        for force in (False, True):  # peers may have joined since the last look
            online = [await parts.online(s, force=force) for s in range(stages)]
            route = parts.router.choose_route(online, samples, time.monotonic(), parts.rng, tried, origin)
            if len(route) == stages:
                break
        for stage, peers in enumerate(online):
            parts.note_online(stage, bool(peers))
        return [a.peer_id for a in route]

    async def _online_ids(self) -> list[list[str]]:
        now = get_dht_time()
        return [[a.peer_id for a in online_peers(anns, now)] for anns in await self.parts.view.all_stages()]

    def _learn(self, hops: list[HopTiming], took: float, samples: int) -> None:
        """What a reply's hop timings say of each peer on the way: its compute, and the transfer to it from the
        hop before (or from this trainer) and back."""
        for index, hop in enumerate(hops):
            reached = took if index == 0 else hops[index - 1].total - hops[index - 1].compute
            source = ORIGIN if index == 0 else hops[index - 1].peer_id
            self.parts.router.observed_hop(source, hop.peer_id, samples, hop.compute, max(reached - hop.total, 0.0))

    def _attest(self, first: str, hops: list[HopTiming], samples: int) -> None:
        """Count a trained microbatch for the peers that did it: the stage-0 peer this trainer called, and the
        later hops as the reply names them (each a different peer of the next stage; the reply comes from the
        peers, so a dishonest stage-0 peer could name others: it cannot name itself twice)."""
        peers = [first, *(hop.peer_id for hop in hops[1:])]
        if len(set(peers)) == len(peers) and (not hops or hops[0].peer_id == first):
            for peer_id in peers:
                self.parts.served[peer_id] += samples

    # ------------------------------------------------------------------------------------ checked work

    async def _check_copy(
        self, plan: CheckPlan, inputs: torch.Tensor, targets: torch.Tensor, budget: float
    ) -> tuple[float, list[HopTiming]] | None:
        """The check's copy of a microbatch, an ordinary training microbatch through the other route; its loss and
        hops, or None if it failed (a failure says nothing of honesty: the usual bans handle it)."""
        request = make_request(
            self.manifest,
            0,
            uuid.uuid4().hex,
            [inputs, targets],
            train=True,
            proof=self.parts.proof,
            route=list(plan.other_route[1:]),
            budget=budget,
        )
        try:
            reply = await self.parts.send(plan.other_route[0], "train", request, budget + grace(budget))
            (loss,) = check_reply(reply, [()], self.max_elements)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug(f"a check's copy failed: {e!r}")
            return None
        hops = decode_hops(reply, self.manifest.num_stages)
        self._attest(plan.other_route[0], hops, inputs.shape[0])
        self.count_samples(inputs.shape[0])  # trained like any other: the stages' counts and the trainer's agree
        return float(loss), hops

    def _judge(
        self,
        plan: CheckPlan,
        loss: float,
        hops: list[HopTiming],
        other_loss: float,
        other_hops: list[HopTiming],
    ) -> None:
        prints = gradient_prints(plan, hops, other_hops)
        for peer_id in self.checks.record(plan, loss, other_loss, prints):
            self.parts.router.ban(peer_id, time.monotonic() + CONVICTION_BAN)
            logger.warning(
                f"peer {peer_id[-8:]} of stage {plan.stage} computes wrong results (its losses or gradients disagreed with "
                f"{len(self.checks.disagreed.get(peer_id, ()))} peers that agree with others): left out of routes "
                f"for {CONVICTION_BAN / 60:.0f} minutes"
            )
