"""Stage-to-stage forwarding: a train request goes from stage to stage, its gradient comes back the same way.

A trainer sends stage 0 the tokens and targets of a microbatch, with a route (the peers it chose for the later
stages) and a budget (seconds to reply). Each hop runs forward in its worker, sends its output on to the next
stage's peer, waits for the reply (the loss and the gradient of its output), runs backward, and replies with the
loss and the gradient of its own input; the last stage runs forward, loss and backward at once. So activations
cross each link between consecutive stages once each way, and the trainer's link carries only tokens and a loss.

The guarantees (docs/PIPELINE.md, "Stage-to-stage forwarding"):

- **Nothing waits forever.** A hop's deadline is its arrival plus its budget. It gives the next hop a smaller
  budget (its own backward and a grace period are kept back) and waits for it at most that budget plus the grace.
- **A failed hop is routed around from the last stage that holds the activations.** If the next peer fails, is
  busy or times out, this hop sends the same output to another peer of that stage, while its budget lasts.
- **No gradient is applied twice.** A peer applies a microbatch's gradient only before its deadline, and its
  caller moves on to another peer only after that deadline plus the grace period; a peer takes each microbatch
  once: a repeat of a microbatch it already applied gets its first reply again (nothing is applied twice), and a
  repeat of one still in progress gets `duplicate`.
- **Every message is validated** like a trainer's request (swarm id, proofs in a private swarm, bans, sizes,
  shapes, dtypes, finite values), and every reply like a trainer checks one.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.client.rpc import call_stage, ping
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.errors import (
    BadRequestError,
    DownstreamFailedError,
    DuplicateMicrobatchError,
    RemoteStageError,
    StageStoppedError,
    TooLateError,
    WrongStageError,
)
from swarm.manifests.manifest import Manifest
from swarm.network.liveness import Liveness
from swarm.routing import Router, online_peers
from swarm.server.compute import StageCompute
from swarm.server.request_path import RequestPath
from swarm.watch.stats import Traffic
from swarm.wire.boundary import check_token_tensor, sends_window
from swarm.wire.codes import ErrorCode
from swarm.wire.hops import (
    BLAMELESS,
    MIN_BUDGET,
    HopTiming,
    check_reply,
    decode_hops,
    encode_hops,
    grace,
    onward_budget,
)
from swarm.wire.messages import Onward, StageRequest, make_reply, make_request
from swarm.wire.tensors import gradient_fingerprint, wire_compression
from swarm.wire.validation import (
    check_inputs,
    decode_fields,
    decode_metadata,
    decode_onward,
    decode_tensors,
    max_request_elements,
)

logger = logging.getLogger(__name__)

NO_PEER_WAIT = 0.5


class LocalStages(Protocol):
    """The stages this peer serves (server/dispatch.py's StageDispatcher): a hop to the next stage of its own span
    is a call in this process, not over a link."""

    def local(self, stage: int) -> object | None: ...

    async def handle(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str
    ) -> runtime_pb2.ExpertResponse: ...


@dataclass
class _Forwarded:
    """A hop's forward, done: what it needs for backward."""

    request: StageRequest  # its tensors: [inputs, targets]
    outputs: list[torch.Tensor]
    compute_seconds: float


@dataclass
class _Replayed:
    """A repeat of a microbatch applied here already: its first reply (see StageCompute.replay)."""

    tensors: list[torch.Tensor]


class Forwarder:
    """The train requests of one served stage: the hop's compute in the worker, the call to the next stage."""

    def __init__(self, manifest: Manifest, stage: int, peer_id: str, path: RequestPath, traffic: Traffic):
        self.manifest, self.stage, self.peer_id = manifest, stage, peer_id
        self.path, self.traffic = path, traffic
        self.last = stage == manifest.num_stages - 1
        self.max_elements = max_request_elements(manifest)
        self.proof = manifest.proof(peer_id)
        self.router = Router()  # this hop's own observations of the next stage's peers
        self.rng = random.Random()
        self.p2p: P2P | None = None
        self.view: AnnouncementCache | None = None
        self.local: LocalStages | None = None
        self.liveness: Liveness | None = None
        self.forwarded = 0  # microbatches this hop passed on and brought back
        self.rerouted = 0  # next hops that failed and were replaced by another peer of their stage
        self.replayed = 0  # repeats of applied microbatches answered with their first reply
        self.in_flight = 0  # train requests being handled (a draining peer waits for them)

    @property
    def too_late(self) -> int:
        """Gradients not applied because the hop's deadline had passed."""
        return self.path.errors[ErrorCode.TOO_LATE]

    @property
    def duplicates(self) -> int:
        """Train requests for microbatches this hop, or the next, had already."""
        return self.path.errors[ErrorCode.DUPLICATE]

    def attach(self, p2p: P2P, view: AnnouncementCache, local: LocalStages | None = None) -> None:
        """The peer's connection, its picture of the swarm and the stages it serves, once it serves."""
        self.p2p, self.view, self.local = p2p, view, local
        # a next peer that vanished mid-call (its link cut) is routed around in seconds, not at the budget's end
        self.liveness = Liveness(lambda peer_id, timeout: ping(p2p, peer_id, self.manifest, timeout))

    # ------------------------------------------------------------------------------------ one hop

    async def handle(self, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        """One train request. It runs to its end even if the caller goes away meanwhile (its deadline bounds it):
        once the later stages have applied a microbatch, this stage applies it too, so that the stages of a
        swarm apply the same microbatches."""
        self.in_flight += 1
        task = asyncio.ensure_future(self._handle(request, caller))

        def done(_: asyncio.Future) -> None:
            self.in_flight -= 1

        task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _handle(self, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        try:
            return await self._handle_train(request, caller)
        except StageStoppedError as e:  # the stage stopped here meanwhile (a move, a leave): 'busy', no blame
            return self.path.error_reply("train", caller, e)

    async def _handle_train(self, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        arrival = time.monotonic()
        path = self.path
        if (refusal := path.refusal(caller)) is not None:
            return refusal
        try:
            metadata = decode_metadata(request, self.manifest, caller)
            fields = decode_fields(metadata, self.manifest)
            onward = decode_onward(metadata, self.manifest, fields.stage)
        except BadRequestError as e:
            return path.error_reply("train", caller, e)
        if fields.stage != self.stage:  # a stage this peer left (the caller's records are older): before any wait
            return path.error_reply("train", caller, WrongStageError(f"this peer does not serve stage {fields.stage}"))
        deadline = arrival + onward.budget
        if not fields.train:
            reply, _ = await self._hop(request, caller, fields, onward, arrival, deadline)
            return reply
        # a gradient will be applied here: it takes a slot of the stage's step (server/step_gate.py), waiting at
        # most half the budget for one (then 'busy': the hop before tries another peer of this stage)
        key = (caller, fields.microbatch_id)
        wait_until = arrival + onward.budget / 2
        expires = deadline + grace(onward.budget)
        if refusal := await path.take_gradient_slot(caller, key, expires, wait_until, pinned=self.last):
            return refusal
        applied = False
        try:
            reply, applied = await self._hop(request, caller, fields, onward, arrival, deadline)
            return reply
        finally:
            await path.release_gradient_slot(key, applied)

    async def _hop(
        self,
        request: runtime_pb2.ExpertRequest,
        caller: str,
        fields: StageRequest,
        onward: Onward,
        arrival: float,
        deadline: float,
    ) -> tuple[runtime_pb2.ExpertResponse, bool]:
        """Forward here, the next stages, backward here: the reply, and whether a gradient was applied here."""
        path, max_elements = self.path, self.max_elements
        forwarded = await path.run(
            "train", caller, lambda c: _forward(c, request, fields, caller, max_elements, deadline)
        )
        if isinstance(forwarded, runtime_pb2.ExpertResponse):
            return forwarded, False
        if isinstance(forwarded, _Replayed):
            self.replayed += 1
            return self._reply(forwarded.tensors, 0.0, arrival, []), False
        if self.last:
            # the last stage's forward ran its backward
            return self._reply(forwarded.outputs, forwarded.compute_seconds, arrival, []), fields.train
        inputs, targets = forwarded.request.tensors
        try:
            outputs, hops = await self._onward(fields, onward, forwarded.outputs[0], targets, deadline)
        except (DownstreamFailedError, DuplicateMicrobatchError) as e:
            if fields.train:
                await path.worker.run(lambda c: c.settle(fields.microbatch_id, False, caller))
            return path.error_reply("train", caller, e), False
        except BaseException:  # a bug, or a cancelled call: the microbatch is not left in progress here for good
            if fields.train and not path.worker.finished:  # (a stopped stage keeps nothing in progress)
                await asyncio.shield(path.worker.run(lambda c: c.settle(fields.microbatch_id, False, caller)))
            raise
        if not fields.train:
            return self._reply(outputs, forwarded.compute_seconds, arrival, hops), False
        loss, grad = outputs
        if not path.pin_gradient_slot((caller, fields.microbatch_id)):
            # the later stages took so long that the step went on without this microbatch (server/step_gate.py)
            await path.worker.run(lambda c: c.settle(fields.microbatch_id, False, caller))
            late = TooLateError(f"stage {self.stage}: the next stages answered after the step went on without it")
            return path.error_reply("train", caller, late), False
        extras = [targets] if sends_window(self.manifest) and self.stage > 0 else []
        backward = StageRequest(fields.stage, fields.microbatch_id, True, [grad, inputs, *extras])
        # backward of a forward taken on is never refused: its slot is taken without admission's checks
        result = await path.run("train", caller, lambda c: _backward(c, backward, caller, deadline, loss))
        if isinstance(result, runtime_pb2.ExpertResponse):
            return result, False
        grads, seconds = result
        self.forwarded += 1
        fingerprint = gradient_fingerprint(grad)  # on every train microbatch: a hop cannot tell which is a check
        return self._reply([loss, *grads], forwarded.compute_seconds + seconds, arrival, hops, fingerprint), True

    def _reply(
        self,
        tensors: list[torch.Tensor],
        compute: float,
        arrival: float,
        later: list[HopTiming],
        gradient_print: list[float] | None = None,
    ) -> runtime_pb2.ExpertResponse:
        here = HopTiming(self.peer_id, compute, time.monotonic() - arrival, tuple(gradient_print or ()))
        return make_reply(tensors, wire_compression(self.manifest), hops=encode_hops(here, later))

    # ------------------------------------------------------------------------------- the next hop

    async def _onward(
        self,
        fields: StageRequest,
        onward: Onward,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        deadline: float,
    ) -> tuple[list[torch.Tensor], list[HopTiming]]:
        """Send the output to a peer of the next stage (the route's, else the best by this hop's observations),
        and on failure to others, until the budget runs out. The reply's tensors, checked, and its hop timings.
        Raises DownstreamFailedError when the budget ran out, DuplicateMicrobatchError when the next stage has
        this microbatch already."""
        assert self.p2p is not None and self.view is not None and self.liveness is not None, "attach first"
        following = self.stage + 1
        stages_after = self.manifest.num_stages - following
        timeouts = self.manifest.training.timeouts
        samples = hidden.shape[0]
        expect = [(), tuple(hidden.shape)] if fields.train else [()]
        preferred = onward.route[0] if onward.route else None
        tried: set[str] = set()
        last_error: Exception | None = None
        while True:
            reserve = 1.0 + 3 * self.path.worker.seconds_per_request  # this hop's backward
            remaining = deadline - time.monotonic()
            budget = onward_budget(remaining, reserve, stages_after, timeouts.forward + timeouts.backward)
            if budget < MIN_BUDGET:
                raise DownstreamFailedError(
                    f"stage {self.stage}: no time left to reach stage {following} (last error: {last_error!r})"
                )
            peer_id = await self._choose(following, preferred, tried, samples)
            if peer_id is None:
                tried.clear()
                await asyncio.sleep(min(NO_PEER_WAIT, max(remaining - reserve, 0)))
                continue
            if tried:
                self.rerouted += 1
            tried.add(peer_id)
            here = peer_id == self.peer_id  # the next stage of this peer's own span
            request = make_request(
                self.manifest,
                following,
                fields.microbatch_id,
                [hidden, targets],
                train=fields.train,
                proof=self.proof,
                compression="float32" if here else None,  # nothing crosses a link: nothing is lost
                route=onward.route[1:],
                budget=budget,
            )
            self.router.started(peer_id, samples)
            begin = time.monotonic()
            try:
                if here and self.local is not None:
                    reply = await asyncio.wait_for(
                        self.local.handle("train", request, self.peer_id), budget + grace(budget)
                    )
                else:
                    call = call_stage(self.p2p, peer_id, "train", request, budget + grace(budget), self.max_elements)
                    reply = await self.liveness.watch(call, peer_id, f"train on stage {following}")
                    self.traffic.activation_sent += request.ByteSize()
                    self.traffic.activation_received += reply.ByteSize()
                outputs = check_reply(reply, expect, self.max_elements)
                hops = decode_hops(reply, stages_after)
                took = time.monotonic() - begin
                here = hops[0] if hops and hops[0].peer_id == peer_id else None
                # the next peer's time: its compute and the transfer to and from it (not the stages after it)
                own = took - here.total + here.compute if here is not None else took / stages_after
                self.router.observed(peer_id, samples, max(own, 1e-6))
                return outputs, hops
            except RemoteStageError as e:
                last_error = e
                if e.code == ErrorCode.DUPLICATE:
                    raise DuplicateMicrobatchError(
                        f"stage {self.stage}: stage {following} has this microbatch already"
                    ) from None
                if e.code not in BLAMELESS:
                    self._ban(peer_id, f"train on stage {following}: {e}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # timeouts, connection errors
                last_error = e
                self._ban(
                    peer_id, f"train on stage {following} failed: {type(e).__name__}: {e}", time.monotonic() - begin
                )
            finally:
                self.router.finished(peer_id, samples)

    async def _choose(self, stage: int, preferred: str | None, tried: set[str], samples: int) -> str | None:
        assert self.view is not None
        now = time.monotonic()
        online = online_peers(await self.view.stage(stage), get_dht_time())
        if preferred is not None and preferred not in tried and not self.router.is_banned(preferred, now):
            if any(a.peer_id == preferred for a in online):
                return preferred
        if preferred is None and self.local is not None and self.local.local(stage) and self.peer_id not in tried:
            return self.peer_id  # no route given: this peer's own next stage costs no link
        chosen = self.router.choose(online, samples, now, self.rng, exclude=tried)
        if chosen is None:
            online = online_peers(await self.view.stage(stage, force=True), get_dht_time())
            chosen = self.router.choose(online, samples, now, self.rng, exclude=tried)
        return None if chosen is None else chosen.peer_id

    def _ban(self, peer_id: str, reason: str, wasted: float = 0.0) -> None:
        seconds = self.router.failed(peer_id, time.monotonic(), wasted)
        logger.info(f"stage {self.stage}: not sending to {peer_id[-8:]} for {seconds:.0f}s: {reason}")


# --------------------------------------------------------------------------------- in the worker


def _forward(
    compute: StageCompute,
    request: runtime_pb2.ExpertRequest,
    fields: StageRequest,
    caller: str,
    max_elements: int,
    deadline: float,
) -> _Forwarded | _Replayed:
    """A hop's forward: read the tensors [inputs, targets] (the window in a subspace swarm: swarm/wire/boundary.py),
    take the microbatch on (once), run forward (the last stage: forward, loss and backward). Raises what it cannot
    serve (the microbatch is let go again)."""
    begin = time.perf_counter()
    claimed = False
    try:
        req = decode_tensors(request, fields, max_elements)
        if len(req.tensors) != 2:
            raise BadRequestError(f"a train request carries [inputs, targets], got {len(req.tensors)} tensors")
        if req.stage != compute.stage:
            raise WrongStageError(f"this peer serves stage {compute.stage} now, not stage {req.stage}")
        inputs, targets = req.tensors
        check_inputs(inputs, compute.manifest, compute.stage)
        check_token_tensor(compute.manifest, targets, inputs)
        if req.train:
            if (replay := compute.replay(req.microbatch_id)) is not None:
                return _Replayed(replay)
            compute.claim(req.microbatch_id)
            claimed = True
        takes_tokens = compute.last or (sends_window(compute.manifest) and not compute.first)
        tensors = req.tensors if takes_tokens else [inputs]
        step = StageRequest(req.stage, req.microbatch_id, req.train, tensors)
        outputs = compute.process("forward", step, caller, apply_before=deadline)
        if compute.last and claimed:
            compute.settle(req.microbatch_id, True, caller, reply=outputs)
        return _Forwarded(req, outputs, time.perf_counter() - begin)
    except Exception:
        if claimed:
            compute.settle(fields.microbatch_id, False, caller)
        raise


def _backward(
    compute: StageCompute, req: StageRequest, caller: str, deadline: float, loss: torch.Tensor
) -> tuple[list[torch.Tensor], float]:
    """A hop's backward with the gradient the next stage sent back: ([grad of inputs] or [], seconds)."""
    begin = time.perf_counter()
    try:
        grads = compute.process("backward", req, caller, apply_before=deadline)
        compute.settle(req.microbatch_id, True, caller, reply=[loss, *grads])
        return grads, time.perf_counter() - begin
    except Exception:
        compute.settle(req.microbatch_id, False, caller)
        raise
