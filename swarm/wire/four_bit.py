"""4-bit activations and gradients between stages (`activation_compression: 4bit`): half a byte a value.

Each row of a tensor (a token's values: the last dimension) is scaled by its largest magnitude, and every value is
sent as the index of the nearest of 16 fixed levels in [-1, 1]: NF4's, the quantiles of a normal distribution
(QLoRA, arXiv 2305.14314), which suit hidden states and their gradients, whose values cluster near zero. The
row's scale travels as a bfloat16 (float32's range: a gradient's tiny rows do not flush to zero). Per row, so that
one token's outlier costs only that token's resolution.

The format is Swarm's own: dtype "nf4", compression NONE, the tensor's shape, and a buffer of the rows' scales
(2 bytes each, little-endian bfloat16) followed by the codes, two to a byte (high nibble first). hivemind never
decodes it: swarm/wire/tensors.py hands it here, and `decode_4bit` checks the shape, the exact byte count and
that every scale is finite before it builds anything. Rounding is to the nearest level, deterministic, so that a
trainer's check (the same microbatch through two replicas) sees the same bytes from two honest peers.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.proto import runtime_pb2

from swarm.errors import BadRequestError

DTYPE = "nf4"
LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)
_BORDERS = (LEVELS[1:] + LEVELS[:-1]) / 2  # a value goes to the level whose interval holds it


def encoded_bytes(shape: list[int] | tuple[int, ...]) -> int:
    """Bytes of an encoded tensor of this shape: 2 per row (its scale) and half a byte per value."""
    numel = math.prod(shape)
    rows = numel // shape[-1] if shape and shape[-1] else 0
    return 2 * rows + math.ceil(numel / 2)


def encode_4bit(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """A float tensor of at least one dimension, as the wire's 4-bit format."""
    values = tensor.detach().float().cpu().reshape(-1, tensor.shape[-1])
    scales = values.abs().amax(dim=1, keepdim=True).to(torch.bfloat16)
    divisor = scales.float()
    divisor[divisor == 0] = 1.0  # an all-zero row: every value is level 0.0, whatever the scale
    codes = torch.bucketize(values / divisor, _BORDERS).to(torch.uint8).flatten().numpy()
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    packed = (codes[0::2] << 4) | codes[1::2]
    buffer = scales.flatten().view(torch.int16).numpy().astype("<i2").tobytes() + packed.astype(np.uint8).tobytes()
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, buffer=buffer, size=tensor.shape, dtype=DTYPE
    )


def decode_4bit(proto: runtime_pb2.Tensor, name: str) -> torch.Tensor:
    """The float32 tensor a 4-bit message holds; BadRequestError for a shape, size or scale that is not one of its
    own (the caller has checked the element count against its limit)."""
    shape = list(proto.size)
    if not shape or shape[-1] < 1:
        raise BadRequestError(f"{name}: a 4-bit tensor needs at least one dimension of size 1 or more, not {shape}")
    numel = math.prod(shape)
    rows = numel // shape[-1]
    if len(proto.buffer) != encoded_bytes(shape):
        raise BadRequestError(
            f"{name}: a 4-bit buffer of shape {shape} has {encoded_bytes(shape)} bytes, not {len(proto.buffer)}"
        )
    raw = np.frombuffer(proto.buffer, dtype="<i2", count=rows).astype(np.int16)
    scales = torch.from_numpy(raw.copy()).view(torch.bfloat16).float().unsqueeze(1)
    if not bool(torch.isfinite(scales).all()):
        raise BadRequestError(f"{name}: a 4-bit tensor's row scales must be finite numbers")
    packed = np.frombuffer(proto.buffer, dtype=np.uint8, offset=2 * rows)
    codes = np.empty(2 * packed.size, dtype=np.uint8)
    codes[0::2], codes[1::2] = packed >> 4, packed & 15
    values = LEVELS[torch.from_numpy(codes[:numel].astype(np.int64))].reshape(rows, shape[-1])
    return (values * scales).reshape(shape)
