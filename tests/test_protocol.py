"""Compression of activations and gradients between stages, and its validation on arrival."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import BadRequestError
from swarm.wire import protocol

LIMIT = 10**7


@pytest.mark.parametrize(
    "compression, bytes_per_element, tolerance",
    [("float32", 4, 0), ("float16", 2, 1e-3), ("bfloat16", 2, 1e-2), ("8bit", 1, 0.05)],
)
def test_activations_travel_compressed_and_come_back_close(compression, bytes_per_element, tolerance):
    torch.manual_seed(0)
    activations = torch.randn(4, 32, 64)
    proto = protocol.encode_tensor(activations, compression)
    assert len(proto.buffer) <= bytes_per_element * activations.numel() + 2048
    decoded = protocol.decode_tensor(proto, LIMIT, "activations")
    assert decoded.dtype == torch.float32 and decoded.shape == activations.shape
    relative = float((decoded - activations).norm() / activations.norm())
    assert relative <= tolerance


def test_small_tensors_are_not_quantized():
    loss = torch.tensor([2.5])
    proto = protocol.encode_tensor(loss, "8bit")
    assert float(protocol.decode_tensor(proto, LIMIT, "loss")[0]) == 2.5


def test_malformed_8bit_tensors_are_refused():
    proto = protocol.encode_tensor(torch.randn(2048), "8bit")
    truncated = type(proto)()
    truncated.CopyFrom(proto)
    truncated.buffer = proto.buffer[:-1]
    with pytest.raises(BadRequestError, match="bytes"):
        protocol.decode_tensor(truncated, LIMIT, "x")
    huge_codebook = type(proto)()
    huge_codebook.CopyFrom(proto)
    huge_codebook.buffer = (10**9).to_bytes(8, "little") + proto.buffer[8:]
    with pytest.raises(BadRequestError, match="codebook"):
        protocol.decode_tensor(huge_codebook, LIMIT, "x")


def test_uncompressed_activations_travel_in_the_compute_dtype():
    from conftest import tiny_manifest_dict
    from swarm.manifests.manifest import manifest_from_dict

    def wire(precision, compression):
        raw = tiny_manifest_dict(training={"precision": precision, "activation_compression": compression})
        return protocol.wire_compression(manifest_from_dict(raw))

    assert wire("float32", "float32") == "float32"
    assert wire("bfloat16", "float32") == "bfloat16"
    assert wire("float16", "float32") == "bfloat16"  # unscaled gradients need bfloat16's range
    assert wire("bfloat16", "8bit") == "8bit"  # compressed further: as asked
