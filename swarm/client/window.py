"""How many microbatches a trainer keeps in flight: enough to fill its route's pipe, no more (pure logic).

A route over internet links takes far longer per microbatch (its round trip) than any stage takes to compute
one, so one microbatch in flight leaves every link and stage idle most of the time; too many only queue at the
slowest stage, where they wait and make gradients staler. The window follows TCP Vegas (Brakmo and Peterson,
1995): with the smallest round trip seen recently as the base (the pipe without queues) and the recent round trip
(with queues), `window x (1 - base / recent)` is the number of this trainer's microbatches waiting in queues
somewhere on the route. Once per window of completions the window grows by one while fewer than ALPHA per stage
of the route wait, and shrinks by one when more than BETA per stage do: unlike TCP's one bottleneck, a route has a
queue at every stage and link in series, and each needs work waiting to stay busy (behind 20 Mbit/s links, 3
stages: 1–2 in all kept 3 in flight and 38 samples/s, 1–2 per stage 6 and 44, a fixed 16 51; docs/BENCHMARKS.md).
Several trainers that share stages each keep their share queued, so together they fill the pipe without flooding
it. The window stays within [1, maximum]. Like Vegas it starts slowly but not linearly: until the first sign of
queueing (a busy stage, or a lost microbatch) it doubles once per window of completions, so a GPU preset's limit
of 128 (two steps of 64 microbatches) is reached after about 128 completions instead of about 8,000.
"""

from __future__ import annotations

import collections

ALPHA = 1.0  # microbatches queued per stage of the route below which the window grows
BETA = 2.0  # ... above which it shrinks
BASE_WINDOW_SECONDS = 30.0  # the base round trip is the smallest of this long (routes and loads change)
EMA_WEIGHT = 0.25


class AdaptiveWindow:
    def __init__(self, maximum: int, adaptive: bool = True, stages: int = 1):
        self.maximum = max(int(maximum), 1)
        self.stages = max(int(stages), 1)  # on the route: queues in series
        self.adaptive = adaptive
        self.size = 1 if adaptive else self.maximum
        self.recent: float | None = None  # EMA of round trips
        self._base: collections.deque[tuple[float, float]] = collections.deque()  # (time, round trip)
        self._since_change = 0
        self.slow_start = adaptive  # doubling until something queues

    @property
    def base(self) -> float | None:
        return min(rtt for _, rtt in self._base) if self._base else None

    def queued(self) -> float:
        """This trainer's microbatches waiting in queues on the route, by the Vegas estimate."""
        base, recent = self.base, self.recent
        if base is None or recent is None or recent <= 0:
            return 0.0
        return self.size * max(1.0 - base / recent, 0.0)

    def observe(self, round_trip: float, now: float) -> None:
        """A microbatch came back after `round_trip` seconds."""
        if not self.adaptive or round_trip <= 0:
            return
        self.recent = round_trip if self.recent is None else self.recent + EMA_WEIGHT * (round_trip - self.recent)
        self._base.append((now, round_trip))
        while self._base and now - self._base[0][0] > BASE_WINDOW_SECONDS:
            self._base.popleft()
        self._since_change += 1
        if self._since_change < self.size:  # once per window of completions: let the last change show
            return
        self._since_change = 0
        queued = self.queued()
        if queued < ALPHA * self.stages and self.size < self.maximum:
            self.size = min(self.size * 2 if self.slow_start else self.size + 1, self.maximum)
        elif queued >= ALPHA * self.stages:
            self.slow_start = False
            if queued > BETA * self.stages and self.size > 1:
                self.size -= 1

    def busy(self) -> None:
        """A stage answered busy (its queue or its step is full): one fewer in flight, and no more doubling."""
        if self.adaptive:
            self.size = max(self.size - 1, 1)
            self.slow_start = False

    def failed(self) -> None:
        """A microbatch was lost: back off (a failing route is no place to push more)."""
        if self.adaptive:
            self.size = max(self.size // 2, 1)
            self._since_change = 0
            self.slow_start = False
