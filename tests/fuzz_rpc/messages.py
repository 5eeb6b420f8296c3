"""What the fuzz cases are made from: the handlers' names, valid requests (that never train) to start from,
and hivemind's stream framing, written byte by byte so that a case can break it anywhere."""

from __future__ import annotations

from typing import Any

import msgpack
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from fuzzing import FIRST, LAST, MANIFEST
from swarm import PROTOCOL_VERSION
from swarm.errors import BadRequestError
from swarm.wire import boundary, validation
from swarm.wire.messages import split_message
from swarm.wire.rpc import CheckpointRPC, ReachabilityRPC, StageRPC
from swarm.wire.tensors import encode_tensor

WIDTH, VOCAB = MANIFEST.model.width, MANIFEST.model.vocab_size
BATCH, LENGTH = 2, 8  # of the valid requests: small, so that thousands of them cost little

NONE = runtime_pb2.CompressionType.NONE
FLOAT16 = runtime_pb2.CompressionType.FLOAT16
UNIFORM_8BIT = runtime_pb2.CompressionType.UNIFORM_8BIT
COMPRESSION_VALUES = [value for _, value in runtime_pb2.CompressionType.items()] + [6, 127, 12345]
DTYPES = ["float32", "int64", "float16", "float64", "bfloat16", "int32", "int8", "uint8", "bool", "nf4", "", "evil"]


# the handlers' names on the wire (swarm/wire/rpc.py; tests/test_protocol.py pins them)
FORWARD = StageRPC.handle_name("rpc_forward")
BACKWARD = StageRPC.handle_name("rpc_backward")
FORWARD_STREAM = StageRPC.handle_name("rpc_forward_stream")
BACKWARD_STREAM = StageRPC.handle_name("rpc_backward_stream")
TRAIN = StageRPC.handle_name("rpc_train")
PROBE = StageRPC.handle_name("rpc_probe")
DOWNLOAD_STATE = StageRPC.handle_name("rpc_download_state")
CHECKPOINT = CheckpointRPC.handle_name("rpc_checkpoint")
MANIFEST_RPC = StageRPC.handle_name("rpc_manifest")
TOKENIZER_RPC = StageRPC.handle_name("rpc_tokenizer")
CHECK = ReachabilityRPC.handle_name("rpc_check")
STAGE_UNARY = (FORWARD, BACKWARD, PROBE)


def metadata(**fields: Any) -> dict:
    """Valid request metadata for this swarm (a request that does not train), with `fields` changed."""
    valid = {"swarm_id": MANIFEST.swarm_id, "protocol_version": PROTOCOL_VERSION, "stage": LAST, "train": False}
    return {**valid, "microbatch_id": "fuzz", **fields}


DELETE = object()  # a field of metadata_fields() that is removed


def make_request(tensors: list, meta: dict | bytes | None = None) -> runtime_pb2.ExpertRequest:
    """A request of serialized tensors (torch tensors are encoded as float32 activations and int64 tokens)."""
    protos = [t if isinstance(t, runtime_pb2.Tensor) else encode_tensor(t) for t in tensors]
    meta = metadata() if meta is None else meta
    raw = meta if isinstance(meta, bytes) else packb(meta)
    return runtime_pb2.ExpertRequest(tensors=protos, metadata=raw)


def hidden(batch: int = BATCH, length: int = LENGTH, width: int = WIDTH, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed))


def tokens(batch: int = BATCH, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def valid_forward(stage: int, train: bool = False, microbatch_id: str = "fuzz") -> runtime_pb2.ExpertRequest:
    tensors = [tokens()] if stage == FIRST else [hidden(), tokens()]
    return make_request(tensors, metadata(stage=stage, train=train, microbatch_id=microbatch_id))


def raw_tensor(dtype: str, size: list[int], buffer: bytes, compression: int = NONE, **kw: Any) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(dtype=dtype, size=size, buffer=buffer, compression=compression, **kw)


def might_change_weights(data: bytes, method: str, stage: int) -> bool:
    """Whether the peer might apply this request to its weights: a valid training forward (on stage 0 its cached
    activations would let a later backward apply), or a valid backward with inputs on stage 0. Such cases are
    never sent, so that the peers' parameters must stay exactly as they were. A train request (forwarding) that
    trains and whose metadata is valid is assumed to change them."""
    if method == TRAIN:
        try:
            meta = validation.decode_metadata(runtime_pb2.ExpertRequest.FromString(data), MANIFEST, sender="fuzz")
            return validation.decode_fields(meta, MANIFEST).train
        except Exception:
            return False
    if method not in (FORWARD, BACKWARD) or (method == BACKWARD and stage == LAST):
        return False
    try:
        request = runtime_pb2.ExpertRequest.FromString(data)
    except Exception:  # hivemind cannot parse it either: it never reaches the peer's code
        return False
    try:  # (any other exception, e.g. a new signature, fails the case loudly instead of letting it through)
        req = validation.decode_request(request, MANIFEST, validation.max_request_elements(MANIFEST), sender="fuzz")
    except BadRequestError:
        return False
    if req.stage != stage:
        return False
    try:
        if method == FORWARD:
            if not req.train or len(req.tensors) != (2 if stage == LAST else 1):
                return False
            validation.check_inputs(req.tensors[0], MANIFEST, stage)
            if stage == LAST:
                boundary.check_token_tensor(MANIFEST, req.tensors[1], req.tensors[0])
            return True
        if len(req.tensors) != 2:  # without inputs: refused, as no identity reuses a cached microbatch id
            return False
        inputs = req.tensors[1]
        validation.check_inputs(inputs, MANIFEST, stage)
        validation.check_grad(req.tensors[0], (*inputs.shape[:2], WIDTH))
        return True
    except BadRequestError:
        return False
    except Exception:  # e.g. a tensor the checks choke on: assume the worst
        return True


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def train_request(stage: int, tensors: list | None = None, **fields: Any) -> bytes:
    """A train request (stage-to-stage forwarding) that does not train: valid unless `fields` or `tensors` say
    otherwise."""
    tensors = tensors if tensors is not None else ([tokens()] if stage == FIRST else [hidden()]) + [tokens()]
    meta = metadata(stage=stage, **{"budget": 10.0, "route": [], **fields})
    return make_request(tensors, {k: v for k, v in meta.items() if v is not DELETE}).SerializeToString()


def frame(payload: bytes, marker: bytes = P2P.MESSAGE_MARKER) -> bytes:
    """One message of hivemind's stream format: a marker byte, an 8-byte length, the payload."""
    return marker + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


END_OF_STREAM = frame(b"", P2P.ERROR_MARKER)  # hivemind ends a request stream with an empty error message


def parts(request: runtime_pb2.ExpertRequest) -> list[bytes]:
    """A request as the stream frames a client sends (the first part carries the metadata)."""
    return [frame(part.SerializeToString()) for part in split_message(request)]


def chunk_part(buffer: bytes, dtype: str = "", size: list[int] | None = None) -> bytes:
    tensor = runtime_pb2.Tensor(buffer=buffer, dtype=dtype, size=size or [])
    return frame(runtime_pb2.ExpertRequest(tensors=[tensor]).SerializeToString())


def state_request(**fields: Any) -> bytes:
    meta = {"swarm_id": MANIFEST.swarm_id, "protocol_version": PROTOCOL_VERSION, **fields}
    return frame(runtime_pb2.ExpertRequest(metadata=packb(meta)).SerializeToString())
