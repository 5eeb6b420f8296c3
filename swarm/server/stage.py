"""StageServer: serves forward and backward of one pipeline stage over hivemind P2P.

Why our own ServicerBase and not hivemind.moe (see docs/ARCHITECTURE.md): we validate every request before it
touches the model, keep each forward's activations so that backward does not recompute them, accumulate
gradients over `microbatches_per_step` backward passes before a local optimizer step, and answer bad
requests with an error reply instead of an exception.

All model work runs in one worker thread, so requests never race on the weights, and the event loop stays
free to receive requests and to announce.

Besides forward and backward, a server answers two control calls: a bandwidth probe (other peers measure
their links against it) and a download of its stage's state (parameters, optimizer statistics and, in DiLoCo
mode, the outer optimizer's state), which a peer that starts serving the same stage loads before it announces
itself online.

In the background it averages with the stage's other peers (swarm/averaging.py): every `every_samples` samples
served by the stage across the swarm, as counted from everyone's announcements, it takes part in a round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035 (hivemind detects streams by typing.AsyncIterator only)

import torch
from hivemind import DHT
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm import protocol
from swarm.averaging import (
    AveragingError,
    RoundProgress,
    StageAverager,
    current_round,
    round_payload_bytes,
    swarm_samples_in_round,
)
from swarm.bans import Bans
from swarm.checkpoint import save_checkpoint
from swarm.errors import BadRequestError
from swarm.manifest import Manifest
from swarm.model import StageModel
from swarm.records import MAX_THROUGHPUT, Announcement, PeerState, SwarmView, announcement_lifetime, store_announcement
from swarm.server.state import (
    load_state_tensors,
    make_optimizer,
    outer_state_shapes,
    state_shapes,
    state_tensors,
    trainable_parameters,
)
from swarm.throughput import (
    FORWARD_SHARE,
    PROBE_BYTES,
    DeliveredThroughput,
    SimulatedSpeed,
    Throughput,
    device_name,
)

logger = logging.getLogger(__name__)

NAMESPACE = "swarm"
MAX_PENDING_REQUESTS = 64  # requests in flight (queued or running) before new ones get a prompt 'busy' reply
MAX_PENDING_PER_CALLER = 16  # so that one caller (or a flood from one peer) cannot take every slot
# A slow peer takes fewer: past this share of the forward timeout of expected queueing (requests in flight x
# seconds per request), a new request would likely time out in the queue, so the caller is better off elsewhere.
MAX_QUEUE_WAIT_SHARE = 0.5
MAX_CONTROL_REQUEST_BYTES = 2**20  # a state request is tiny; a larger one is read to its end, so its refusal arrives
MAX_DRAINS = 8  # refused request streams read to their end at once (so that their reply arrives); more are cut
MAX_CONTROL_CALLS = 4  # state downloads served at once; each holds up to a stage's state in memory
ACTIVATION_CACHE_BYTES = 1 << 30


STATE_SOURCES = 3  # peers tried, one after another, for a stage's state
MAX_ANNOUNCEMENTS_IN_FLIGHT = 3
CATCH_UP_BY_DOWNLOAD = 2  # rounds behind the stage from which a peer takes the stage's state (parameters mode)
ROUND_CHECK_PERIOD = 1.0  # seconds between two looks at whether an averaging round is due
NEAR_ROUND = 0.75  # past this share of a round's samples, those looks read fresh records


@dataclass
class Traffic:
    """Bytes this peer moved over the network, by kind; shared by its stage servers (one after another, as it
    moves) and its trainer, and announced as totals."""

    activation_sent: int = 0  # activations and gradients between stages
    activation_received: int = 0
    averaging_sent: int = 0  # payload of averaging rounds
    averaging_received: int = 0


@dataclass
class RoundCounters:
    """Where this peer stands in its stage's averaging."""

    round: int = 0  # number of the stage's next round
    round_started_at: int = 0  # samples_served when that round's count began
    weight_started_at: int = 0  # samples_served at this peer's last successful round (its weight counts from here)
    rounds: int = 0  # rounds averaged with at least one other peer
    failed: int = 0  # rounds that did not happen (no group, a peer left, a timeout)
    last_group_size: int = 0


class WrongStageError(Exception):
    """A request for another stage than the one this peer serves (it has moved, or the caller's view is old)."""


class UnknownMicrobatchError(Exception):
    """Backward for a microbatch whose forward is not cached here, sent without inputs to recompute it."""


@dataclass
class _CachedForward:
    inputs: torch.Tensor
    outputs: torch.Tensor
    weights: list[torch.Tensor]  # the weights forward ran with (stashed), so backward uses the same ones
    created: float


