"""The RPC handlers of a served stage: validate, admit, hand to the worker, reply.

Why our own ServicerBase and not hivemind.moe (docs/PIPELINE.md): every request is validated before it
touches the model, backward uses the activations forward kept, gradients accumulate over several microbatches,
and bad requests get an error reply instead of an exception. Handlers run on the event loop; model work runs in
the stage's worker (server/compute.py), along the one request path (server/request_path.py) that forwarded
microbatches (server/forwarding.py) take too. Besides forward and backward (unary, or streamed when large), a
stage answers a bandwidth probe, a download of its state, a chunk of the swarm's tokenizer and a request for the
swarm's manifest. The RPCs' names and types are declared in swarm/wire/rpc.py (StageRPC), which this implements.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 (hivemind detects streams by typing.AsyncIterator only)

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.dataset import tokenizer_source
from swarm.dht.records import PeerState
from swarm.errors import BadRequestError, StageStoppedError, SwarmError
from swarm.manifests.manifest import Manifest
from swarm.server.compute import StageCompute
from swarm.server.forwarding import Forwarder
from swarm.server.request_path import RequestPath
from swarm.throughput import PROBE_BYTES
from swarm.watch.stats import Traffic
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import combine_message, make_error_reply, make_reply, pack, split_message
from swarm.wire.rpc import TOKENIZER_CHUNK_BYTES, StageRPC
from swarm.wire.tensors import wire_compression
from swarm.wire.validation import (
    decode_fields,
    decode_metadata,
    decode_request,
    max_message_bytes,
    max_request_elements,
)

logger = logging.getLogger(__name__)

MAX_CONTROL_REQUEST_BYTES = 2**20  # a state request is tiny; a larger one is read to its end, so its refusal arrives
MAX_DRAINS = 8  # refused request streams read to their end at once (so that their reply arrives); more are cut
MAX_CONTROL_CALLS = 4  # state downloads served at once; each holds up to a stage's state in memory


@dataclass
class _Served:
    """A forward or backward the worker did (an error reply is not one)."""

    reply: runtime_pb2.ExpertResponse


class StageService(StageRPC):
    def __init__(self, manifest: Manifest, stage: int, path: RequestPath, traffic: Traffic, forwarder: Forwarder):
        self.manifest, self.stage, self.forwarder, self.path, self.traffic = manifest, stage, forwarder, path, traffic
        self.last = stage == manifest.num_stages - 1
        self.admission, self.worker, self.state = path.admission, path.worker, path.state
        self.max_elements = max_request_elements(manifest)
        self.max_message_bytes = max_message_bytes(manifest)
        self._drains = 0
        self._control_calls = 0
        self.sending_state = 0  # downloads of this stage's state in flight (a leaving peer waits for them)
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
        for part in split_message(await self._handle_stream("train", requests, context)):
            yield part

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in split_message(await self._handle_stream("forward", requests, context)):
            yield part

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in split_message(await self._handle_stream("backward", requests, context)):
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
        if (refusal := self.path.refusal(caller)) is not None:
            if not admission.banned(caller):  # a banned peer's stream is not read at all
                await self._drain(requests)
            return refusal
        if self.manifest.private:  # an outsider's stream is refused on its first part, before it takes a slot
            try:
                first = await asyncio.wait_for(anext(requests), timeout=self.manifest.training.timeouts.forward)
            except (StopAsyncIteration, TimeoutError):
                return make_error_reply("the request stream did not start in time", ErrorCode.BAD_REQUEST)
            if (refusal := admission.outsider_refusal(first.metadata, caller)) is not None:
                await self._drain(requests)  # no slot taken; bounded like every refused stream's
                return refusal
            requests = _prepend(first, requests)
        admission.take_slot(caller)
        try:
            combine = combine_message(requests, runtime_pb2.ExpertRequest, self.max_message_bytes)
            request = await asyncio.wait_for(combine, timeout=self.manifest.training.timeouts.forward)
        except BadRequestError as e:
            await self._drain(requests)
            return self.path.error_reply(kind, caller, e)
        except TimeoutError:  # a slow link is no offence: not counted towards a ban
            return make_error_reply("the request stream did not finish in time", ErrorCode.BAD_REQUEST)
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
        if (refusal := self.path.refusal(caller)) is not None:
            return refusal
        max_elements = self.max_elements

        def serve(compute: StageCompute) -> _Served:  # in the worker: decode, compute, encode
            req = decode_request(request, compute.manifest, max_elements, caller)
            outputs = compute.process(kind, req, caller)
            return _Served(make_reply(outputs, wire_compression(compute.manifest)))

        if self.path.gate is None:
            result = await self.path.run(kind, caller, serve)
            return result.reply if isinstance(result, _Served) else result
        return await self._gated(kind, request, caller, serve)

    async def _gated(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str, serve
    ) -> runtime_pb2.ExpertResponse:
        """A relayed forward or backward under the stage's step gate (server/step_gate.py): a training forward of a
        stage before the last holds its slot until its backward here; the last stage's forward, and a backward
        that recomputes forward, take one for the request alone."""
        try:
            fields = decode_fields(decode_metadata(request, self.manifest, caller), self.manifest)
        except BadRequestError as e:
            return self.path.error_reply(kind, caller, e)
        gate, key = self.path.gate, (caller, fields.microbatch_id)
        assert gate is not None
        holds = kind == "backward" and gate.pin(key)  # the slot its forward took: applied by this backward
        opens = kind == "forward" and not self.last  # a forward whose backward here will apply the gradient
        if fields.train and not holds:
            timeouts, now = self.manifest.training.timeouts, time.monotonic()
            # a relayed microbatch's backward comes after the later stages' forwards and backwards, each call
            # within its timeout: past that, its trainer has given up on it (and the slot is given back)
            expires = now + (timeouts.forward + timeouts.backward) * self.manifest.num_stages
            wait_until = now + timeouts.forward / 2
            if refusal := await self.path.take_gradient_slot(caller, key, expires, wait_until, pinned=not opens):
                return refusal
        if not fields.train:
            result = await self.path.run(kind, caller, serve)
            return result.reply if isinstance(result, _Served) else result
        served = False
        try:
            result = await self.path.run(kind, caller, serve)
            served = isinstance(result, _Served)
        finally:
            if not (opens and served):  # an open forward's slot waits for its backward
                await self.path.release_gradient_slot(key, applied=served)
            if holds and not served:  # its forward's activations must not serve a backward of a later step
                self.path.forget([key])
        return result.reply if served else result

    # ------------------------------------------------------------------------------------ control calls

    async def rpc_probe(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Bandwidth probe: take the request's payload, reply with `reply_bytes` bytes of zeros."""
        caller = str(context.remote_id)
        if (refusal := self.admission.ban_refusal(caller)) is not None:
            return refusal
        try:
            metadata = decode_metadata(request, self.manifest, caller)
            reply_bytes = metadata.get("reply_bytes", 0)
            if not isinstance(reply_bytes, int) or not 0 <= reply_bytes <= PROBE_BYTES:
                raise BadRequestError(f"reply_bytes must be an integer from 0 to {PROBE_BYTES}")
        except BadRequestError as e:
            return self.admission.bad_request(caller, str(e))
        return make_reply([torch.zeros(reply_bytes // 4)])

    async def rpc_download_state(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream this stage's state (swarm/wire/state.py) to a peer that starts serving the stage.

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
            metadata = decode_metadata(request, self.manifest, caller)
            if type(metadata.get("stage")) is not int or metadata["stage"] != self.stage:
                raise BadRequestError(f"this peer serves stage {self.stage}, not {str(metadata.get('stage'))[:20]}")
        except BadRequestError as e:
            yield admission.bad_request(caller, str(e))
            return
        # a paused or leaving peer still hands its state out: it may be the stage's only holder
        handing_out = (PeerState.ONLINE, PeerState.PAUSED, PeerState.LEAVING)
        if self.state() not in handing_out or self._control_calls >= MAX_CONTROL_CALLS:
            yield admission.busy(f"this peer is {self.state()} or busy; try another peer")
            return
        self._control_calls += 1
        self.sending_state += 1
        try:
            # taken in the worker thread, between two requests, so parameters and statistics match
            try:
                items, counters = await self.worker.run(lambda compute: compute.snapshot())
            except StageStoppedError as e:  # it stopped here meanwhile: its state is in its checkpoint now
                yield admission.busy(str(e))
                return
            reply = make_reply([tensor for _, tensor in items])
            reply.metadata = pack({"ok": True, "names": [name for name, _ in items], **counters})
            for part in split_message(reply):
                yield part
        finally:
            self._control_calls -= 1
            self.sending_state -= 1

    async def rpc_tokenizer(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A chunk of the swarm's tokenizer file, from `offset` (swarm/dataset/tokenizer_source.py): a joining peer that
        has not got it asks here. Only a copy whose hash is the manifest's is handed out."""
        try:
            metadata = decode_metadata(request, self.manifest, str(context.remote_id))
            offset = metadata.get("offset", 0)
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise BadRequestError("offset must be a non-negative integer")
        except BadRequestError as e:
            return make_error_reply(str(e), ErrorCode.BAD_REQUEST)
        data = self._tokenizer_file()
        if data is None:
            return make_error_reply("this peer has no copy of the swarm's tokenizer", ErrorCode.BAD_REQUEST)
        chunk = data[offset : offset + TOKENIZER_CHUNK_BYTES]
        return runtime_pb2.ExpertResponse(metadata=pack({"ok": True, "total": len(data), "data": chunk}))

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
            return make_error_reply(
                "this swarm is private: join it with its manifest file, next to the secret file the manifest names",
                ErrorCode.BAD_REQUEST,
            )
        return runtime_pb2.ExpertResponse(metadata=pack({"ok": True, "manifest": self.manifest.to_json()}))


async def _prepend(first: runtime_pb2.ExpertRequest, rest: AsyncIterator) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    yield first
    async for part in rest:
        yield part
