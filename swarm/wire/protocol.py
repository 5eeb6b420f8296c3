"""Stage RPC messages: encode, decode, validate.

Requests and replies are hivemind's `ExpertRequest` / `ExpertResponse` protobufs: a list of serialized tensors
plus a `metadata` blob, which here is a msgpack dictionary. Everything that arrives from the network is checked
here before it reaches a model: the swarm id and protocol version, the metadata's types, each tensor's
compression, dtype, shape and byte size (before it is deserialized), then its values (finite, token ids in
range) and its shape against the stage it is meant for.

Forward request:   tensors [inputs] or, on the last stage, [inputs, targets]; metadata {train: bool}.
Forward reply:     [outputs] on other stages; on the last stage [loss] or, when training, [loss, grad_inputs].
Backward request:  tensors [grad_outputs] or [grad_outputs, inputs] (inputs let any peer recompute forward).
Backward reply:    [grad_inputs], or no tensor on stage 0 (its inputs are tokens).
Train request:     (stage-to-stage forwarding, server/forwarding.py) tensors [inputs, targets]; metadata also
                   {route: peer ids of the later stages, budget: seconds to reply}.
Train reply:       [loss] on stage 0, [loss, grad_inputs] on other stages (only [loss] when not training);
                   metadata {hops: [[peer id, compute seconds, total seconds, gradient print], ...]}, this
                   hop first; a hop before the last adds the fingerprint of the gradient its next hop sent back
                   (client/checks.py: a few numbers that checked work compares).
Error reply:       no tensors; metadata {error: message, code: bad_request | busy | banned |
                   unknown_microbatch | wrong_stage | internal | downstream_failed | duplicate | too_late | overflow}.

Every request names the stage it is meant for: a peer that has moved to another stage answers `wrong_stage`
instead of applying, say, a gradient of stage 1 to the weights of stage 2 (their shapes can be equal).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm import PROTOCOL_VERSION
from swarm.errors import BadRequestError, RemoteStageError
from swarm.manifests.manifest import Manifest

# Replies and requests up to this size go as one unary message (hivemind caps those at 4 MiB); larger by stream.
MAX_UNARY_BYTES = 3 * 1024 * 1024
STREAM_CHUNK_BYTES = 1024 * 1024
MAX_MICROBATCH_ID = 64

COMPRESSIONS = {
    "float32": runtime_pb2.CompressionType.NONE,
    "float16": runtime_pb2.CompressionType.FLOAT16,
    "bfloat16": runtime_pb2.CompressionType.NONE,  # sent as bfloat16 values (encode_tensor casts)
    "8bit": runtime_pb2.CompressionType.UNIFORM_8BIT,
}
MIN_8BIT_ELEMENTS = 1024  # smaller tensors (a loss, a bias) go uncompressed: a 1 KiB codebook would not pay off
_8BIT_HEADER_BYTES = 8 + 4 * 256  # hivemind's 8-bit format: codebook length (int64), 256 float32 codes, 1 B/element
_BYTES_PER_ELEMENT = {
    ("float32", runtime_pb2.CompressionType.NONE): 4,
    ("float32", runtime_pb2.CompressionType.FLOAT16): 2,
    ("float32", runtime_pb2.CompressionType.UNIFORM_8BIT): 1,
    ("bfloat16", runtime_pb2.CompressionType.NONE): 2,
    ("int64", runtime_pb2.CompressionType.NONE): 8,
}

Message = TypeVar("Message", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)

ERROR_CODES = (
    "bad_request",
    "busy",
    "banned",
    "unknown_microbatch",
    "wrong_stage",
    "internal",
    "downstream_failed",  # a later stage of a forwarded microbatch failed (not this peer's fault)
    "duplicate",  # this peer has this microbatch already (a gradient is never applied twice)
    "too_late",  # the hop's deadline passed before its gradient could be applied (nothing was applied)
    "overflow",  # a float16 stage's gradients overflowed its loss scale (nothing was applied; the scale drops)
)
MAX_PEER_ID = 128  # characters of a peer id in a route (base58 ids are about 52)


@dataclass
class StageRequest:
    """A decoded request: metadata and tensor headers validated, shapes not yet checked against the stage."""

    stage: int
    microbatch_id: str
    train: bool
    tensors: list[torch.Tensor]


# -------------------------------------------------------------------------------------------- encoding


def wire_compression(manifest: Manifest) -> str:
    """How activations and gradients travel between stages: as the manifest says, except that "float32" means
    "uncompressed", which is the compute dtype when stages compute in bfloat16. float16 stages send bfloat16:
    gradients leave a stage unscaled (server/precision.py), and float16's range would flush small ones to zero."""
    training = manifest.training
    if training.activation_compression == "float32" and training.precision != "float32":
        return "bfloat16"
    return training.activation_compression


