"""4-bit activations and gradients between stages (swarm/wire/four_bit.py, `activation_compression: 4bit`): what
a round trip keeps, what it costs in bytes, and that a malformed 4-bit message is refused before anything is built."""

from __future__ import annotations

import pytest
import torch
from hivemind.proto import runtime_pb2

from conftest import tiny_manifest_dict
from swarm.errors import BadRequestError
from swarm.manifests.validation import manifest_from_dict
from swarm.throughput import stage_bytes_per_sample
from swarm.wire.four_bit import LEVELS, encoded_bytes
from swarm.wire.tensors import decode_tensor, encode_tensor

LIMIT = 10**7


def round_trip(tensor: torch.Tensor) -> torch.Tensor:
    return decode_tensor(encode_tensor(tensor, "4bit"), LIMIT, "t")


def test_a_round_trip_keeps_shape_and_row_maxima_and_errs_by_a_tenth():
    torch.manual_seed(0)
    x = torch.randn(8, 64, 48)
    y = round_trip(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert float((y - x).norm() / x.norm()) < 0.1  # NF4 on normal values: about 0.09
    # each row's largest magnitude is a level (+-1 times the scale), kept up to bfloat16's rounding of the scale
    row_max = x.abs().amax(dim=-1)
    assert torch.allclose(y.abs().amax(dim=-1), row_max, rtol=2**-8)
    # no value moves by more than half the widest gap between levels, times its row's scale
    gap = float((LEVELS[1:] - LEVELS[:-1]).max()) / 2
    assert bool(((y - x).abs() <= gap * row_max.unsqueeze(-1) * (1 + 2**-7)).all())


def test_rows_are_scaled_on_their_own_so_small_gradients_survive():
    x = torch.randn(4, 16, 64)
    x[0] *= 1e-30  # far below float16's range: a bfloat16 scale keeps it
    x[1] *= 1e6
    x[2] = 0.0
    y = round_trip(x)
    for row in (0, 1, 3):
        error, size = (y[row].double() - x[row].double()).norm(), x[row].double().norm()  # 1e-60 is no float32
        assert float(error / size) < 0.12
    assert torch.equal(y[2], torch.zeros_like(y[2]))


def test_it_is_half_a_byte_a_value_and_two_bytes_a_row_and_deterministic():
    x = torch.randn(16, 64, 48)
    proto = encode_tensor(x, "4bit")
    assert proto.dtype == "nf4" and len(proto.buffer) == 16 * 64 * (48 // 2 + 2) == encoded_bytes([16, 64, 48])
    assert encode_tensor(x, "4bit").buffer == proto.buffer  # two honest replicas send the same bytes
    assert encoded_bytes([3, 5]) == 2 * 3 + 8  # an odd count rounds up to a whole byte
    small = torch.randn(4, 8)  # under 1,024 values: sent uncompressed, as 8-bit does
    assert encode_tensor(small, "4bit").dtype == "float32"
    assert torch.equal(round_trip(small), small)


def raw(size: list[int], buffer: bytes, compression: int = runtime_pb2.CompressionType.NONE) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(dtype="nf4", size=size, buffer=buffer, compression=compression)


@pytest.mark.parametrize(
    "proto, message",
    [
        (raw([2, 64], b"\xc0\x7f" * 2 + bytes(64)), "finite"),  # NaN scales
        (raw([2, 64], b"\x80\x7f" * 2 + bytes(64)), "finite"),  # infinite scales
        (raw([2, 64], bytes(4 + 63)), "bytes"),
        (raw([2, 64], bytes(4 + 65)), "bytes"),
        (raw([2, 64], bytes(64)), "bytes"),  # no scales
        (raw([], b""), "dimension"),
        (raw([2, 0], b""), "dimension"),
        (raw([2**32 - 1, 2**32 - 1], bytes(8)), "more than"),
        (raw([1, 1, 1, 2, 64], bytes(4 + 64)), "dimensions"),  # as for every other format: at most 4
        (raw([2, 64], bytes(4 + 32), runtime_pb2.CompressionType.UNIFORM_8BIT), "not accepted"),
    ],
)
def test_a_malformed_4bit_tensor_is_refused_with_a_reason(proto, message):
    with pytest.raises(BadRequestError, match=message):
        decode_tensor(proto, LIMIT, "inputs")


def test_the_manifest_takes_4bit_and_a_peer_counts_its_bytes():
    def manifest(compression: str, rank: int = 0):
        model = {"architecture": "llama", "width": 128, "depth": 3, "heads": 4, "subspace_rank": rank}
        raw_manifest = tiny_manifest_dict(model=model, stages={"count": 3})
        raw_manifest["training"]["activation_compression"] = compression
        return manifest_from_dict(raw_manifest)

    received, sent = stage_bytes_per_sample(manifest("4bit"), 1)
    eight_received, eight_sent = stage_bytes_per_sample(manifest("8bit"), 1)
    assert 2 * received == eight_received and 2 * sent == eight_sent
    # a subspace swarm's boundary: rank values per token (and its token window), not the width
    subspace, _ = stage_bytes_per_sample(manifest("4bit", rank=8), 1)
    context = manifest("4bit").model.context_length
    assert subspace == context * 8 + (context + 1) * 2
    with pytest.raises(Exception, match="activation_compression"):
        manifest("3bit")
