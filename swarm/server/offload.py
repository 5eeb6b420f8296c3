"""--offload-optimizer: the optimizer's statistics (AdamW's two moments: 8 bytes a parameter, as much as the
weights and gradients together in float32) live in RAM between steps, so that a small GPU holds more blocks.

During a step they pass through the GPU one parameter at a time: that parameter's statistics are copied in, the
optimizer steps it alone, and they go back to RAM (pinned, so the copies run at the bus's speed). The GPU holds
the statistics of one parameter at most (the largest: the embeddings on the first stage), and the step is the
optimizer's own code on the GPU, so the numbers are those of a step without offloading. What it costs: each
step moves 16 bytes a parameter over PCIe (8 in, 8 out; ~0.1 s a 100M parameters at 16 GB/s), in every
optimizer step, whatever the microbatches per step (docs/BALANCING.md, "Spans and memory").

Other readers of the statistics (state downloads, averaging, checkpoints) find them in `optimizer.state[p]`, as
always: on the CPU, where they read them anyway. A state loaded onto the GPU goes back to RAM at `offload`.
"""

from __future__ import annotations

import torch


class OffloadedStatistics:
    """Steps `optimizer` one parameter at a time with its statistics brought to `device` for the step only."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, device
        self.pinned = device.type == "cuda"  # page-locked RAM: asynchronous copies at full speed
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # each statistic's place in RAM, by (parameter, key)

    def step(self) -> None:
        """One optimizer step of every parameter with a gradient, parameter by parameter."""
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = []
            for group, params in zip(groups, saved):
                for p in params:
                    if p.grad is None:
                        continue
                    group["params"] = [p]  # the only parameter this step sees
                    self._move(p, self.device)
                    self.optimizer.step()
                    self._move(p, torch.device("cpu"))
                group["params"] = []
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
            if self.pinned:
                torch.cuda.synchronize(self.device)  # the statistics in RAM are whole before anyone reads them

    def offload(self) -> None:
        """Every parameter's statistics to RAM (after a state was loaded onto the device)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self._move(p, torch.device("cpu"))
        if self.pinned:
            torch.cuda.synchronize(self.device)

    def device_bytes(self) -> int:
        """Bytes of statistics on the device now (0 between steps)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.device.type != "cpu"
        )

    def _move(self, p: torch.Tensor, device: torch.device) -> None:
        state = self.optimizer.state.get(p)
        if not state:
            return
        for key, value in state.items():
            # AdamW keeps its step count as a CPU scalar: it stays
            if not isinstance(value, torch.Tensor) or key == "step" or value.device == device:
                continue
            if device.type != "cpu":
                state[key] = value.to(device, non_blocking=True)
                continue
            host = self._host.get((id(p), key))
            if host is None or host.shape != value.shape or host.dtype != value.dtype:
                # page-locked RAM, allocated once (allocating it is slow): copies from it run asynchronously
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=self.pinned)
                self._host[(id(p), key)] = host
            host.copy_(value, non_blocking=self.pinned)  # stream-ordered: the device copy is freed after it
            state[key] = host
