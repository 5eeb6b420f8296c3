"""Loss scaling for float16 stages: one scaler per stage, and true (unscaled) gradients on the wire.

float16's small range makes small gradients underflow to zero. A float16 stage therefore multiplies what it
backpropagates (the loss on the last stage, the gradient of its outputs on the others) by a scale, computes its
gradients, and divides them by the same scale before they touch the accumulators or go back to the previous
stage. Each stage keeps its own scale, like torch.amp.GradScaler's dynamic one: halved at an overflow (that
microbatch is not applied), doubled after `growth_interval` clean backward passes. bfloat16 and float32 need
none (scale 1, never changes).
"""

from __future__ import annotations


class LossScaler:
    """The loss scale of one stage; an overflow is raised by its user as swarm.errors.GradientOverflowError."""

    def __init__(
        self, enabled: bool, initial: float = 2.0**16, growth_interval: int = 2000, minimum: float = 1.0
    ) -> None:
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.growth_interval = growth_interval
        self.minimum = minimum
        self.overflows = 0
        self._clean = 0

    def overflowed(self) -> None:
        """A backward pass produced Inf or NaN with this scale: halve it (never below `minimum`)."""
        self.overflows += 1
        self._clean = 0
        self.scale = max(self.minimum, self.scale / 2)

    def succeeded(self) -> None:
        if not self.enabled:
            return
        self._clean += 1
        if self._clean >= self.growth_interval:
            self._clean = 0
            self.scale = min(self.scale * 2, 2.0**24)
