"""A paused stage's tensors parked in RAM: its device's memory goes back to the owner, and its state stays whole.

A volunteer pauses a peer to use the GPU (a game, a render): the stage's weights and the optimizer's statistics
move to the CPU (`park`), the activations kept for backward passes are dropped (nothing is in flight after the
drain; a backward that still came would recompute its forward), and the CUDA cache is emptied, so the memory is free
for another process. `unpark` moves back exactly what `park` moved (statistics that --offload-optimizer keeps in
RAM stay there). Both run in the stage's worker thread (server/worker.py), between two requests. On a CPU there is
nothing to move: the state is in RAM already.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.server.compute import StageCompute


@dataclass
class Parked:
    """What `park` moved: bytes, and the optimizer statistics to move back (state dict, key)."""

    bytes_moved: int = 0
    statistics: list[tuple[dict, str]] = field(default_factory=list)


def park(compute: StageCompute) -> Parked:
    """Move the stage's tensors that are on its device to the CPU, and give the device's cache back."""
    parked = Parked()
    compute.drop_device_copies()  # kept activations (recomputed if a backward still came) and the weights' stash
    if compute.device.type == "cpu":
        return parked
    for tensor in [*compute.model.parameters(), *compute.model.buffers()]:
        if tensor.device.type != "cpu":
            parked.bytes_moved += tensor.numel() * tensor.element_size()
    compute.model.to("cpu")  # in place: the optimizer's parameters are the same objects
    for state in compute.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                parked.bytes_moved += value.numel() * value.element_size()
                state[key] = value.cpu()
                parked.statistics.append((state, key))
    if compute.device.type == "cuda":
        torch.cuda.synchronize(compute.device)
        torch.cuda.empty_cache()
    return parked


def unpark(compute: StageCompute, parked: Parked) -> None:
    """Move back to the device what `park` moved."""
    if compute.device.type == "cpu":
        return
    compute.model.to(compute.device)
    for state, key in parked.statistics:
        state[key] = state[key].to(compute.device)