def encode_tensor(tensor: torch.Tensor, compression: str = "float32") -> runtime_pb2.Tensor:
    tensor = tensor.detach().cpu()
    if compression == "bfloat16" and tensor.dtype == torch.float32 and tensor.numel() >= MIN_8BIT_ELEMENTS:
        # 2 bytes a value (hivemind's own serializer widens bfloat16 to float32 unless told otherwise globally)
        values = tensor.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        return runtime_pb2.Tensor(
            compression=runtime_pb2.CompressionType.NONE, buffer=values, size=tensor.shape, dtype="bfloat16"
        )
    kind = COMPRESSIONS[compression] if tensor.dtype == torch.float32 else runtime_pb2.CompressionType.NONE
    if kind == runtime_pb2.CompressionType.UNIFORM_8BIT and tensor.numel() < MIN_8BIT_ELEMENTS:
        kind = runtime_pb2.CompressionType.NONE
    return serialize_torch_tensor(tensor, kind)


def make_request(
    manifest: Manifest,
    stage: int,
    microbatch_id: str,
    tensors: list[torch.Tensor],
    train: bool = True,
    proof: str | None = None,
    **fields: object,
) -> runtime_pb2.ExpertRequest:
    """A forward, backward or train request; `proof` (manifest.proof(sender's peer id)) is needed in a private
    swarm; `fields` are more metadata (a train request's route and budget)."""
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
    compression = wire_compression(manifest)
    return runtime_pb2.ExpertRequest(
        tensors=[encode_tensor(t, compression) for t in tensors], metadata=MSGPackSerializer.dumps(metadata)
    )


def make_reply(
    tensors: list[torch.Tensor], compression: str = "float32", **fields: object
) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(
        tensors=[encode_tensor(t, compression) for t in tensors],
        metadata=MSGPackSerializer.dumps({"ok": True, **fields}),
    )


def make_error_reply(message: str, code: str = "bad_request") -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"error": message[:2000], "code": code}))


def unpack(data: bytes) -> object:
    """Decode msgpack from the network (metadata of requests and replies, gathered data): hivemind's format, with
    the nesting limit that importing `swarm` installs (swarm/trust/hivemind_limits.py). Raises on malformed input."""
    return MSGPackSerializer.loads(data)


def decode_reply(reply: runtime_pb2.ExpertResponse, max_elements: int) -> list[torch.Tensor]:
    """Tensors of a reply; raise RemoteStageError if the peer answered with an error."""
    try:
        metadata = unpack(reply.metadata) if reply.metadata else {}
    except Exception:
        raise RemoteStageError("the peer sent an unreadable reply", "internal") from None
    if not isinstance(metadata, dict):
        raise RemoteStageError("the peer sent an unreadable reply", "internal")
    if "error" in metadata:
        code = metadata.get("code") if metadata.get("code") in ERROR_CODES else "internal"
        raise RemoteStageError(str(metadata["error"])[:2000], code)
    try:
        return [decode_tensor(t, max_elements, f"reply tensor {i}") for i, t in enumerate(reply.tensors)]
    except BadRequestError as e:
        raise RemoteStageError(f"the peer sent a malformed reply: {e}", "internal") from None


# -------------------------------------------------------------------------------------------- decoding


def decode_tensor(proto: runtime_pb2.Tensor, max_elements: int, name: str) -> torch.Tensor:
    """Check a serialized tensor's header and byte size, then deserialize it."""
    key = (proto.dtype, proto.compression)
    if key not in _BYTES_PER_ELEMENT:
        names = {number: name for name, number in runtime_pb2.CompressionType.items()}
        compression = names.get(proto.compression, proto.compression)
        raise BadRequestError(
            f"{name}: dtype {proto.dtype or '(none)'!r} with compression {compression} is not accepted "
            "(use float32, float16, bfloat16 or 8-bit activations and int64 tokens)"
        )
    shape = list(proto.size)
    if len(shape) > 4:
        raise BadRequestError(f"{name}: {len(shape)} dimensions, at most 4 are accepted")
    numel = math.prod(shape)
    if numel > max_elements:
        raise BadRequestError(f"{name}: {numel} elements, more than the {max_elements} this stage accepts")
    expected = numel * _BYTES_PER_ELEMENT[key]
    if proto.compression == runtime_pb2.CompressionType.UNIFORM_8BIT:
        expected += _8BIT_HEADER_BYTES
        if proto.buffer[:8] != (256).to_bytes(8, "little"):
            raise BadRequestError(f"{name}: an 8-bit tensor must carry a codebook of 256 values")
    if len(proto.buffer) != expected:
        raise BadRequestError(f"{name}: buffer has {len(proto.buffer)} bytes, shape {shape} needs {expected}")
    if proto.requires_grad:
        proto.requires_grad = False
    try:
        tensor = deserialize_torch_tensor(proto)
        return tensor.float() if tensor.dtype == torch.bfloat16 else tensor  # stages take float32 (autocast)
    except Exception as e:
        raise BadRequestError(f"{name}: cannot be deserialized ({type(e).__name__})") from None


