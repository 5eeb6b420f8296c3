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
- when every slot of the version is taken, the microbatches that want one wait (served by their callers' recent
  shares of slots, the smallest first, so a trainer with a large window cannot crowd out one with a small)
  until the version's gradients are all applied: the stage's worker then steps (it steps by count, and exactly
  `microbatches_per_step` gradients were applied), and the next version opens;
- so every gradient a stage applies was computed at the weights it is applied to: the version distance is 0 at
  every stage, however many microbatches are in flight, and the loss at equal samples is that of one in flight.

The price is a bubble per step at each stage (the round trip of its last microbatches); more microbatches per
step amortise it (swarm/pipeline_schedule.py computes it). Stages need no agreement: a stage's open slots wait
only on later stages' forwards and earlier stages' backwards, never on a step elsewhere, and the last stage gives
its slots back at once (its forward and backward run together), so nothing can wait in a cycle.

A slot taken by a forward whose backward never comes (its trainer died) is given up at the slot's expiry, and
`on_expire` is told, so that the stage drops the forward's activations (a backward that comes later then
recomputes at the current weights instead of applying a stale gradient). A slot held far longer than slots
usually are (STRAGGLER_FACTOR times the typical hold, and at least MIN_STRAGGLER_S) is given up the same way, but
only while another microbatch waits for one: a microbatch stuck behind a stalled or dead later peer would
otherwise hold the whole step until its timeout, while the other microbatches could go around that peer. A slot
whose gradient is being applied (`pin`: its work is in the worker) is never given up, so the worker's count of
applied gradients and the gate's always agree. An averaging round is applied between two versions
(`between_steps`), so it does not move weights under microbatches in flight either.

Event loop only: one gate per served stage, touched by its handlers.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

Key = tuple[str, str]  # (caller, microbatch id), as the stage caches forwards

STRAGGLER_FACTOR = 4.0  # a slot held this many times the typical hold is given to a waiting microbatch
MIN_STRAGGLER_S = 1.0  # ... and never sooner than this
HOLD_SMOOTHING = 0.1  # weight of the newest applied slot's hold time in the typical hold
SHARE_DECAY = 0.95  # per slot handed out: a caller's share of slots counts about the last 20


