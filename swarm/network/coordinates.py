"""Network coordinates (Vivaldi): the latency between two peers that have never talked, without a coordinator.

Each peer keeps a position in a small Euclidean space plus a height (the latency of its own access link, which
every path to it pays), so that the distance between two positions approximates the round-trip time between the
peers. A peer measures round trips to a few others (swarm/client/pinger.py pings them) and moves its
position towards agreement with what it measured, weighted by how sure it and the other are (their errors). It
announces its position; anyone can then estimate the round trip between any two announced peers. This is
Vivaldi (Dabek et al., SIGCOMM 2004) with height vectors, as Serf and Consul use it. Pure logic, no I/O.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from swarm.errors import MalformedDataError

DIMENSIONS = 2
CE = 0.25  # how fast the error estimate follows new samples
CC = 0.25  # how far one sample moves the position
MIN_HEIGHT = 1e-5  # seconds
MAX_ERROR = 1.5
MAX_RTT = 10.0  # seconds; a longer "round trip" is a stall, not a distance
MAX_COORDINATE = 100.0  # seconds; bounds what a record may claim


@dataclass(frozen=True)
class Coordinate:
    vector: tuple[float, ...] = (0.0,) * DIMENSIONS
    height: float = MIN_HEIGHT
    error: float = MAX_ERROR  # relative error of its estimates (1.5: knows nothing yet)

    def to_record(self) -> list[float]:
        return [round(v, 6) for v in (*self.vector, self.height, self.error)]

    @classmethod
    def from_record(cls, value: object) -> Coordinate:
        """From an announcement; raises MalformedDataError unless it is DIMENSIONS + 2 finite, bounded numbers."""
        if not isinstance(value, (list, tuple)) or len(value) != DIMENSIONS + 2:
            raise MalformedDataError("a coordinate is a list of position, height and error")
        numbers = [float(v) for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) != len(value) or not all(math.isfinite(v) for v in numbers):
            raise MalformedDataError("a coordinate holds finite numbers")
        *vector, height, error = numbers
        if any(abs(v) > MAX_COORDINATE for v in vector) or not 0 <= height <= MAX_COORDINATE:
            raise MalformedDataError("a coordinate out of bounds")
        if not 0 <= error <= MAX_ERROR:
            raise MalformedDataError("a coordinate's error is out of bounds")
        return cls(tuple(vector), max(height, MIN_HEIGHT), error)

    @property
    def known(self) -> bool:
        """Whether it has learnt anything yet (a fresh coordinate says nothing about where a peer is)."""
        return self.error < MAX_ERROR


def round_trip(a: Coordinate, b: Coordinate) -> float:
    """The estimated round trip between the peers at `a` and `b`, in seconds."""
    return math.dist(a.vector, b.vector) + a.height + b.height


class Vivaldi:
    """One peer's position, refined by each round trip it measures."""

    def __init__(self, rng: random.Random | None = None):
        self.coordinate = Coordinate()
        self.rng = rng or random.Random()
        self.samples = 0

    def observe(self, remote: Coordinate, rtt: float) -> None:
        """A measured round trip of `rtt` seconds to the peer that announces `remote`."""
        if not 0 < rtt <= MAX_RTT:
            return
        local = self.coordinate
        estimate = round_trip(local, remote)
        weight = local.error / (local.error + remote.error) if local.error + remote.error > 0 else 0.5
        sample_error = abs(estimate - rtt) / rtt
        error = min(sample_error * CE * weight + local.error * (1 - CE * weight), MAX_ERROR)
        delta = CC * weight * (rtt - estimate)  # > 0: too close, move away
        direction, distance = _unit(local.vector, remote.vector, self.rng)
        vector = tuple(v + delta * d for v, d in zip(local.vector, direction))
        height = local.height
        if distance > 1e-9:  # as Serf does it: the height takes its share of the force
            height = max(local.height + (local.height + remote.height) * delta / distance, MIN_HEIGHT)
        vector = tuple(max(-MAX_COORDINATE, min(MAX_COORDINATE, v)) for v in vector)
        self.coordinate = Coordinate(vector, min(height, MAX_COORDINATE), error)
        self.samples += 1


def _unit(a: tuple[float, ...], b: tuple[float, ...], rng: random.Random) -> tuple[tuple[float, ...], float]:
    """The unit vector from b towards a, and their distance; a random direction when they coincide."""
    diff = [x - y for x, y in zip(a, b)]
    length = math.hypot(*diff)
    if length < 1e-9:
        diff = [rng.uniform(-1, 1) for _ in a]
        norm = math.hypot(*diff) or 1.0
        return tuple(d / norm for d in diff), 0.0
    return tuple(d / length for d in diff), length
