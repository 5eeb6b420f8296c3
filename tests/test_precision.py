"""Mixed precision in a served stage: two StageComputes (stage 0 and the last stage) train a tiny Llama in
bfloat16 and in float16 the way peers do (forward, the last stage's loss and input gradient, backward), with
float32 weights and optimizer state; float16's loss scaler keeps the wire's gradients true, and an overflow is
refused without touching the weights, with the scale halved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.dataset.shards import sample_batch
from swarm.errors import GradientOverflowError
from swarm.manifests.validation import manifest_from_dict
from swarm.server.compute import StageCompute
from swarm.wire import messages

LLAMA = {"architecture": "llama", "width": 64, "depth": 2, "heads": 4, "kv_heads": 2, "context_length": 32}
TEXT = np.frombuffer(b"def stage(x):\n    return x * 2 + 1\n" * 400, dtype=np.uint8)


def pair(precision: str) -> tuple[StageCompute, StageCompute]:
    raw = tiny_manifest_dict(model=LLAMA, training={"precision": precision, "learning_rate": 0.01})
    manifest = manifest_from_dict(raw)
    return tuple(StageCompute(manifest, s, build_stage(manifest, s), torch.device("cpu")) for s in (0, 1))


def step(first: StageCompute, last: StageCompute, x: torch.Tensor, y: torch.Tensor, name: str) -> float:
    (hidden,) = first.process("forward", messages.StageRequest(0, name, True, [x]), "trainer")
    loss, grad = last.process("forward", messages.StageRequest(1, name, True, [hidden, y]), "trainer")
    assert hidden.dtype == torch.float32 and grad.dtype == torch.float32
    first.process("backward", messages.StageRequest(0, name, True, [grad]), "trainer")
    return float(loss)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_mixed_precision_pipeline_learns_with_float32_state(precision):
    first, last = pair(precision)
    rng = np.random.default_rng(0)
    losses = [step(first, last, *sample_batch(TEXT, 8, 32, rng), f"m{i}") for i in range(40)]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    for compute in (first, last):
        assert all(p.dtype == torch.float32 for p in compute.params)
        items, _ = compute.snapshot()
        assert all(t.dtype == torch.float32 for _, t in items)
        assert compute.counters.optimizer_steps == 40
    if precision == "float16":
        assert first.scaler.enabled and first.scaler.scale == 2.0**16 and first.scaler.overflows == 0


def test_a_float16_overflow_is_refused_and_lowers_the_scale():
    first, last = pair("float16")
    x, y = sample_batch(TEXT, 8, 32, np.random.default_rng(1))
    (hidden,) = first.process("forward", messages.StageRequest(0, "a", True, [x]), "trainer")
    before = [p.detach().clone() for p in first.params]
    huge = torch.full((8, 32, 64), 1e30)  # finite on the wire, Inf once scaled in float16 arithmetic
    with pytest.raises(GradientOverflowError, match="overflowed"):
        first.process("backward", messages.StageRequest(0, "a", True, [huge, x]), "trainer")
    assert first.scaler.scale == 2.0**15 and first.scaler.overflows == 1
    assert all(torch.equal(a, b) for a, b in zip(before, first.params)) and first.backward_passes == 0
    assert hidden.dtype == torch.float32
