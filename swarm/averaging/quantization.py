"""A 4-bit codec for averaging rounds: 16 equal buckets over +-3 standard deviations of each part, each decoded to
the mean of its values.

hivemind 1.1.12 has 16- and 8-bit codecs only. DiLoCo's pseudo-gradients (the parameters' change over a round)
are well centred and smooth, and Streaming DiLoCo exchanges them at 4 bits; parameters themselves are not
(averaging them at 4 bits would move every weight by a sixteenth of its tensor's range each round), so this codec
is meant for diloco mode (the manifest's `averaging.compression: 4bit`).

Each part hivemind sends (up to 512 KiB) is encoded on its own: 16 buckets of equal width over the part's mean
+-RANGE_IN_SIGMAS standard deviations (the outer two take the tails), each value sent as its bucket's 4-bit
index, two to a byte, and the bucket's mean as the decoded value. Bytes: half a byte per element plus 72 bytes
per part. Relative error (norm of the error over the norm of the part): 0.11 on Gaussian values, against 0.15 for
buckets of equal counts and 0.018 for hivemind's 8-bit codec.

hivemind decodes a received tensor by the codec its message names, from a table of its own; there is no way to
add a type to its protocol, so this codec is registered in the table's slot of BLOCKWISE_8BIT, a codec that needs
bitsandbytes, which Swarm never installs or uses. Importing `swarm` registers it (like swarm/trust/hivemind_limits.py,
in this process, and so in the averager's, which is forked from it). A message that does not decode to what its
header says (sizes, lengths) raises MalformedDataError (a ValueError too), which hivemind treats as a failed part:
the round fails, the peer does not.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

from swarm.errors import AveragingError, MalformedDataError

BINS = 16
RANGE_IN_SIGMAS = 3.0  # the buckets cover the mean +- this many standard deviations (2.5-3 is best for Gaussians)
HEADER_BYTES = 8 + 4 * BINS  # the codebook's length (int64) and the codebook (float32)
SLOT = "BLOCKWISE_8BIT"  # the message type this codec travels as (see above)
MAX_ELEMENTS = 2**31  # a header that claims more is not one of ours


def encoded_bytes(numel: int) -> int:
    """Bytes of one encoded part of `numel` elements."""
    return HEADER_BYTES + math.ceil(numel / 2)


class Uniform4BitQuantization(CompressionBase):
    compression_type = runtime_pb2.CompressionType.Value(SLOT)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise AveragingError(f"4-bit quantization needs a floating-point tensor, not {tensor.dtype}")
        values = tensor.detach().float().flatten()
        spread = RANGE_IN_SIGMAS * (values.std() if values.numel() > 1 else values.abs().max())
        borders = values.mean() + spread * torch.linspace(-1, 1, BINS + 1)[1:-1]
        indices = torch.bucketize(values, borders).clamp_(0, BINS - 1)
        sums = torch.zeros(BINS).scatter_add_(0, indices, values)
        counts = torch.bincount(indices, minlength=BINS).clamp_(min=1)
        codebook = (sums / counts).numpy().astype(np.float32)
        nibbles = indices.to(torch.uint8).numpy()
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        packed = (nibbles[0::2] << 4) | nibbles[1::2]
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=b"".join((np.int64(BINS).tobytes(), codebook.tobytes(), packed.astype(np.uint8).tobytes())),
            size=tensor.shape,
            dtype="float32",
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        buffer = serialized_tensor.buffer
        if numel > MAX_ELEMENTS or serialized_tensor.dtype != "float32":
            raise MalformedDataError(
                f"a 4-bit part of {numel} {serialized_tensor.dtype} elements is not one of Swarm's"
            )
        if len(buffer) != encoded_bytes(numel) or int(np.frombuffer(buffer, np.int64, count=1)[0]) != BINS:
            raise MalformedDataError(
                f"a 4-bit part of {numel} elements must be {encoded_bytes(numel)} bytes, not {len(buffer)}"
            )
        codebook = torch.from_numpy(np.frombuffer(buffer, np.float32, count=BINS, offset=8).copy())
        packed = np.frombuffer(buffer, np.uint8, offset=HEADER_BYTES)
        nibbles = np.empty(2 * packed.size, dtype=np.uint8)
        nibbles[0::2], nibbles[1::2] = packed >> 4, packed & 0x0F
        indices = torch.from_numpy(nibbles[:numel].astype(np.int64))
        return codebook[indices].reshape(shape).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 4 / torch.finfo(info.descriptor.dtype).bits


def install() -> None:
    """Let hivemind decode this codec's messages (in this process and the ones forked from it)."""
    hivemind_serialization._BASE_COMPRESSION_TYPES[SLOT] = Uniform4BitQuantization()