def decode_request(
    request: runtime_pb2.ExpertRequest, manifest: Manifest, max_elements: int, sender: str
) -> StageRequest:
    """Validate the metadata and tensor headers of a request (not yet its shapes against the stage)."""
    return decode_tensors(request, decode_fields(decode_metadata(request, manifest, sender), manifest), max_elements)


def decode_tensors(request: runtime_pb2.ExpertRequest, fields: StageRequest, max_elements: int) -> StageRequest:
    """The request's tensors (headers and sizes checked), into `fields` (from decode_fields)."""
    if len(request.tensors) > 2:
        raise BadRequestError(f"{len(request.tensors)} tensors sent, at most 2 are accepted")
    fields.tensors = [decode_tensor(t, max_elements, f"tensor {i}") for i, t in enumerate(request.tensors)]
    return fields


@dataclass
class Onward:
    """What a train request says of the rest of its way: the peers the trainer chose for the later stages (a
    hop may choose others), and the seconds this hop has to reply."""

    route: list[str]
    budget: float


def decode_onward(metadata: dict, manifest: Manifest, stage: int) -> Onward:
    """The route and budget of a train request for `stage`."""
    route = metadata.get("route", [])
    later = manifest.num_stages - 1 - stage
    if not isinstance(route, list) or len(route) > later:
        raise BadRequestError(f"route must be a list of at most {later} peer ids (one per later stage)")
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in route):
        raise BadRequestError(f"route must hold peer ids of 1 to {MAX_PEER_ID} characters")
    budget = metadata.get("budget")
    limit = manifest.training.timeouts.microbatch
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= limit:
        raise BadRequestError(f"budget must be a number of seconds in (0, {limit:g}] (training.timeouts.microbatch)")
    return Onward(route=list(route), budget=float(budget))


def decode_fields(metadata: dict, manifest: Manifest) -> StageRequest:
    """Stage, microbatch id and train flag of a request's metadata (its tensors not yet read)."""
    stage = metadata.get("stage")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < manifest.num_stages:
        raise BadRequestError(f"stage must be an integer from 0 to {manifest.num_stages - 1}")
    microbatch_id = metadata.get("microbatch_id")
    if not isinstance(microbatch_id, str) or not 0 < len(microbatch_id) <= MAX_MICROBATCH_ID:
        raise BadRequestError(f"microbatch_id must be a string of 1 to {MAX_MICROBATCH_ID} characters")
    train = metadata.get("train", True)
    if not isinstance(train, bool):
        raise BadRequestError("train must be true or false")
    return StageRequest(stage=stage, microbatch_id=microbatch_id, train=train, tensors=[])


@dataclass
class HopTiming:
    """One hop of a forwarded microbatch, as its reply reports it: seconds of compute at the peer, and seconds
    from the request's arrival to the reply (compute, queueing and everything after it on the route)."""

    peer_id: str
    compute: float
    total: float
    gradient_print: tuple[float, ...] = ()  # of the gradient the next hop sent back (none on the last hop)


MAX_PRINT = 16


def _gradient_print(value: object) -> tuple[float, ...]:
    """A hop's gradient fingerprint, or () when it is missing or malformed (then nothing is compared)."""
    if not isinstance(value, list) or len(value) > MAX_PRINT:
        return ()
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return ()
    return tuple(float(v) for v in value)


def decode_hops(reply: runtime_pb2.ExpertResponse, most: int) -> list[HopTiming]:
    """The timings a train reply carries (this hop's first); [] when they are missing or malformed (they only
    guide routing: a peer that lies about them misleads only its callers' estimates of itself)."""
    try:
        hops = unpack(reply.metadata).get("hops", [])
        if not isinstance(hops, list) or len(hops) > most:
            return []
        timings = []
        for hop in hops:
            if not isinstance(hop, list) or len(hop) not in (3, 4):
                return []
            peer_id, compute, total = hop[:3]
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (compute, total))
            if not (isinstance(peer_id, str) and 0 < len(peer_id) <= MAX_PEER_ID and numbers):
                return []
            if not (0 <= compute <= total <= 1e6):
                return []
            fingerprint = _gradient_print(hop[3]) if len(hop) == 4 else ()
            timings.append(HopTiming(peer_id, float(compute), float(total), fingerprint))
        return timings
    except Exception:
        return []


