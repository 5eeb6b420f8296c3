"""Stage RPC messages: what requests and replies hold, how they are built and read, and how a large one goes by
stream.

Requests and replies are hivemind's `ExpertRequest` / `ExpertResponse` protobufs: a list of serialized tensors
(swarm/wire/tensors.py) plus a `metadata` blob, which here is a msgpack dictionary. A request's metadata always
holds the swarm id, the protocol version and, in a private swarm, a proof of membership; everything a request
says is checked on arrival (swarm/wire/validation.py) before it reaches a model.

Forward request:   tensors [inputs] or, on the last stage, [inputs, targets]; metadata {train: bool}.
Forward reply:     [outputs] on other stages; on the last stage [loss] or, when training, [loss, grad_inputs].
Backward request:  tensors [grad_outputs] or [grad_outputs, inputs] (inputs let any peer recompute forward).
                   In a subspace swarm the stages after the first also take the token window: [inputs, window]
                   where the others take [inputs] or [inputs, targets], and [grad_outputs, inputs, window]
                   (swarm/wire/boundary.py).
Backward reply:    [grad_inputs], or no tensor on stage 0 (its inputs are tokens).
Train request:     (stage-to-stage forwarding, server/forwarding.py) tensors [inputs, targets]; metadata also
                   {route: peer ids of the later stages, budget: seconds to reply}.
Train reply:       [loss] on stage 0, [loss, grad_inputs] on other stages (only [loss] when not training);
                   metadata {hops: [[peer id, compute seconds, total seconds, gradient print], ...]}, this
                   hop first (swarm/wire/hops.py); a hop before the last adds the fingerprint of the gradient its
                   next hop sent back (swarm/wire/tensors.py: a few numbers that checked work compares).
Control requests:  no stage tensors: a bandwidth probe {reply_bytes}, a state download {stage} (its reply: the
                   state's tensors, metadata {names, optimizer_steps, averaging_round}: swarm/wire/state.py),
                   a chunk of the tokenizer {offset} (reply {total, data}), the manifest (reply {manifest}).
Error reply:       no tensors; metadata {error: message, code: one of swarm/wire/codes.py's ErrorCode}.

Every request names the stage it is meant for: a peer that has moved to another stage answers `wrong_stage`
instead of applying, say, a gradient of stage 1 to the weights of stage 2 (their shapes can be equal).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm import PROTOCOL_VERSION
from swarm.errors import BadRequestError, RemoteStageError
from swarm.manifests.manifest import Manifest
from swarm.wire.boundary import wire_token_dtype
from swarm.wire.codes import ErrorCode
from swarm.wire.tensors import decode_tensor, encode_tensor, wire_compression

# Replies and requests up to this size go as one unary message (hivemind caps those at 4 MiB); larger by stream.
MAX_UNARY_BYTES = 3 * 1024 * 1024
STREAM_CHUNK_BYTES = 1024 * 1024
MAX_ERROR_MESSAGE = 2000  # characters of an error reply's message

Message = TypeVar("Message", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


@dataclass
class StageRequest:
    """A decoded request: metadata and tensor headers validated, shapes not yet checked against the stage."""

    stage: int
    microbatch_id: str
    train: bool
    tensors: list[torch.Tensor]


@dataclass
class Onward:
    """What a train request says of the rest of its way: the peers the trainer chose for the later stages (a
    hop may choose others), and the seconds this hop has to reply."""

    route: list[str]
    budget: float


# ------------------------------------------------------------------------------------------- building


def pack(metadata: dict) -> bytes:
    """Metadata as it goes on the wire (msgpack, hivemind's format)."""
    return MSGPackSerializer.dumps(metadata)


def unpack(data: bytes) -> object:
    """Decode msgpack from the network (metadata of requests and replies, gathered data): hivemind's format, with
    the nesting limit that importing `swarm` installs (swarm/trust/hivemind_limits.py). Raises on malformed input."""
    return MSGPackSerializer.loads(data)


def make_request(
    manifest: Manifest,
    stage: int,
    microbatch_id: str,
    tensors: list[torch.Tensor],
    train: bool = True,
    proof: str | None = None,
    compression: str | None = None,
    **fields: object,
) -> runtime_pb2.ExpertRequest:
    """A forward, backward or train request; `proof` (manifest.proof(sender's peer id)) is needed in a private
    swarm; `compression` overrides the swarm's (a hop to the next stage on the same peer sends float32: nothing
    crosses a link); `fields` are more metadata (a train request's route and budget)."""
    metadata = {
        **fields,
        "swarm_id": manifest.swarm_id,
        "protocol_version": PROTOCOL_VERSION,
        "stage": stage,
        "microbatch_id": microbatch_id,
        "train": train,
    }
    if proof is not None:
        metadata["proof"] = proof
    compression, token_dtype = compression or wire_compression(manifest), wire_token_dtype(manifest)
    encoded = [encode_tensor(t, compression, token_dtype) for t in tensors]
    return runtime_pb2.ExpertRequest(tensors=encoded, metadata=pack(metadata))


def make_control_request(manifest: Manifest, proof: str | None = None, **fields) -> runtime_pb2.ExpertRequest:
    """A request that carries no stage tensors: a bandwidth probe or a request for the stage's state."""
    metadata = {"swarm_id": manifest.swarm_id, "protocol_version": PROTOCOL_VERSION, **fields}
    if proof is not None:
        metadata["proof"] = proof
    return runtime_pb2.ExpertRequest(metadata=pack(metadata))


def make_reply(
    tensors: list[torch.Tensor], compression: str = "float32", **fields: object
) -> runtime_pb2.ExpertResponse:
    """A successful reply: `tensors`, encoded as `compression` says, and `fields` as metadata."""
    return runtime_pb2.ExpertResponse(
        tensors=[encode_tensor(t, compression) for t in tensors], metadata=pack({"ok": True, **fields})
    )


def make_error_reply(message: str, code: ErrorCode) -> runtime_pb2.ExpertResponse:
    """An error reply: why (for people) and its code (for programs: swarm/wire/codes.py)."""
    return runtime_pb2.ExpertResponse(metadata=pack({"error": message[:MAX_ERROR_MESSAGE], "code": str(code)}))


# -------------------------------------------------------------------------------------------- reading


def decode_reply(reply: runtime_pb2.ExpertResponse, max_elements: int) -> list[torch.Tensor]:
    """Tensors of a reply; raise RemoteStageError if the peer answered with an error (its code attached), or
    with a reply that cannot be read (INTERNAL)."""
    try:
        metadata = unpack(reply.metadata) if reply.metadata else {}
    except Exception:
        raise RemoteStageError("the peer sent an unreadable reply", ErrorCode.INTERNAL) from None
    if not isinstance(metadata, dict):
        raise RemoteStageError("the peer sent an unreadable reply", ErrorCode.INTERNAL)
    if "error" in metadata:
        raise RemoteStageError(str(metadata["error"])[:MAX_ERROR_MESSAGE], ErrorCode.of_reply(metadata.get("code")))
    try:
        return [decode_tensor(t, max_elements, f"reply tensor {i}") for i, t in enumerate(reply.tensors)]
    except BadRequestError as e:
        raise RemoteStageError(f"the peer sent a malformed reply: {e}", ErrorCode.INTERNAL) from None


# ------------------------------------------------------------------------------------------ streaming


def needs_stream(message_bytes: int, reply_elements: int) -> bool:
    """Whether a call must go by stream: its request or its expected reply would not fit one unary message."""
    return max(message_bytes, reply_elements * 4) > MAX_UNARY_BYTES


def split_message(message: Message) -> list[Message]:
    """Split a request or reply into stream parts; the first part carries the metadata."""
    parts = [type(message)(metadata=message.metadata)]
    for tensor in message.tensors:
        for chunk in split_for_streaming(tensor, STREAM_CHUNK_BYTES):
            parts.append(type(message)(tensors=[chunk]))
    return parts


async def combine_message(
    parts: AsyncIterator[Message], message_type: type[Message], max_bytes: int, max_tensors: int = 2
) -> Message:
    """Rebuild a message from stream parts, refusing more than max_bytes in all (parts counted whole), more
    than max_tensors tensors, and empty chunks. Chunks are copied, so that no part (with whatever else it
    carries) stays in memory."""
    metadata = b""
    tensors: list[list[runtime_pb2.Tensor]] = []
    total = 0
    async for index, part in _enumerate(parts):
        total += part.ByteSize()
        if total > max_bytes + 65536:
            raise BadRequestError(f"the message is larger than the {max_bytes} bytes this peer accepts")
        if index == 0:
            metadata = bytes(part.metadata)
        for chunk in part.tensors:
            if not chunk.buffer:
                raise BadRequestError("a stream chunk is empty")
            copy = runtime_pb2.Tensor()
            copy.CopyFrom(chunk)
            if chunk.dtype or not tensors:
                tensors.append([copy])
            else:
                tensors[-1].append(copy)
            if len(tensors) > max_tensors:
                raise BadRequestError(f"{len(tensors)} tensors sent, at most {max_tensors} are accepted")
    return message_type(metadata=metadata, tensors=[combine_from_streaming(t) for t in tensors])


async def _enumerate(parts: AsyncIterator[Message]) -> AsyncIterator[tuple[int, Message]]:
    index = 0
    async for part in parts:
        yield index, part
        index += 1
