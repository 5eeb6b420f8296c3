"""Tensors on the wire: how activations and gradients are encoded (compressed as the manifest says), how a received
tensor is checked before it is deserialized, and the gradient fingerprints that both a hop and a trainer compute.

Tensors travel as hivemind's `runtime_pb2.Tensor`: a dtype, a compression, a shape and a byte buffer. A receiver
trusts none of it: `decode_tensor` accepts only the (dtype, compression) pairs below, at most 4 dimensions and a
given number of elements, and a buffer of exactly the size the header implies, before hivemind deserializes it.
"""

from __future__ import annotations

import math

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.errors import BadRequestError
from swarm.manifests.manifest import Manifest
from swarm.wire.four_bit import DTYPE as FOUR_BIT_DTYPE
from swarm.wire.four_bit import decode_4bit, encode_4bit

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
    ("int32", runtime_pb2.CompressionType.NONE): 4,  # token ids of a subspace swarm (swarm/wire/boundary.py)
    ("int16", runtime_pb2.CompressionType.NONE): 2,
}

PRINT_SIZE = 16  # numbers in a gradient's fingerprint (with fewer, the gap it estimates is noisier)
PRINT_SEED = 17
_projections: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


# -------------------------------------------------------------------------------------------- encoding


def wire_compression(manifest: Manifest) -> str:
    """How activations and gradients travel between stages: as the manifest says, except that "float32" means
    "uncompressed", which is the compute dtype when stages compute in bfloat16. float16 stages send bfloat16:
    gradients leave a stage unscaled (server/precision.py), and float16's range would flush small ones to zero."""
    training = manifest.training
    if training.activation_compression == "float32" and training.precision != "float32":
        return "bfloat16"
    return training.activation_compression


def encode_tensor(
    tensor: torch.Tensor, compression: str = "float32", token_dtype: torch.dtype = torch.int64
) -> runtime_pb2.Tensor:
    """A tensor as it goes on the wire; only float32 tensors are compressed; token ids (int64) go as `token_dtype`
    (which must hold them: swarm/wire/boundary.py picks it from the vocabulary)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.int64 and token_dtype != torch.int64:
        return serialize_torch_tensor(tensor.to(token_dtype), runtime_pb2.CompressionType.NONE)
    if compression == "bfloat16" and tensor.dtype == torch.float32 and tensor.numel() >= MIN_8BIT_ELEMENTS:
        # 2 bytes a value (hivemind's own serializer widens bfloat16 to float32 unless told otherwise globally)
        values = tensor.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        return runtime_pb2.Tensor(
            compression=runtime_pb2.CompressionType.NONE, buffer=values, size=tensor.shape, dtype="bfloat16"
        )
    if compression == "4bit" and tensor.dtype == torch.float32 and tensor.numel() >= MIN_8BIT_ELEMENTS:
        return encode_4bit(tensor)  # half a byte a value, a bfloat16 scale a row (swarm/wire/four_bit.py)
    # (4bit below MIN_8BIT_ELEMENTS, like 8-bit, goes uncompressed)
    none = runtime_pb2.CompressionType.NONE
    kind = COMPRESSIONS.get(compression, none) if tensor.dtype == torch.float32 else none
    if kind == runtime_pb2.CompressionType.UNIFORM_8BIT and tensor.numel() < MIN_8BIT_ELEMENTS:
        kind = runtime_pb2.CompressionType.NONE
    return serialize_torch_tensor(tensor, kind)


# -------------------------------------------------------------------------------------------- decoding


def decode_tensor(proto: runtime_pb2.Tensor, max_elements: int, name: str) -> torch.Tensor:
    """Check a serialized tensor's header and byte size, then deserialize it; BadRequestError (naming the tensor
    `name`) for anything this peer does not accept."""
    key = (proto.dtype, proto.compression)
    four_bit = key == (FOUR_BIT_DTYPE, runtime_pb2.CompressionType.NONE)
    if key not in _BYTES_PER_ELEMENT and not four_bit:
        names = {number: name for name, number in runtime_pb2.CompressionType.items()}
        compression = names.get(proto.compression, proto.compression)
        raise BadRequestError(
            f"{name}: dtype {proto.dtype or '(none)'!r} with compression {compression} is not accepted "
            "(use float32, float16, bfloat16, 8-bit or 4-bit activations and int64, int32 or int16 tokens)"
        )
    shape = list(proto.size)
    if len(shape) > 4:
        raise BadRequestError(f"{name}: {len(shape)} dimensions, at most 4 are accepted")
    numel = math.prod(shape)
    if numel > max_elements:
        raise BadRequestError(f"{name}: {numel} elements, more than the {max_elements} this stage accepts")
    if four_bit:  # its own format: scales and codes, checked there (swarm/wire/four_bit.py)
        return decode_4bit(proto, name)
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
        if tensor.dtype in (torch.int16, torch.int32):
            return tensor.long()  # token ids: the stages index with int64
        return tensor.float() if tensor.dtype == torch.bfloat16 else tensor  # stages take float32 (autocast)
    except Exception as e:
        raise BadRequestError(f"{name}: cannot be deserialized ({type(e).__name__})") from None


def all_finite(tensor: torch.Tensor) -> bool:
    """True if every value is finite. A sum is NaN or Inf if any value is, and several times faster than
    isfinite().all(); it also rejects absurd values whose sum overflows, which no real activation reaches."""
    return tensor.numel() == 0 or math.isfinite(float(tensor.sum()))


# ------------------------------------------------------------------------------------ gradient prints


def gradient_fingerprint(grad: torch.Tensor) -> list[float]:
    """PRINT_SIZE random projections of a (batch, positions, features) gradient, summed over the batch: the
    projections are rank one (u_k over positions times v_k over features), so a fingerprint costs one pass over
    the gradient and memory for (positions + features) x PRINT_SIZE numbers. The same on every peer (fixed seed):
    a hop reports the print of the gradient its next hop sent back, and a trainer compares two replicas' prints
    (swarm/client/checks.py)."""
    if grad.dim() != 3 or not grad.is_floating_point():
        return []
    _, positions, features = grad.shape
    key = (positions, features, str(grad.device))
    if key not in _projections:
        generator = torch.Generator().manual_seed(PRINT_SEED)
        u = torch.randn(positions, PRINT_SIZE, generator=generator)
        v = torch.randn(features, PRINT_SIZE, generator=generator)
        _projections.clear()  # one shape at a time is the usual case: do not grow
        _projections[key] = (u.to(grad.device), v.to(grad.device))
    u, v = _projections[key]
    summed = grad.detach().float().sum(dim=0)  # (positions, features)
    return [float(x) for x in ((summed @ v) * u).sum(dim=0).cpu()]
