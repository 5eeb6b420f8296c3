"""Stale gradients: a stage whose gradients come back late steps with a smaller learning rate, by measurement.

A microbatch's forward at a stage and the optimizer step that applies its gradient there are apart by the time
the rest of the pipeline takes to answer; with several microbatches in flight the stage takes optimizer steps
meanwhile, so the activations it sent on and the gradient it gets back belong to weights some steps old. With
AdamW at the demo's learning rate even half a step of delay costs a lot (docs/BENCHMARKS.md, "Stale gradients":
train loss 2.86 with 2 microbatches in flight against 2.50 with 1, on two stages): delay shrinks the range of
learning rates that train stably, as the staleness-aware asynchronous SGD of Zhang et al. (2016) accounts for by
dividing the learning rate by the staleness.

So each stage measures its delay (each backward reports how many optimizer steps passed since its forward; an
EMA) and steps with `learning_rate / (1 + FACTOR x delay)`. The last stage, whose backward follows its forward at
once, has no delay and keeps the full rate; stage 0, the stalest, gets the smallest. Weight prediction
(extrapolating the weights by delay x the recent update, as PipeMare and SpecTrain do) and DC-ASGD's delay
compensation were measured too and did not help (docs/PIPELINE.md, "The step gate: a full pipe without stale
penalty"). `StalenessControl` belongs to a StageCompute and is touched by its worker thread only.
"""

from __future__ import annotations

import torch

FACTOR = (
    4.0  # measured: 1 / (1 + 4 x 1.47) brought 4-in-flight from 2.89 to 2.67 (1 in flight: 2.51; docs/BENCHMARKS.md)
)
DELAY_EMA = 0.1
MAX_DELAY = 64.0  # steps


class StalenessControl:
    def __init__(self, optimizer: torch.optim.Optimizer, enabled: bool = True):
        self.optimizer, self.enabled = optimizer, enabled
        self.base_rates = [group["lr"] for group in optimizer.param_groups]
        self.delay = 0.0  # EMA of optimizer steps between a microbatch's forward and its backward here

    def observed_delay(self, steps: int) -> None:
        """A backward ran `steps` optimizer steps after its forward."""
        self.delay += DELAY_EMA * (min(max(steps, 0), MAX_DELAY) - self.delay)

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 + FACTOR * self.delay) if self.enabled else 1.0

    def before_step(self) -> None:
        """Set the learning rate for the coming step from the delay measured so far."""
        for group, base in zip(self.optimizer.param_groups, self.base_rates):
            group["lr"] = base * self.scale