def decode_metadata(request: runtime_pb2.ExpertRequest, manifest: Manifest, sender: str) -> dict:
    """The metadata dictionary of a request, after checking its swarm id, protocol version and, in a private
    swarm, that `sender` (the peer id libp2p authenticated) proved that it holds the swarm's secret."""
    try:
        metadata = unpack(request.metadata)
    except Exception:
        raise BadRequestError("metadata is not a msgpack dictionary") from None
    if not isinstance(metadata, dict):
        raise BadRequestError("metadata is not a msgpack dictionary")
    if metadata.get("swarm_id") != manifest.swarm_id:
        raise BadRequestError(
            f"wrong swarm id {str(metadata.get('swarm_id'))[:40]!r}: this peer serves swarm {manifest.swarm_id}"
        )
    if metadata.get("protocol_version") != PROTOCOL_VERSION:
        raise BadRequestError(
            f"protocol version {str(metadata.get('protocol_version'))[:20]!r} is not supported: this peer speaks "
            f"{PROTOCOL_VERSION}"
        )
    if manifest.private and not (manifest.secret is not None and manifest.secret.check(sender, metadata.get("proof"))):
        raise BadRequestError(
            "this swarm is private: your request carries no valid proof that you hold its secret (the file the "
            "manifest's network.secret_file names)"
        )
    return metadata


def make_control_request(manifest: Manifest, proof: str | None = None, **fields) -> runtime_pb2.ExpertRequest:
    """A request that carries no stage tensors: a bandwidth probe or a request for the stage's state."""
    metadata = {"swarm_id": manifest.swarm_id, "protocol_version": PROTOCOL_VERSION, **fields}
    if proof is not None:
        metadata["proof"] = proof
    return runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps(metadata))


# ---------------------------------------------------------------------------------- checks for one stage


def check_inputs(inputs: torch.Tensor, manifest: Manifest, stage: int) -> None:
    """Stage 0 takes token ids [batch, length]; other stages take hidden states [batch, length, width]."""
    config, training = manifest.model, manifest.training
    if stage == 0:
        if inputs.dtype != torch.int64 or inputs.dim() != 2:
            raise BadRequestError(f"stage 0 inputs must be int64 token ids [batch, length], got {_describe(inputs)}")
        check_tokens(inputs, config.vocab_size, "inputs")
    else:
        if inputs.dtype != torch.float32 or inputs.dim() != 3 or inputs.shape[2] != config.width:
            raise BadRequestError(
                f"stage {stage} inputs must be float32 hidden states [batch, length, {config.width}], "
                f"got {_describe(inputs)}"
            )
        check_finite(inputs, "inputs")
    batch, length = inputs.shape[:2]
    if not 1 <= batch <= training.microbatch_size:
        raise BadRequestError(f"batch size {batch} is outside 1..{training.microbatch_size} (microbatch_size)")
    if not 1 <= length <= config.context_length:
        raise BadRequestError(f"sequence length {length} is outside 1..{config.context_length} (context_length)")


def check_targets(targets: torch.Tensor, inputs: torch.Tensor, vocab_size: int) -> None:
    if targets.dtype != torch.int64 or tuple(targets.shape) != tuple(inputs.shape[:2]):
        raise BadRequestError(
            f"targets must be int64 token ids of shape {list(inputs.shape[:2])}, got {_describe(targets)}"
        )
    check_tokens(targets, vocab_size, "targets")


def check_grad(grad: torch.Tensor, expected_shape: tuple[int, ...]) -> None:
    if grad.dtype != torch.float32 or tuple(grad.shape) != tuple(expected_shape):
        raise BadRequestError(f"grad_outputs must be float32 of shape {list(expected_shape)}, got {_describe(grad)}")
    check_finite(grad, "grad_outputs")


def check_tokens(tokens: torch.Tensor, vocab_size: int, name: str) -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise BadRequestError(f"{name} has token ids outside 0..{vocab_size - 1}")


def check_finite(tensor: torch.Tensor, name: str) -> None:
    if not all_finite(tensor):
        raise BadRequestError(f"{name} contains NaN or Inf values (or values so large that they sum to Inf)")


def all_finite(tensor: torch.Tensor) -> bool:
    """True if every value is finite. A sum is NaN or Inf if any value is, and several times faster than
    isfinite().all(); it also rejects absurd values whose sum overflows, which no real activation reaches."""
    return tensor.numel() == 0 or math.isfinite(float(tensor.sum()))


def max_request_elements(manifest: Manifest) -> int:
    """The largest tensor any valid request or reply holds: a microbatch of hidden states."""
    config, training = manifest.model, manifest.training
    return training.microbatch_size * config.context_length * config.width


def max_message_bytes(manifest: Manifest) -> int:
    """The most tensor bytes a valid request carries: hidden states and tokens or a gradient, float32."""
    return (
        2 * max_request_elements(manifest) * 4 + manifest.training.microbatch_size * manifest.model.context_length * 8
    )


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


# ------------------------------------------------------------------------------------------- streaming


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