class StepGate:
    def __init__(self, slots: int, on_expire: Callable[[list[Key]], None] | None = None):
        if slots < 1:
            raise ValueError("a step needs at least one slot")
        self.slots = slots
        self.on_expire = on_expire
        self.version = 0  # optimizer steps this gate has let happen
        self.applied = 0  # gradients applied in this version
        self.open: dict[Key, float] = {}  # slots taken whose gradient is not applied yet -> when they expire
        self.waited = 0  # microbatches that waited for a slot, in all (how often the gate held one back)
        self.expired = 0  # slots given up because their gradient did not come in time (expiry or straggler)
        self.stragglers = 0  # ... of them, given up early to a waiting microbatch
        self.taken_at: dict[Key, float] = {}
        self.pinned: set[Key] = set()  # slots whose gradient is being applied: never given up
        self.typical_hold: float | None = None  # smoothed seconds from take to an applied release
        self._closed = 0  # between_steps holds taken: no slot is handed out
        self._queue: dict[int, str] = {}  # waiting microbatches: ticket (arrival order) -> caller
        self._tickets = itertools.count()
        self._shares: dict[str, float] = {}  # slots each caller got recently (decaying)
        self._changed = asyncio.Condition()

    @property
    def taken(self) -> int:
        return self.applied + len(self.open)

    def can_take(self) -> bool:
        return self._closed == 0 and self.taken < self.slots

    async def take(self, key: Key, expires: float, wait_until: float, pinned: bool = False) -> bool:
        """A slot of the current version for `key` (given up by itself at `expires`, time.monotonic()); waits for
        one until `wait_until` and returns False if none came by then. A key holds at most one slot. `pinned`: the
        work that applies the gradient starts at once (see `pin`). Waiting microbatches are served by their
        callers' recent shares of slots, the smallest first (then in arrival order)."""
        if key in self.open:
            if pinned:
                self.pinned.add(key)
            return True
        async with self._changed:
            if not (self.can_take() and not self._queue):
                ticket = next(self._tickets)
                self._queue[ticket] = key[0]
                self.waited += 1
                try:
                    while True:
                        now = time.monotonic()
                        self._expire(now)
                        if self.can_take() and self._turn() == ticket:
                            break
                        if now >= wait_until:
                            return False
                        wake = min(wait_until, self._next_give_up())
                        try:
                            await asyncio.wait_for(self._changed.wait(), timeout=max(wake - now, 0.001))
                        except TimeoutError:
                            pass
                finally:
                    del self._queue[ticket]
                    self._changed.notify_all()  # the next in turn may go (or a slot is still free)
            self.open[key] = expires
            self.taken_at[key] = time.monotonic()
            if pinned:
                self.pinned.add(key)
            self._count_share(key[0])
            return True

    @property
    def waiting(self) -> int:
        """Microbatches waiting for a slot now."""
        return len(self._queue)

    def _turn(self) -> int | None:
        """The waiting ticket whose turn it is: of the caller with the smallest recent share, the earliest."""
        return min(self._queue, key=lambda t: (self._shares.get(self._queue[t], 0.0), t), default=None)

    def _count_share(self, caller: str) -> None:
        """One more slot for `caller`: every caller's share decays by SHARE_DECAY per slot handed out."""
        for other in list(self._shares):
            self._shares[other] *= SHARE_DECAY
            if self._shares[other] < 0.01:
                del self._shares[other]
        self._shares[caller] = self._shares.get(caller, 0.0) + 1.0

    def pin(self, key: Key) -> bool:
        """The work that applies `key`'s gradient starts now: its slot is never given up from here on. False if
        the slot was given up already (its gradient must not be applied: the step may have gone on without it)."""
        if key not in self.open:
            return False
        self.pinned.add(key)
        return True

    async def release(self, key: Key, applied: bool) -> None:
        """`key`'s gradient was applied here (True: it counts towards the step) or it will not be (False: its slot
        is free again for another microbatch). Unknown keys (an expired slot) are ignored."""
        if self.open.pop(key, None) is None:
            return
        self.pinned.discard(key)
        taken_at = self.taken_at.pop(key)
        if applied:
            hold = time.monotonic() - taken_at
            last = self.typical_hold
            self.typical_hold = hold if last is None else last + HOLD_SMOOTHING * (hold - last)
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
                    wake = min(deadline, self._next_give_up())
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=max(wake - time.monotonic(), 0.001))
                    except TimeoutError:
                        pass
            yield not self.open
        finally:
            self._closed -= 1
            async with self._changed:
                self._changed.notify_all()

    def _straggler_after(self) -> float | None:
        """Seconds after which a held slot is a straggler while others wait (None: no slot was applied yet)."""
        if self.typical_hold is None:
            return None
        return max(STRAGGLER_FACTOR * self.typical_hold, MIN_STRAGGLER_S)

    def _give_up_at(self, key: Key) -> float:
        """When `key`'s slot is given up if it is still held (inf: pinned)."""
        if key in self.pinned:
            return float("inf")
        after = self._straggler_after()
        if self.waiting == 0 or after is None:
            return self.open[key]
        return min(self.open[key], self.taken_at[key] + after)

    def _next_give_up(self) -> float:
        return min((self._give_up_at(key) for key in self.open), default=float("inf"))

    def _expire(self, now: float) -> None:
        """Give up the slots past their expiry, and stragglers while a microbatch waits (with the condition
        held)."""
        gone = [key for key in self.open if self._give_up_at(key) <= now]
        for key in gone:
            if self.open[key] > now:
                self.stragglers += 1
            del self.open[key]
            del self.taken_at[key]
        if gone:
            self.expired += len(gone)
            if self.on_expire is not None:
                self.on_expire(gone)
