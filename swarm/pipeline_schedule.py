"""How long a synchronous pipeline step takes over home links: an event-by-event schedule (pure functions, no I/O).

One step pushes `microbatches` through `len(forward)` stages and back, then every stage applies its update (a
flush per step, as in GPipe and in the Protocol NanoGPT speedrun). Each stage is one GPU that computes one task at
a time, whichever is ready first (a ready backward before a ready forward: the 1F1B preference that frees memory),
and one home link whose uplink sends, in order, its activations to the next stage and its input gradients to the
previous one at `bits_per_second`; every message then arrives `delay` seconds later (one way, per boundary).
Downlinks are not the bottleneck of a home link and are not modelled.

benchmarks/protocol_nanogpt.py uses it where running the real swarm would take hours per step (at the speedrun's
GPU-equivalent links an 8-bit step takes minutes on this machine). Its link is the one of
swarm/local/emulated_links.py (a rate and a one-way delay), without the sockets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    forward: float  # seconds to compute one microbatch's forward
    backward: float  # seconds for its backward
    forward_bytes: int  # what its uplink sends forward per microbatch (0 on the last stage)
    backward_bytes: int  # what it sends back per microbatch (0 on the first stage)


def step_seconds(stages: list[StageCosts], microbatches: int, bits_per_second: float | None, delay: float) -> float:
    """Seconds from the first forward of a step to the last backward of stage 0 (bits_per_second None:
    unlimited). Pure list scheduling: the task that can start earliest anywhere runs next."""
    if not stages or microbatches < 1:
        raise ValueError("a step needs at least one stage and one microbatch")
    count = len(stages)
    ready: dict[tuple[str, int, int], float] = {("forward", 0, m): 0.0 for m in range(microbatches)}
    busy_until = [0.0] * count
    uplink_free = [0.0] * count
    finished = 0.0
    while ready:
        # the task that can start first; at equal times a backward first, then the lower microbatch
        key = min(ready, key=lambda k: (max(ready[k], busy_until[k[1]]), k[0] != "backward", k[2]))
        kind, stage, micro = key
        start = max(ready.pop(key), busy_until[stage])
        cost = stages[stage]
        end = start + (cost.forward if kind == "forward" else cost.backward)
        busy_until[stage] = end
        if kind == "forward" and stage == count - 1:
            ready[("backward", stage, micro)] = end  # the loss is here: its backward may start at once
        elif kind == "forward":
            ready[("forward", stage + 1, micro)] = _send(
                uplink_free, stage, end, cost.forward_bytes, bits_per_second, delay
            )
        elif stage > 0:
            ready[("backward", stage - 1, micro)] = _send(
                uplink_free, stage, end, cost.backward_bytes, bits_per_second, delay
            )
        else:
            finished = max(finished, end)
    return finished


def _send(uplink_free: list[float], stage: int, ready_at: float, size: int, bits: float | None, delay: float) -> float:
    """When a message of `size` bytes that `stage` may send from `ready_at` arrives at its neighbour."""
    start = max(ready_at, uplink_free[stage])
    uplink_free[stage] = start + (size * 8 / bits if bits else 0.0)
    return uplink_free[stage] + delay
