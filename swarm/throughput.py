"""Measure how fast a peer can serve its stage.

For now one simple figure: samples per second of forward + backward of the stage on its device, timed after
a warm-up pass. (A later issue adds network throughput and an on-disk cache.)
"""

from __future__ import annotations

import time

import torch

from swarm.manifest import Manifest
from swarm.model import StageModel


def measure_compute_throughput(
    model: StageModel, manifest: Manifest, device: torch.device, repetitions: int = 2
) -> float:
    """Samples per second of forward+backward of one microbatch, on a copy of the inputs (weights untouched)."""
    config, batch = manifest.model, manifest.training.microbatch_size
    length = config.context_length
    if model.first:
        inputs = torch.randint(0, config.vocab_size, (batch, length), device=device)
    else:
        inputs = torch.randn(batch, length, config.width, device=device, requires_grad=True)
    params = [p for p in model.parameters() if p.requires_grad]

    def once() -> None:
        out = model(inputs)
        torch.autograd.grad(out.float().square().mean(), params)  # grads are returned, never accumulated

    once()  # warm-up
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repetitions):
        once()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    return batch * repetitions / max(elapsed, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
