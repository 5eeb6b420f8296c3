"""The RPC handlers of a served stage: validate, admit, hand to the worker, reply.

Why our own ServicerBase and not hivemind.moe (docs/ARCHITECTURE.md): every request is validated before it
touches the model, backward uses the activations forward kept, gradients accumulate over several microbatches,
and bad requests get an error reply instead of an exception. Handlers run on the event loop; model work runs in
the stage's worker (server/compute.py). Besides forward and backward (unary, or streamed when large), a stage
answers a bandwidth probe, a download of its state, and a request for the swarm's manifest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import AsyncIterator  # noqa: UP035 (hivemind detects streams by typing.AsyncIterator only)

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.dataset import tokenizer_source
from swarm.dht.records import PeerState
from swarm.errors import BadRequestError, SwarmError
from swarm.manifests.manifest import Manifest
from swarm.server.admission import Admission
from swarm.server.compute import StageCompute, UnknownMicrobatchError, WrongStageError
from swarm.server.forwarding import Forwarder
from swarm.server.precision import GradientOverflowError
from swarm.server.worker import StageWorker
from swarm.throughput import PROBE_BYTES
from swarm.watch.stats import Traffic
from swarm.wire import protocol

logger = logging.getLogger(__name__)

NAMESPACE = "swarm"
MAX_CONTROL_REQUEST_BYTES = 2**20  # a state request is tiny; a larger one is read to its end, so its refusal arrives
MAX_DRAINS = 8  # refused request streams read to their end at once (so that their reply arrives); more are cut
MAX_CONTROL_CALLS = 4  # state downloads served at once; each holds up to a stage's state in memory


class StageService(ServicerBase):
    def __init__(
        self,
        manifest: Manifest,
        stage: int,
        admission: Admission,
        worker: StageWorker,
        traffic: Traffic,
        state: Callable[[], PeerState],
        forwarder: Forwarder,
    ):
        self.manifest, self.stage, self.forwarder = manifest, stage, forwarder
        self.admission, self.worker, self.traffic, self.state = admission, worker, traffic, state
        self.max_elements = protocol.max_request_elements(manifest)
        self.max_message_bytes = protocol.max_message_bytes(manifest)
        self._drains = 0
        self._control_calls = 0
        self._tokenizer: bytes | None = None  # the swarm's tokenizer file, read from the cache once asked for

    # ------------------------------------------------------------------------------- forward, backward

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._handle_remote("forward", request, str(context.remote_id))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._handle_remote("backward", request, str(context.remote_id))

    async def rpc_train(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A forwarded microbatch (server/forwarding.py): forward here, on to the next stage, backward here."""
        return await self._handle_remote("train", request, str(context.remote_id))

    async def rpc_train_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in protocol.split_message(await self._handle_stream("train", requests, context)):
            yield part

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

    async def _handle_remote(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str
    ) -> runtime_pb2.ExpertResponse:
        self.traffic.activation_received += request.ByteSize()
        if (refusal := self.admission.outsider_refusal(request.metadata, caller)) is not None:
            return refusal
        reply = await self.handle(kind, request, caller)
        self.traffic.activation_sent += reply.ByteSize()
        return reply

    async def _handle_stream(
        self, kind: str, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        # A stream holds memory while it arrives: it takes a request slot and has the forward timeout to finish.
        caller = str(context.remote_id)
        admission = self.admission
        if (refusal := admission.refusal(caller, self.state(), self.worker.seconds_per_request)) is not None:
            if not admission.banned(caller):  # a banned peer's stream is not read at all
                await self._drain(requests)
            return refusal
        if self.manifest.private:  # an outsider's stream is refused on its first part, before it takes a slot
            try:
                first = await asyncio.wait_for(anext(requests), timeout=self.manifest.training.timeouts.forward)
            except (StopAsyncIteration, TimeoutError):
                return protocol.make_error_reply("the request stream did not start in time", "bad_request")
            if (refusal := admission.outsider_refusal(first.metadata, caller)) is not None:
                await self._drain(requests)  # no slot taken; bounded like every refused stream's
                return refusal
            requests = _prepend(first, requests)
        admission.take_slot(caller)
        try:
            combine = protocol.combine_message(requests, runtime_pb2.ExpertRequest, self.max_message_bytes)
            request = await asyncio.wait_for(combine, timeout=self.manifest.training.timeouts.forward)
        except BadRequestError as e:
            await self._drain(requests)
            return admission.bad_request(caller, str(e))
        except TimeoutError:  # a slow link is no offence: not counted towards a ban
            return protocol.make_error_reply("the request stream did not finish in time", "bad_request")
        finally:
            admission.release_slot(caller)
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

    async def handle(self, kind: str, request: runtime_pb2.ExpertRequest, caller: str) -> runtime_pb2.ExpertResponse:
        """Process one request; also called directly by this peer's own trainer (libp2p cannot dial itself)."""
        if kind == "train":
            return await self.forwarder.handle(request, caller)
        admission = self.admission
        if (refusal := admission.refusal(caller, self.state(), self.worker.seconds_per_request)) is not None:
            return refusal
        admission.take_slot(caller)
        max_elements = self.max_elements
        work = self.worker.submit(lambda compute: _serve(compute, kind, request, caller, max_elements))
        # The slot is freed when the work is done, not when the caller gives up: cancelled calls still occupy
        # the worker until their turn has passed.
        work.add_done_callback(lambda _: admission.release_slot(caller))
        reply, bad_request = await asyncio.shield(work)
        if bad_request is not None:
            logger.info(f"bad {kind} request from {caller[-8:]}: {bad_request}")
            return admission.bad_request(caller, bad_request)
        return reply

    # ------------------------------------------------------------------------------------ control calls

    async def rpc_probe(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Bandwidth probe: take the request's payload, reply with `reply_bytes` bytes of zeros."""
        caller = str(context.remote_id)
        if (refusal := self.admission.ban_refusal(caller)) is not None:
            return refusal
        try:
            metadata = protocol.decode_metadata(request, self.manifest, caller)
            reply_bytes = metadata.get("reply_bytes", 0)
            if not isinstance(reply_bytes, int) or not 0 <= reply_bytes <= PROBE_BYTES:
                raise BadRequestError(f"reply_bytes must be an integer from 0 to {PROBE_BYTES}")
        except BadRequestError as e:
            return self.admission.bad_request(caller, str(e))
        return protocol.make_reply([torch.zeros(reply_bytes // 4)])

    async def rpc_download_state(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream this stage's state (server/state.py) to a peer that starts serving the stage.

        The request is one message, taken as a stream so that a request that never ends (hivemind would wait for
        its end without a timeout) is dropped after the forward timeout, like any request stream."""
        caller, admission = str(context.remote_id), self.admission
        if (refusal := admission.ban_refusal(caller)) is not None:
            yield refusal
            return
        if self._control_calls >= MAX_CONTROL_CALLS:  # reading a request takes a slot too
            yield admission.busy("this peer is busy sending its state; try another peer")
            return

        async def read_request() -> list[runtime_pb2.ExpertRequest]:
            """The stream's messages to its end, stopping early only past MAX_CONTROL_REQUEST_BYTES: a state request
            is small. A second message is read to the end too (not kept): a reply sent while the caller still writes
            was seen lost (the caller got no reply at all instead of bad_request)."""
            messages, size = [], 0
            async for message in requests:
                if len(messages) < 2:
                    messages.append(message)
                size += message.ByteSize()
                if size > MAX_CONTROL_REQUEST_BYTES:
                    break
            return messages

        self._control_calls += 1
        try:
            messages = await asyncio.wait_for(read_request(), timeout=self.manifest.training.timeouts.forward)
        except TimeoutError:
            admission.bad_requests += 1
            return
        finally:
            self._control_calls -= 1
        if len(messages) != 1 or messages[0].ByteSize() > MAX_CONTROL_REQUEST_BYTES:
            yield admission.bad_request(caller, "a state request is one message of at most 1 MiB")
            return
        (request,) = messages
        try:
            metadata = protocol.decode_metadata(request, self.manifest, caller)
            if type(metadata.get("stage")) is not int or metadata["stage"] != self.stage:
                raise BadRequestError(f"this peer serves stage {self.stage}, not {str(metadata.get('stage'))[:20]}")
        except BadRequestError as e:
            yield admission.bad_request(caller, str(e))
            return
        if self.state() != PeerState.ONLINE or self._control_calls >= MAX_CONTROL_CALLS:
            yield admission.busy(f"this peer is {self.state()} or busy; try another peer")
            return
        self._control_calls += 1
        try:
            # taken in the worker thread, between two requests, so parameters and statistics match
            items, counters = await self.worker.run(lambda compute: compute.snapshot())
            reply = protocol.make_reply([tensor for _, tensor in items])
            reply.metadata = protocol.MSGPackSerializer.dumps(
                {"ok": True, "names": [name for name, _ in items], **counters}
            )
            for part in protocol.split_message(reply):
                yield part
        finally:
            self._control_calls -= 1

    async def rpc_tokenizer(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A chunk of the swarm's tokenizer file, from `offset` (swarm/dataset/tokenizer_source.py): a joining peer that
        has not got it asks here. Only a copy whose hash is the manifest's is handed out."""
        try:
            metadata = protocol.decode_metadata(request, self.manifest, str(context.remote_id))
            offset = metadata.get("offset", 0)
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise BadRequestError("offset must be a non-negative integer")
        except BadRequestError as e:
            return protocol.make_error_reply(str(e), "bad_request")
        data = self._tokenizer_file()
        if data is None:
            return protocol.make_error_reply("this peer has no copy of the swarm's tokenizer", "bad_request")
        chunk = data[offset : offset + tokenizer_source.CHUNK_BYTES]
        return runtime_pb2.ExpertResponse(
            metadata=protocol.MSGPackSerializer.dumps({"ok": True, "total": len(data), "data": chunk})
        )

    def _tokenizer_file(self) -> bytes | None:
        if not self.manifest.data.tokenizer:
            return None
        if self._tokenizer is None:
            path = tokenizer_source.cached_path(self.manifest.data.tokenizer_sha256)
            try:
                data = path.read_bytes()
                tokenizer_source.check_hash(data, self.manifest.data.tokenizer_sha256, str(path))
            except (OSError, SwarmError):
                return None
            self._tokenizer = data
        return self._tokenizer

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


def _serve(
    compute: StageCompute, kind: str, request: runtime_pb2.ExpertRequest, caller: str, max_elements: int
) -> tuple[runtime_pb2.ExpertResponse | None, str | None]:
    """In the worker: decode, compute, encode. (reply, None), or (None, why) for a bad request, which the event
    loop counts against its sender. Never raises: a bug or a device error is an 'internal' reply."""
    try:
        req = protocol.decode_request(request, compute.manifest, max_elements, caller)
        outputs = compute.process(kind, req, caller)
        return protocol.make_reply(outputs, protocol.wire_compression(compute.manifest)), None
    except BadRequestError as e:
        return None, str(e)
    except UnknownMicrobatchError as e:
        return protocol.make_error_reply(str(e), "unknown_microbatch"), None
    except WrongStageError as e:
        return protocol.make_error_reply(str(e), "wrong_stage"), None
    except GradientOverflowError as e:
        return protocol.make_error_reply(str(e), "overflow"), None
    except Exception as e:  # a bug or a device error: report it, keep serving
        logger.exception(f"{kind} failed")
        return protocol.make_error_reply(f"internal error on the stage peer: {type(e).__name__}: {e}", "internal"), None


async def _prepend(first: runtime_pb2.ExpertRequest, rest: AsyncIterator) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    yield first
    async for part in rest:
        yield part
