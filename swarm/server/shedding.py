"""Out of memory while serving (issue 32): which errors are one, and what a stage sheds when it gets one.

A peer's memory is measured once, at start (swarm/capacity/), and the stage keeps the activations of as many
microbatches as that arithmetic says fit. The arithmetic is an estimate, and the machine is shared: another
program, a fragmented allocator or a larger transient than foreseen can still make an allocation fail while a
request is served. That must not kill the peer, nor leave it failing every request as before. So the request
that ran out is answered `busy` (the hop before tries another peer of the stage, or later), and the stage sheds:

1. **A smaller window.** It halves the number of microbatches whose activations it keeps, down to MIN_KEPT, and
   drops the oldest kept ones beyond it at once: their backward recomputes forward from the inputs sent along
   (swarm/server/compute.py), which costs compute, never correctness.
2. **A shorter span.** Once the window is at its smallest, FLOOR_REPEATS out-of-memory errors within
   FLOOR_SECONDS say that the activations are not what is too large: a peer serving several stages drops the last
   of them (server/rebalancer.py, `Rebalancer.shorten_span`).
3. **Busy.** A peer serving one stage has nothing more to shed: it keeps answering the requests that run out
   `busy`, and serves those that fit.

The rules are pure functions of the stage's figures, below; server/request_path.py applies them in the stage's
worker thread (so the next request already runs with the smaller window) and server/stage.py reports each
out-of-memory error as an event (swarm/events.py, `out_of_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

MIN_KEPT = 1  # the smallest window: as capacity/costs.py's `kept_microbatches`, one microbatch's activations
FLOOR_REPEATS = 3  # out-of-memory errors at the smallest window ...
FLOOR_SECONDS = 60.0  # ... within this many seconds: the stage itself is too much for the peer's memory now
# What allocators put in the RuntimeError they raise when memory runs out: torch's CPU allocator ("[enforce fail at
# alloc_cpu.cpp] ... DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes"), cuBLAS's
# workspace, and the "... out of memory" of the CUDA, HIP and MPS backends of a torch that raises no
# torch.OutOfMemoryError for them
MEMORY_MARKERS = ("can't allocate memory", "DefaultCPUAllocator", "CUBLAS_STATUS_ALLOC_FAILED", "out of memory")


class ShedAction(StrEnum):
    """What a stage did about one out-of-memory error (an `out_of_memory` event's `action`)."""

    SMALLER_WINDOW = "smaller_window"  # halved the microbatches whose activations it keeps
    SHORTER_SPAN = "shorter_span"  # asked its rebalancer to drop the last stage of its span
    BUSY = "busy"  # nothing left to shed for now: it answers the requests that run out `busy`


@dataclass(frozen=True)
class Shedding:
    """The decision on one out-of-memory error, and the figures the stage keeps for the next one."""

    action: ShedAction
    kept: int  # microbatches whose activations the stage keeps from now on
    floor_times: tuple[float, ...]  # recent out-of-memory errors at the smallest window (time.monotonic())


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, says that an allocation failed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError) and any(marker in str(current) for marker in MEMORY_MARKERS):
            return True
        current = current.__cause__
    return False


def shed(kept: int, floor_times: tuple[float, ...], now: float, can_shorten: bool) -> Shedding:
    """What a stage that keeps `kept` microbatches' activations does about an out-of-memory error at `now`
    (seconds, time.monotonic()), given the `floor_times` of the last Shedding and whether its peer can drop a stage
    (it serves more than one, and no shortening is under way)."""
    if kept > MIN_KEPT:
        return Shedding(ShedAction.SMALLER_WINDOW, max(MIN_KEPT, kept // 2), ())
    recent = tuple(moment for moment in floor_times if now - moment < FLOOR_SECONDS) + (now,)
    if len(recent) >= FLOOR_REPEATS and can_shorten:
        return Shedding(ShedAction.SHORTER_SPAN, MIN_KEPT, ())  # the repeats count afresh on the shorter span
    return Shedding(ShedAction.BUSY, MIN_KEPT, recent[-FLOOR_REPEATS:])


def describe(error: BaseException) -> str:
    """One short line for a reply, a log line and an event: the allocator's messages run to several lines."""
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text}"[:300]