class StageServer(ServicerBase):
    def __init__(
        self,
        manifest: Manifest,
        stage: int,
        model: StageModel,
        device: torch.device,
        peer_id: str,
        throughput: Throughput,
        *,
        pinned: bool = False,
        public_name: str = "",
        simulated: SimulatedSpeed | None = None,
        started: float | None = None,
        traffic: Traffic | None = None,
        checkpoint_dir: Path | None = None,
        checkpoint_every: float = 0.0,
        reachable: bool = True,
        maddrs: tuple[str, ...] = (),
    ):
        self.manifest = manifest
        self.reachable, self.maddrs = reachable, maddrs  # announced: an undialable peer dials others instead
        self.stage = stage
        self.model = model.to(device)
        self.device = device
        self.peer_id = peer_id
        self.throughput = throughput
        self.pinned = pinned
        self.public_name = public_name
        self.simulated = simulated  # testing aid: emulate a slower device
        self.started = time.monotonic() if started is None else started  # when the peer (not this stage) began
        self.delivered = DeliveredThroughput()
        self.traffic = traffic if traffic is not None else Traffic()
        self.rounds = RoundCounters()
        self.averager: StageAverager | None = None  # created on join (it needs the DHT); none in mode "none"
        self._view: SwarmView | None = None
        self._average_task: asyncio.Task | None = None
        self.checkpoint_dir = checkpoint_dir  # None: no checkpoints
        self.checkpoint_every = checkpoint_every  # seconds between two periodic checkpoints; 0: only on shutdown
        self.checkpoints_saved = 0
        self._checkpoint_task: asyncio.Task | None = None
        self._went_online = False  # a server that never served has nothing worth a checkpoint
        self.first = stage == 0
        self.last = stage == manifest.num_stages - 1
        named = trainable_parameters(self.model)
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = make_optimizer(manifest, self.params)
        self.max_elements = protocol.max_request_elements(manifest)
        self.max_message_bytes = protocol.max_message_bytes(manifest)

        # Model state: touched only in the worker thread. Counters are read by the event loop for announcements.
        self.weights_version = 0  # bumps on every optimizer step
        self.backward_passes = 0  # since the last optimizer step
        self.optimizer_steps = 0
        self.samples_served = 0
        self.bad_requests = 0  # counted in both threads; an occasional lost increment does not matter
        self.busy_replies = 0  # requests refused because too many were in flight (or the peer was not online)
        self.banned_replies = 0  # requests refused unread because their sender is banned
        self.bans = Bans()  # peers that keep sending bad requests
        self.recomputed_forwards = 0  # backward passes that had to recompute forward (no usable activations)
        self._cache: OrderedDict[tuple[str, str], _CachedForward] = OrderedDict()
        self._stash: list[torch.Tensor] = []  # a copy of the current weights that optimizer steps never modify
        self._stash_version = -1
        self._max_cached = max(8, ACTIVATION_CACHE_BYTES // _activation_bytes_estimate(manifest, stage))

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage}")
        self._pending = 0
        self._pending_by_caller: dict[str, int] = {}
        self._drains = 0
        self.seconds_per_request = 0.0  # EMA of the worker's time per request (0 until the first one)
        self._control_calls = 0
        self._handlers_added = False  # handlers are named by class, not object: never remove another server's
        self.state = PeerState.JOINING
        self._dht: DHT | None = None
        self._p2p: P2P | None = None
        self._announce_task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------ lifecycle

    async def join(self, dht: DHT, p2p: P2P) -> None:
        """Announce this peer as joining the stage (others count it in, and do not pick the stage too), and keep
        announcing while it downloads the stage's state."""
        self._dht, self._p2p = dht, p2p
        self._create_averager()
        await self.announce()
        self._announce_task = asyncio.create_task(self._announce_forever())

    async def start(self, dht: DHT, p2p: P2P, view: SwarmView | None = None) -> None:
        """Register the RPC handlers, then announce online and keep announcing (and averaging) in the background.
        `view` is the peer's shared picture of the swarm (averaging reads the stage's records from it)."""
        self._dht, self._p2p = dht, p2p
        self._create_averager()
        await self.add_p2p_handlers(p2p, namespace=NAMESPACE)
        self._handlers_added = True
        self.state = PeerState.ONLINE
        self._went_online = True
        await self.announce()
        if self._announce_task is None:
            self._announce_task = asyncio.create_task(self._announce_forever())
        if self.averager is not None:  # exists unless the mode is "none"
            self._view = view or SwarmView(
                dht, self.manifest.swarm_id, self.manifest.num_stages, self.manifest.network.announce_period
            )
            self._average_task = asyncio.create_task(self._average_forever())
        if self.checkpoint_dir is not None and self.checkpoint_every > 0:
            self._checkpoint_task = asyncio.create_task(self._checkpoint_forever())
        logger.info(f"serving stage {self.stage} (layers {list(self.model.layers)}) as {self.peer_id}")

    def _create_averager(self) -> None:
        if self.averager is None and self.manifest.averaging.mode != "none":
            assert self._dht is not None
            self.averager = StageAverager(
                self.manifest, self.stage, self._dht, self.param_names, self.params, self.optimizer
            )

    async def drain(self, timeout: float) -> None:
        """Stop taking new requests (they get 'busy' replies) and wait, up to `timeout`, for those in flight."""
        self.state = PeerState.OFFLINE
        try:
            await asyncio.wait_for(self.announce(), timeout=timeout)
        except Exception as e:
            logger.warning(f"announcing offline failed: {e!r}")
        deadline = time.monotonic() + timeout
        while self._pending > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Announce offline, stop taking requests, finish the work in flight.

        Every step has a timeout: on Ctrl-C the DHT process and the p2p daemon may already be gone."""
        self.state = PeerState.OFFLINE
        for task in (self._announce_task, self._average_task, self._checkpoint_task):
            if task is not None:
                task.cancel()
        steps = []
        if self._dht is not None and self._dht.is_alive():
            steps.append(("announcing offline", self.announce()))
        if self._p2p is not None and self._handlers_added:
            self._handlers_added = False
            steps.append(("removing handlers", self.remove_p2p_handlers(self._p2p, namespace=NAMESPACE)))
        for what, step in steps:
            try:
                await asyncio.wait_for(step, timeout=timeout)
            except Exception as e:  # shutting down anyway; the record will expire
                logger.warning(f"{what} failed during shutdown: {e!r}")
        try:  # let the work in flight finish, but not forever (a hung device must not hang the exit)
            finish = asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
            await asyncio.wait_for(finish, timeout=self.manifest.training.timeouts.backward)
            if self._went_online and self.checkpoint_dir is not None:  # the worker is done: read the state here
                await self.save_checkpoint(in_worker=False)
        except TimeoutError:
            logger.warning("work in flight did not finish in time; dropping it (and the checkpoint on exit)")
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.averager is not None:
            averager, self.averager = self.averager, None
            await asyncio.get_running_loop().run_in_executor(None, averager.shutdown)

    def announcement(self) -> Announcement:
        rate = announced_rate
        return Announcement(
            peer_id=self.peer_id,
            stage=self.stage,
            state=self.state,
            throughput=rate(self.throughput.serving),
            compute_throughput=rate(self.throughput.compute),
            network_throughput=rate(self.throughput.network),
            delivered_throughput=rate(self.delivered.update(self.samples_served, time.monotonic())),
            samples_served=self.samples_served,
            outstanding=max(self._pending, 0),
            uptime=round(time.monotonic() - self.started, 1),
            pinned=self.pinned,
            device=device_name(self.device),
            public_name=self.public_name,
            optimizer_steps=self.optimizer_steps,
            averaging_round=self.rounds.round,
            round_samples=self.samples_served - self.rounds.round_started_at,
            averaging_rounds=self.rounds.rounds,
            activation_bytes_sent=self.traffic.activation_sent,
            activation_bytes_received=self.traffic.activation_received,
            averaging_bytes_sent=self.traffic.averaging_sent,
            averaging_bytes_received=self.traffic.averaging_received,
            reachable=self.reachable,
            maddrs=self.maddrs,
        )

    async def announce(self) -> None:
        # The same lifetime for every state: the DHT refuses a value that expires earlier than the one it replaces,
        # so a shorter-lived "offline" record would be dropped.
        lifetime = announcement_lifetime(self.manifest.network.announce_period)
        await store_announcement(self._dht, self.manifest.swarm_id, self.announcement(), lifetime)

    async def _announce_forever(self) -> None:
        """Refresh the record every announce period, without waiting for the previous store: a store that
        reaches an unresponsive DHT node waits out hivemind's timeouts (seconds), and records live only
        LIFETIME_PERIODS periods, so waiting would let a healthy peer drop out of everyone's view."""
        in_flight: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(self.manifest.network.announce_period)
                if len(in_flight) < MAX_ANNOUNCEMENTS_IN_FLIGHT:
                    task = asyncio.create_task(self._announce_logged())
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
        finally:
            for task in in_flight:
                task.cancel()

    async def _announce_logged(self) -> None:
        try:
            await self.announce()
        except Exception as e:  # a missed refresh is not fatal: the next one may succeed
            logger.warning(f"announcement failed: {e!r}")

    # ---------------------------------------------------------------------------------------- RPC handlers

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._handle_remote("forward", request, str(context.remote_id))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._handle_remote("backward", request, str(context.remote_id))

    async def _handle_remote(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str
    ) -> runtime_pb2.ExpertResponse:
        self.traffic.activation_received += request.ByteSize()
        if (refusal := self._outsider_refusal(request.metadata, caller)) is not None:
            return refusal
        reply = await self.handle(kind, request, caller)
        self.traffic.activation_sent += reply.ByteSize()
        return reply

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in protocol.split_message(await self._handle_stream("forward", requests, context)):
            yield part

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in protocol.split_message(await self._handle_stream("backward", requests, context)):
            yield part

    async def _handle_stream(
        self, kind: str, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        # A stream holds memory while it arrives: it takes a request slot and has the forward timeout to finish.
        caller = str(context.remote_id)
        if (refusal := self._refusal(caller)) is not None:
            if self.bans.banned_for(caller, time.monotonic()) <= 0:  # a banned peer's stream is not read at all
                await self._drain(requests)
            return refusal
        if self.manifest.private:  # an outsider's stream is refused on its first part, before it takes a slot
            try:
                first = await asyncio.wait_for(anext(requests), timeout=self.manifest.training.timeouts.forward)
            except (StopAsyncIteration, TimeoutError):
                return protocol.make_error_reply("the request stream did not start in time", "bad_request")
            if (refusal := self._outsider_refusal(first.metadata, caller)) is not None:
                await self._drain(requests)  # no slot taken; bounded like every refused stream's
                return refusal
            requests = _prepend(first, requests)
        self._take_slot(caller)
        try:
            combine = protocol.combine_message(requests, runtime_pb2.ExpertRequest, self.max_message_bytes)
            request = await asyncio.wait_for(combine, timeout=self.manifest.training.timeouts.forward)
        except BadRequestError as e:
            await self._drain(requests)
            return self._bad_request(caller, str(e))
        except TimeoutError:  # a slow link is no offence: not counted towards a ban
            return protocol.make_error_reply("the request stream did not finish in time", "bad_request")
        finally:
            self._release_slot(caller)
        return await self._handle_remote(kind, request, caller)

    async def _drain(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """Read the rest of a refused request stream, keeping nothing: a stream closed with parts unread is reset,
        and the reply (why it was refused) would be lost. At most a valid message's size, within the timeout."""
        if self._drains >= MAX_DRAINS:
            return
        budget = self.max_message_bytes + 65536

        async def read() -> None:
            nonlocal budget
            async for part in requests:
                budget -= part.ByteSize()
                if budget < 0:
                    return

        self._drains += 1
        try:
            await asyncio.wait_for(read(), timeout=self.manifest.training.timeouts.forward)
        except Exception:  # a broken or endless stream: the reply may be lost, the peer does not care
            pass
        finally:
            self._drains -= 1

    async def rpc_probe(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Bandwidth probe: take the request's payload, reply with `reply_bytes` bytes of zeros."""
        caller = str(context.remote_id)
        if (refusal := self._ban_refusal(caller)) is not None:
            return refusal
        try:
            metadata = protocol.decode_metadata(request, self.manifest, caller)
            reply_bytes = metadata.get("reply_bytes", 0)
            if not isinstance(reply_bytes, int) or not 0 <= reply_bytes <= PROBE_BYTES:
                raise BadRequestError(f"reply_bytes must be an integer from 0 to {PROBE_BYTES}")
        except BadRequestError as e:
            return self._bad_request(caller, str(e))
        return protocol.make_reply([torch.zeros(reply_bytes // 4)])

    async def rpc_download_state(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream this stage's parameters and optimizer statistics to a peer that starts serving the stage.

        The request is one message, taken as a stream so that a request that never ends (hivemind would wait for
        its end without a timeout) is dropped after the forward timeout, like any request stream."""
        caller = str(context.remote_id)
        if (refusal := self._ban_refusal(caller)) is not None:
            yield refusal
            return
        if self._control_calls >= MAX_CONTROL_CALLS:  # reading a request takes a slot too
            self.busy_replies += 1
            yield protocol.make_error_reply("this peer is busy sending its state; try another peer", "busy")
            return

        async def read_request() -> list[runtime_pb2.ExpertRequest]:
            """The stream's messages to its end (which lets the reply through), stopping early past one message or
            MAX_CONTROL_REQUEST_BYTES: a state request is small."""
            messages, size = [], 0
            async for message in requests:
                messages.append(message)
                size += message.ByteSize()
                if len(messages) > 1 or size > MAX_CONTROL_REQUEST_BYTES:
                    break
            return messages

        self._control_calls += 1
        try:
            messages = await asyncio.wait_for(read_request(), timeout=self.manifest.training.timeouts.forward)
        except TimeoutError:
            self.bad_requests += 1
            return
        finally:
            self._control_calls -= 1
        if len(messages) != 1 or messages[0].ByteSize() > MAX_CONTROL_REQUEST_BYTES:
            yield self._bad_request(caller, "a state request is one message of at most 1 MiB")
            return
        (request,) = messages
        try:
            metadata = protocol.decode_metadata(request, self.manifest, caller)
            if type(metadata.get("stage")) is not int or metadata["stage"] != self.stage:
                raise BadRequestError(f"this peer serves stage {self.stage}, not {str(metadata.get('stage'))[:20]}")
        except BadRequestError as e:
            yield self._bad_request(caller, str(e))
            return
        if self.state != PeerState.ONLINE or self._control_calls >= MAX_CONTROL_CALLS:
            self.busy_replies += 1
            yield protocol.make_error_reply(f"this peer is {self.state} or busy; try another peer", "busy")
            return
        self._control_calls += 1
        try:
            # taken in the worker thread, between two requests, so parameters and statistics match
            items, counters = await asyncio.get_running_loop().run_in_executor(self._executor, self.state_snapshot)
            reply = protocol.make_reply([tensor for _, tensor in items])
            reply.metadata = protocol.MSGPackSerializer.dumps(
                {"ok": True, "names": [name for name, _ in items], **counters}
            )
            for part in protocol.split_message(reply):
                yield part
        finally:
            self._control_calls -= 1

    def state_snapshot(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, int]]:
        """The stage's state as named CPU tensors, and its counters (worker thread: between two requests, so that
        parameters and statistics match)."""
        items = state_tensors(self.param_names, self.params, self.optimizer)
        if self.averager is not None:
            items += self.averager.outer_state()
        return items, {"optimizer_steps": self.optimizer_steps, "averaging_round": self.rounds.round}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every name a state of this stage may hold, with its shape."""
        return state_shapes(self.manifest, self._parameter_shapes())

    def _parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in zip(self.param_names, self.params)}

    async def rpc_manifest(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """The swarm's manifest as JSON, for a peer that joins by this peer's multiaddr (it cannot know the swarm
        id yet, so the request carries nothing to check). A private swarm's peers do not hand it out: the
        manifest names the secret's file, and a joiner needs that file anyway."""
        if self.manifest.private:
            return protocol.make_error_reply(
                "this swarm is private: join it with its manifest file, next to the secret file the manifest names",
                "bad_request",
            )
        return runtime_pb2.ExpertResponse(
            metadata=protocol.MSGPackSerializer.dumps({"ok": True, "manifest": self.manifest.to_json()})
        )

    def load_state(self, items: list[tuple[str, torch.Tensor]], counters: dict[str, int]) -> None:
        """Take over a stage's state downloaded from another peer or read from a checkpoint (before this server
        serves anything). Raises BadRequestError, leaving everything untouched, if the state does not fit."""
        outer = {name: tensor for name, tensor in items if name.startswith("outer/")}
        shapes = outer_state_shapes(self.manifest, self._parameter_shapes())
        for name, tensor in outer.items():
            if name not in shapes:
                raise BadRequestError(f"the state holds {name[:200]!r}, which this stage does not have")
            if tuple(tensor.shape) != shapes[name] or tensor.dtype != torch.float32 or not protocol.all_finite(tensor):
                raise BadRequestError(f"state tensor {name!r} is not a finite float32 tensor of {list(shapes[name])}")
        load_state_tensors(
            [item for item in items if item[0] not in outer], self.param_names, self.params, self.optimizer
        )
        if self.averager is not None:
            self.averager.load_outer_state(outer)
        self.optimizer_steps = counters.get("optimizer_steps", 0)
        self.rounds.round = counters.get("averaging_round", 0)
        self.weights_version += 1

    def _ban_refusal(self, caller: str) -> runtime_pb2.ExpertResponse | None:
        seconds = self.bans.banned_for(caller, time.monotonic())
        if seconds <= 0:
            return None
        self.banned_replies += 1
        return protocol.make_error_reply(
            f"this peer bans you for {seconds:.0f} more seconds: you sent too many bad requests", "banned"
        )

    def _refusal(self, caller: str) -> runtime_pb2.ExpertResponse | None:
        """A prompt reply instead of work: the caller is banned, this peer is not online, or too busy."""
        if (refusal := self._ban_refusal(caller)) is not None:
            return refusal
        reason = None
        if self.state != PeerState.ONLINE:
            reason = f"this peer is {self.state}; try another peer"
        elif self._pending >= MAX_PENDING_REQUESTS:
            reason = "too many requests in flight; try another peer"
        elif self._pending * self.seconds_per_request > MAX_QUEUE_WAIT_SHARE * self.manifest.training.timeouts.forward:
            reason = f"a queue of about {self._pending * self.seconds_per_request:.1f} s here; try another peer"
        elif caller != self.peer_id and self._pending_by_caller.get(caller, 0) >= MAX_PENDING_PER_CALLER:
            reason = f"you have {MAX_PENDING_PER_CALLER} requests in flight here already; try another peer"
        if reason is None:
            return None
        self.busy_replies += 1
        return protocol.make_error_reply(reason, "busy")

    def _outsider_refusal(self, metadata: bytes, caller: str) -> runtime_pb2.ExpertResponse | None:
        """In a private swarm, refuse a request whose metadata does not prove membership, before any other work."""
        if not self.manifest.private:
            return None
        try:
            protocol.decode_metadata(runtime_pb2.ExpertRequest(metadata=metadata), self.manifest, caller)
        except BadRequestError as e:
            return self._bad_request(caller, str(e))
        return None

    def _bad_request(self, caller: str, message: str) -> runtime_pb2.ExpertResponse:
        """Count a bad request against its sender (banning it if it keeps sending them) and answer it."""
        self.bad_requests += 1
        ban = self.bans.record_bad_request(caller, time.monotonic())
        if ban:
            logger.warning(f"banning peer {caller[-8:]} for {ban:.0f}s: too many bad requests (last: {message[:200]})")
        return protocol.make_error_reply(message, "bad_request")

    async def handle(self, kind: str, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        """Process one request; also called directly by this peer's own trainer (libp2p cannot dial itself)."""
        if (refusal := self._refusal(caller)) is not None:
            return refusal
        self._take_slot(caller)
        work = asyncio.get_running_loop().run_in_executor(self._executor, self._process, kind, request, caller)
        # The slot is freed when the work is done, not when the caller gives up: cancelled calls still occupy
        # the worker until their turn has passed.
        work.add_done_callback(lambda _: self._release_slot(caller))
        return await asyncio.shield(work)

    def _take_slot(self, caller: str) -> None:
        self._pending += 1
        self._pending_by_caller[caller] = self._pending_by_caller.get(caller, 0) + 1

    def _release_slot(self, caller: str) -> None:
        self._pending -= 1
        left = self._pending_by_caller.get(caller, 1) - 1
        if left > 0:
            self._pending_by_caller[caller] = left
        else:
            self._pending_by_caller.pop(caller, None)

    # ---------------------------------------------------------------------------------------- checkpoints

    async def save_checkpoint(self, in_worker: bool = True) -> Path | None:
        """Save the stage's state into the checkpoint folder (the copy is taken in the worker thread, between two
        requests; the file is written in another thread). The path, or None if saving failed (logged)."""
        assert self.checkpoint_dir is not None
        loop = asyncio.get_running_loop()
        try:
            if in_worker:
                items, counters = await loop.run_in_executor(self._executor, self.state_snapshot)
            else:
                items, counters = self.state_snapshot()
            path = await loop.run_in_executor(
                None, save_checkpoint, self.checkpoint_dir, self.manifest, self.stage, items, counters
            )
        except Exception as e:  # a full disk must not stop serving
            logger.error(f"saving a checkpoint of stage {self.stage} into {self.checkpoint_dir} failed: {e!r}")
            return None
        self.checkpoints_saved += 1
        logger.info(f"checkpoint of stage {self.stage} saved to {path} ({counters['optimizer_steps']} steps)")
        return path

    async def _checkpoint_forever(self) -> None:
        while True:
            await asyncio.sleep(self.checkpoint_every)
            await self.save_checkpoint()

    # ------------------------------------------------------------------------------------------ averaging

    async def _average_forever(self) -> None:
        """Take part in the stage's averaging rounds, whenever one is due; a failed round is logged and skipped."""
        while True:
            await asyncio.sleep(ROUND_CHECK_PERIOD)
            try:
                target = self.manifest.averaging.every_samples
                others = await self._round_progress_of_others()
                stage_round = current_round(self.rounds.round, others)
                if stage_round > self.rounds.round:  # others averaged without us
                    ahead = [o.peer_id for o in others if o.round == stage_round]
                    await self._catch_up(stage_round, ahead)
                    continue
                mine = self.samples_served - self.rounds.round_started_at
                total = swarm_samples_in_round(self.rounds.round, mine, others)
                if NEAR_ROUND * target <= total < target:  # close: look at fresh records, to meet the others in time
                    others = await self._round_progress_of_others(fresh=True)
                    total = swarm_samples_in_round(self.rounds.round, mine, others)
                if total >= target:
                    await self.average_round(alone=not others)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never fatal: serving goes on
                logger.warning(f"averaging round check failed: {e!r}")

    async def _round_progress_of_others(self, fresh: bool = False) -> list[RoundProgress]:
        assert self._view is not None
        now, lifetime = get_dht_time(), announcement_lifetime(self.manifest.network.announce_period)
        return [
            RoundProgress(
                a.averaging_round, a.round_samples, a.delivered_throughput, now - (a.expiration - lifetime), a.peer_id
            )
            for a in await self._view.stage(self.stage, force=fresh)
            if a.state == PeerState.ONLINE and a.peer_id != self.peer_id and a.expiration > now
        ]

    async def _catch_up(self, stage_round: int, ahead: list[str]) -> None:
        """This peer missed rounds (it was alone, busy, or its round failed while others' succeeded). In parameters
        mode, one round behind, it just counts from the stage's round on: the next round pulls it back to the
        others; further behind (e.g. restarted from an old checkpoint), it takes the stage's state from a peer at
        that round, since averaging with parameters that far apart would move it too far at once (and rounds that
        move parameters by more than their norm are dropped). In diloco mode the replicas must share one anchor:
        it always takes the state."""
        behind = stage_round - self.rounds.round
        if self.manifest.averaging.mode != "diloco" and behind < CATCH_UP_BY_DOWNLOAD:
            logger.info(f"stage {self.stage} is at averaging round {stage_round}; catching up")
            self.rounds.round, self.rounds.round_started_at = stage_round, self.samples_served
            return
        from swarm.client.rpc import download_state  # (temporary)

        assert self._p2p is not None
        for peer_id in ahead[:STATE_SOURCES]:
            try:
                shapes = self.state_shapes()
                items, counters = await download_state(self._p2p, peer_id, self.manifest, self.stage, shapes, 120.0)
                await asyncio.get_running_loop().run_in_executor(self._executor, self.load_state, items, counters)
            except Exception as e:  # that peer may be gone or busy: try another, or again at the next look
                logger.warning(f"taking the state of stage {self.stage} from {peer_id[-8:]} failed: {e!r}")
                continue
            self.rounds.round_started_at = self.rounds.weight_started_at = self.samples_served
            why = (
                "DiLoCo replicas share one anchor"
                if self.manifest.averaging.mode == "diloco"
                else f"this peer was {behind} rounds behind"
            )
            logger.info(
                f"stage {self.stage} is at averaging round {stage_round}: took its state from peer {peer_id[-8:]} "
                f"({why}; local steps since this peer's last round are dropped)"
            )
            return

    async def average_round(self, alone: bool = False) -> bool:
        """One round: contribute, all-reduce with whoever of the stage joins, apply. True if averaged with others.

        Alone (no other online peer of the stage) there is nobody to average with: the round is skipped, except
        for DiLoCo's outer step, which is applied to this peer's own pseudo-gradient. A failed round leaves the
        model and the round number as they were (the peer catches up if the others' round succeeded)."""
        loop = asyncio.get_running_loop()
        number, counters = self.rounds.round, self.rounds
        begin_served = self.samples_served
        weight = max(begin_served - counters.weight_started_at, 1)
        # alone, only DiLoCo has something to do (its own outer step)
        averager = self.averager if self.averager is not None and (not alone or self.averager.diloco) else None
        averaged = False
        if averager is not None:
            if not alone:  # tell the others at once that the round is due here: they join sooner
                try:
                    await self.announce()
                except Exception as e:
                    logger.debug(f"announcing a round failed: {e!r}")
            await loop.run_in_executor(self._executor, averager.begin_round)
            try:
                if alone:
                    raise AveragingError("no other peer serves this stage")
                timeout = 2 * self.manifest.averaging.matchmaking_time
                begin = time.monotonic()
                size = await loop.run_in_executor(None, averager.run_round, weight, timeout)
                averaged = True
                payload = round_payload_bytes(averager.numels, self.manifest.averaging.compression, size)
                self.traffic.averaging_sent += payload
                self.traffic.averaging_received += payload
                counters.last_group_size = size
                logger.info(
                    f"averaging round {number} of stage {self.stage}: {size} peers, weight {weight}, "
                    f"{payload / 1e6:.2f} MB sent, {time.monotonic() - begin:.1f}s"
                )
            except AveragingError as e:
                if not alone:
                    counters.failed += 1
                    logger.warning(f"averaging round {number} of stage {self.stage} skipped: {e}")
            try:
                await loop.run_in_executor(self._executor, self._finish_round, averaged, alone)
            except AveragingError as e:
                averaged = False
                counters.failed += 1
                logger.warning(f"averaging round {number} of stage {self.stage} dropped: {e}")
            if averaged:
                counters.rounds += 1
                counters.weight_started_at = begin_served
                logger.info(f"round {number} of stage {self.stage} applied: moved by {averager.last_change:.2%}")
        # the next count starts now (samples served during the round belong to it); after a failed round, with the
        # same round number
        if averaged or alone:
            counters.round = number + 1
        counters.round_started_at = begin_served
        return averaged

    def _finish_round(self, averaged: bool, alone: bool) -> None:
        """Worker thread: apply the round; forwards from now on use the new weights."""
        assert self.averager is not None
        if self.averager.finish_round(averaged, alone):
            self.weights_version += 1

    # ---------------------------------------------------------------------------- work (worker thread only)

    def _process(self, kind: str, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        started = time.perf_counter()
        try:
            return self._work(kind, request, caller)
        finally:
            took = time.perf_counter() - started
            previous = self.seconds_per_request
            self.seconds_per_request = took if previous == 0 else 0.9 * previous + 0.1 * took

    def _work(self, kind: str, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        try:
            req = protocol.decode_request(request, self.manifest, self.max_elements, caller)
            if req.stage != self.stage:
                raise WrongStageError(f"this peer serves stage {self.stage} now, not stage {req.stage}")
            self._forget_stale_forwards()
            begin = time.perf_counter()
            outputs = self._forward(req, caller) if kind == "forward" else self._backward(req, caller)
            if self.simulated is not None:
                full = kind == "forward" and self.last and req.train  # the last stage runs backward too
                share = 1.0 if full else FORWARD_SHARE if kind == "forward" else 1.0 - FORWARD_SHARE
                self.simulated.pad(begin, req.tensors[0].shape[0], share)
            return protocol.make_reply(outputs, self.manifest.training.activation_compression)
        except BadRequestError as e:
            logger.info(f"bad {kind} request from {caller[-8:]}: {e}")
            return self._bad_request(caller, str(e))
        except UnknownMicrobatchError as e:
            return protocol.make_error_reply(str(e), "unknown_microbatch")
        except WrongStageError as e:
            return protocol.make_error_reply(str(e), "wrong_stage")
        except Exception as e:  # a bug or a device error: report it, keep serving
            logger.exception(f"{kind} failed")
            return protocol.make_error_reply(f"internal error on the stage peer: {type(e).__name__}: {e}", "internal")

    def _forward(self, req: protocol.StageRequest, caller: str) -> list[torch.Tensor]:
        expected = 2 if self.last else 1
        if len(req.tensors) != expected:
            what = "[inputs, targets]" if self.last else "[inputs]"
            raise BadRequestError(f"forward of stage {self.stage} takes {what}, got {len(req.tensors)} tensors")
        inputs = req.tensors[0]
        protocol.check_inputs(inputs, self.manifest, self.stage)
        if self.last:
            protocol.check_targets(req.tensors[1], inputs, self.manifest.model.vocab_size)
        x = inputs.to(self.device)

        if not req.train:
            with torch.no_grad():
                out = self.model(x)
                if self.last:
                    return [StageModel.loss(out, req.tensors[1].to(self.device)).float().cpu()]
                return [out.float().cpu()]

        if not self.first:
            x.requires_grad_(True)
        if self.last:  # the last stage runs backward at once and returns the gradient of its inputs
            loss = StageModel.loss(self.model(x), req.tensors[1].to(self.device))
            grads = self._gradients(loss, x, None, self.params)
            self.samples_served += inputs.shape[0]
            result = [loss.detach().float().cpu()]
            return result if self.first else result + [grads.cpu()]
        weights = self._stashed_weights()
        out = self._run(x, weights)
        self._remember(caller, req.microbatch_id, x, out, weights)
        return [out.detach().float().cpu()]

    def _backward(self, req: protocol.StageRequest, caller: str) -> list[torch.Tensor]:
        if self.last:
            raise BadRequestError("the last stage runs backward within forward; do not send it backward")
        if len(req.tensors) not in (1, 2):
            raise BadRequestError(f"backward takes [grad_outputs] or [grad_outputs, inputs], got {len(req.tensors)}")
        grad = req.tensors[0]
        key = (caller, req.microbatch_id)
        cached = self._cache.get(key)
        if cached is not None:
            protocol.check_grad(grad, tuple(cached.outputs.shape))  # a bad gradient leaves the activations cached
            del self._cache[key]
            x, out, weights = cached.inputs, cached.outputs, cached.weights
        else:
            # No activations here (evicted, or this peer did not run the microbatch's forward, e.g. because that
            # peer failed): recompute forward with the current weights from the inputs sent along.
            if len(req.tensors) == 2:
                inputs = req.tensors[1]
                protocol.check_inputs(inputs, self.manifest, self.stage)
            else:
                raise UnknownMicrobatchError(
                    f"no forward of microbatch {req.microbatch_id} is cached here; resend backward with its inputs"
                )
            batch, length = inputs.shape[:2]
            protocol.check_grad(grad, (batch, length, self.manifest.model.width))
            self.recomputed_forwards += 1
            x = inputs.to(self.device)
            if not self.first:
                x.requires_grad_(True)
            weights = self._stashed_weights()
            out = self._run(x, weights)
        grad_inputs = self._gradients(out, x, grad.to(self.device), weights)
        self.samples_served += x.shape[0]
        return [] if self.first else [grad_inputs.cpu()]

    def _stashed_weights(self) -> list[torch.Tensor]:
        """The current weights, as tensors that later optimizer steps leave alone (weight stashing).

        Forward runs with these and keeps them in its graph, so its backward computes exact gradients even if
        optimizer steps happened in between, instead of recomputing forward. One copy per weights version.
        """
        if self._stash_version != self.weights_version:
            self._stash = [p.detach().clone().requires_grad_(True) for p in self.params]
            self._stash_version = self.weights_version
        return self._stash

    def _run(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(self.model, dict(zip(self.param_names, weights)), (x,))

    def _gradients(
        self, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor | None, weights: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """Gradients of the stage's parameters (accumulated) and of its input (returned).

        Gradients are computed into new tensors and checked before they touch the accumulators, so a request
        that produces NaN or Inf never changes the weights.
        """
        wrt = list(weights) + ([] if self.first else [x])
        grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
        if not all(g is None or protocol.all_finite(g) for g in grads):
            raise BadRequestError("the request produced non-finite gradients; it was not applied")
        scale = 1.0 / self.manifest.training.microbatches_per_step
        for param, g in zip(self.params, grads[: len(self.params)]):
            if g is None:
                continue
            if param.grad is None:
                param.grad = g * scale
            else:
                param.grad.add_(g, alpha=scale)
        self.backward_passes += 1
        if self.backward_passes >= self.manifest.training.microbatches_per_step:
            self._optimizer_step()
        return None if self.first else grads[-1]

    def _optimizer_step(self) -> None:
        try:
            if self.manifest.training.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.manifest.training.max_grad_norm)
            self.optimizer.step()
            self.optimizer_steps += 1
        finally:  # even if the step failed: one bad step must not make every later backward fail again
            self.optimizer.zero_grad(set_to_none=True)
            self.backward_passes = 0
            self.weights_version += 1

    def _remember(
        self, caller: str, microbatch_id: str, x: torch.Tensor, out: torch.Tensor, weights: list[torch.Tensor]
    ) -> None:
        key = (caller, microbatch_id)
        self._cache[key] = _CachedForward(x, out, weights, time.monotonic())
        self._cache.move_to_end(key)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)

    def _forget_stale_forwards(self) -> None:
        """Drop activations whose microbatch deadline has passed: their trainer has given up on them."""
        now = time.monotonic()
        while (
            self._cache and now - next(iter(self._cache.values())).created > self.manifest.training.timeouts.microbatch
        ):
            self._cache.popitem(last=False)


async def _prepend(first: runtime_pb2.ExpertRequest, rest: AsyncIterator) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    yield first
    async for part in rest:
        yield part


def announced_rate(value: float) -> float:
    """A throughput as records carry it (a fast loopback link measures above what records may carry)."""
    return round(min(value, MAX_THROUGHPUT), 3)


def _activation_bytes_estimate(manifest: Manifest, stage: int) -> int:
    """Rough memory of one cached forward: about 20 float activations of [batch, length, width] per layer."""
    config, training = manifest.model, manifest.training
    per_layer = 20 * training.microbatch_size * config.context_length * config.width * 4
    return per_layer * max(1, len(manifest.stage_layers(stage)))
