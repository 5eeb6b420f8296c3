"""Many microbatches in flight through a stage at the loss of one: a stage steps only when the microbatches whose
forward it ran on the current weights have all brought their gradients back (a flush per optimizer step).

With several microbatches in flight a stage that steps by count (every `microbatches_per_step` gradients) takes
steps between a microbatch's forward and its backward: the gradient it applies was computed at weights some steps
old, and that costs loss that grows with the horizon (+16% at 8k samples with 4 in flight, even with a learning
rate scaled by the delay; docs/BENCHMARKS.md, "Stale gradients"). The gate removes the delay instead of
compensating it, as GPipe, PipeDream-flush and 1F1B-flush do, but per peer and without a coordinator:

- each optimizer step (a *version* of the weights) has `microbatches_per_step` slots; a microbatch takes one at
  this stage before the work that will produce its gradient here (a training forward, or a backward that
  recomputes forward from its inputs), and gives it back when its gradient is applied (or not: a failure);
- when every slot of the version is taken, the microbatches that want one wait (in arrival order, so trainers
  are served in turn) until the version's gradients are all applied: the stage's worker then steps (it steps by
  count, and exactly `microbatches_per_step` gradients were applied), and the next version opens;
- so every gradient a stage applies was computed at the weights it is applied to: the version distance is 0 at
  every stage, however many microbatches are in flight, and the loss at equal samples is that of one in flight.

The price is a bubble per step at each stage (the round trip of its last microbatches); more microbatches per
step amortise it (swarm/pipeline_schedule.py computes it). Stages need no agreement: a stage's open slots wait
only on later stages' forwards and earlier stages' backwards, never on a step elsewhere, and the last stage gives
its slots back at once (its forward and backward run together), so nothing can wait in a cycle.

A slot taken by a forward whose backward never comes (its trainer died) is given up at the slot's expiry, and
`on_expire` is told, so that the stage drops the forward's activations (a backward that comes later then
recomputes at the current weights instead of applying a stale gradient). An averaging round is applied between
two versions (`between_steps`), so it does not move weights under microbatches in flight either.

Event loop only: one gate per served stage, touched by its handlers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

Key = tuple[str, str]  # (caller, microbatch id), as the stage caches forwards


class StepGate:
    def __init__(self, slots: int, on_expire: Callable[[list[Key]], None] | None = None):
        if slots < 1:
            raise ValueError("a step needs at least one slot")
        self.slots = slots
        self.on_expire = on_expire
        self.version = 0  # optimizer steps this gate has let happen
        self.applied = 0  # gradients applied in this version
        self.open: dict[Key, float] = {}  # slots taken whose gradient is not applied yet -> when they expire
        self.waiting = 0  # microbatches waiting for a slot now
        self.waited = 0  # ... and in all (how often the gate held one back)
        self.expired = 0  # slots given up because their backward did not come in time
        self._closed = 0  # between_steps holds taken: no slot is handed out
        self._changed = asyncio.Condition()

    @property
    def taken(self) -> int:
        return self.applied + len(self.open)

    def can_take(self) -> bool:
        return self._closed == 0 and self.taken < self.slots

    async def take(self, key: Key, expires: float, wait_until: float) -> bool:
        """A slot of the current version for `key` (given up by itself at `expires`, time.monotonic()); waits for
        one until `wait_until` and returns False if none came by then. A key holds at most one slot."""
        if key in self.open:
            return True
        async with self._changed:
            if not self.can_take():
                self.waiting += 1
                self.waited += 1
                try:
                    while not self.can_take():
                        now = time.monotonic()
                        if now >= wait_until:
                            return False
                        self._expire(now)
                        if self.can_take():
                            break
                        wake = min([wait_until, *self.open.values()])
                        try:
                            await asyncio.wait_for(self._changed.wait(), timeout=max(wake - now, 0.001))
                        except TimeoutError:
                            pass
                finally:
                    self.waiting -= 1
            self.open[key] = expires
            return True

    async def release(self, key: Key, applied: bool) -> None:
        """`key`'s gradient was applied here (True: it counts towards the step) or it will not be (False: its slot
        is free again for another microbatch). Unknown keys (an expired slot) are ignored."""
        if self.open.pop(key, None) is None:
            return
        if applied:
            self.applied += 1
            if self.applied >= self.slots:  # the worker stepped with this gradient: a new version opens
                self.version += 1
                self.applied = 0
        async with self._changed:
            self._changed.notify_all()

    @asynccontextmanager
    async def between_steps(self, timeout: float) -> AsyncIterator[bool]:
        """Hand out no slot, wait (up to `timeout`) for the slots taken to be applied or given back, and yield
        whether that happened: what runs inside then changes the weights between two versions (an averaging
        round). Slots of the version applied so far stay applied (their gradients wait in the accumulators)."""
        self._closed += 1
        try:
            deadline = time.monotonic() + timeout
            async with self._changed:
                while self.open and time.monotonic() < deadline:
                    self._expire(time.monotonic())
                    wake = min([deadline, *self.open.values()]) if self.open else deadline
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=max(wake - time.monotonic(), 0.001))
                    except TimeoutError:
                        pass
            yield not self.open
        finally:
            self._closed -= 1
            async with self._changed:
                self._changed.notify_all()

    def _expire(self, now: float) -> None:
        """Give up slots whose backward did not come before their expiry (called with the condition held)."""
        gone = [key for key, expires in self.open.items() if expires <= now]
        for key in gone:
            del self.open[key]
        if gone:
            self.expired += len(gone)
            if self.on_expire is not None:
                self.on_expire(gone)
