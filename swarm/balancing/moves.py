"""Which stage each peer serves: pure functions over announced records (no I/O).

`peer_loads` turns announcements into loads, `choose_stage` is a joining peer's choice, `should_move` an online
peer's check (through `plan_moves`, the greedy plan it simulates), `worthwhile_moves` that answer for every peer
at once (for simulations and status pages), and `apply_moves` the records as they would be after some moves. How
far an assignment is from the best one is swarm/balancing/optimum.py's. The rules, and why a plan rather than a
single move: docs/BALANCING.md, "Which stage a peer serves".

What the I/O around these relies on: every peer computes the same plan from the same records (records are put
in peer-id order first and ties go to the lowest peer id), every step of a plan strictly raises the sorted
vector of stage totals (so plans end and cannot cycle), and a plan never takes a stage's last online peer nor
moves a joining or pinned one. With min_holders, a plan first gives thin stages more holders (each such step
lowers the stages' holder deficit, and no step of either kind raises it).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.dht.records import Announcement, PeerState
from swarm.errors import BalancingError


@dataclass(frozen=True)
class PeerLoad:
    """One peer as the balancing sees it, built from its announcement."""

    peer_id: str
    stage: int
    throughput: float  # samples/s it can serve (measured, announced); >= 0
    online: bool = True  # False = still joining: counts toward its stage's total, but cannot move
    movable: bool = True  # False = pinned to its stage by the user (--stage)

    def __post_init__(self) -> None:
        # plans compare sums of throughputs; one NaN or negative value would make every peer's plan wrong
        if not (math.isfinite(self.throughput) and self.throughput >= 0):
            raise BalancingError(
                f"peer {self.peer_id}'s throughput must be a finite number >= 0 (samples/s), got {self.throughput!r}"
            )


@dataclass(frozen=True)
class Move:
    peer_id: str
    source: int
    target: int


def peer_loads(stages: Sequence[Sequence[Announcement]], now: float) -> list[PeerLoad]:
    """What balancing needs of each announced peer: joining and online peers whose records have not expired."""
    return [
        PeerLoad(ann.peer_id, ann.stage, ann.throughput, online=ann.state == PeerState.ONLINE, movable=not ann.pinned)
        for anns in stages
        for ann in anns
        if ann.state in (PeerState.JOINING, PeerState.ONLINE) and ann.expiration > now
    ]


def stage_totals(peers: Sequence[PeerLoad], num_stages: int) -> list[float]:
    """Sum of throughputs per stage, joining peers included; peers of stages outside range(num_stages) are ignored."""
    totals = [0.0] * num_stages
    for peer in peers:
        if 0 <= peer.stage < num_stages:
            totals[peer.stage] += peer.throughput
    return totals


def stage_holders(peers: Sequence[PeerLoad], num_stages: int) -> list[int]:
    """Peers per stage, joining ones included (they are taking its state)."""
    counts = [0] * num_stages
    for p in peers:
        if 0 <= p.stage < num_stages:
            counts[p.stage] += 1
    return counts


def bottleneck(totals: Sequence[float]) -> float:
    """The swarm's throughput: its slowest stage's total."""
    return min(totals)


def choose_stage(
    peers: Sequence[PeerLoad],
    num_stages: int,
    rng: random.Random,
    exclude_peer: str | None = None,
    allowed: Collection[int] | None = None,
    min_holders: int = 1,
) -> int:
    """The stage with the lowest total among `allowed` (default: all; a peer's memory may hold only some),
    ties broken at random with rng; but while some allowed stage has fewer than `min_holders` peers, one of the
    stages with the fewest (a stage held once is lost with its peer: a second holder comes before throughput).

    exclude_peer's own record is left out, so a peer re-checking its choice does not count itself.
    """
    others = [p for p in peers if p.peer_id != exclude_peer]
    totals = stage_totals(others, num_stages)
    stages = [stage for stage in range(num_stages) if allowed is None or stage in allowed]
    if not stages:
        raise BalancingError("no stage is allowed: the peer can hold none of them")
    holders = stage_holders(others, num_stages)
    fewest = min(holders[stage] for stage in stages)
    if fewest < min_holders:
        stages = [stage for stage in stages if holders[stage] == fewest]
    lowest = min(totals[stage] for stage in stages)
    # a relative tolerance: the same totals summed in another order may differ in the last bits
    tied = [stage for stage in stages if totals[stage] <= lowest + 1e-9 * max(lowest, 1.0)]
    return rng.choice(tied)


class SortedByThroughput:
    """The peers of one stage sorted by (throughput, key), to find the one nearest a throughput by bisection."""

    def __init__(self, entries: Sequence[tuple[float, Any]] = ()) -> None:
        ordered = sorted(entries)
        self.speeds = [speed for speed, _ in ordered]  # floats apart: bisect on them is fast
        self.keys = [key for _, key in ordered]

    def _index(self, speed: float, key: Any) -> int:
        low = bisect_left(self.speeds, speed)
        return bisect_left(self.keys, key, low, bisect_right(self.speeds, speed, low))

    def add(self, speed: float, key: Any) -> None:
        i = self._index(speed, key)
        self.speeds.insert(i, speed)
        self.keys.insert(i, key)

    def remove(self, speed: float, key: Any) -> None:
        i = self._index(speed, key)
        del self.speeds[i], self.keys[i]

    def nearest(self, x: float) -> list[tuple[float, Any]]:
        """The entry with the largest speed <= x and the one with the smallest speed > x, each the lowest key
        among equal speeds."""
        found = []
        above = bisect_right(self.speeds, x)
        if above > 0:
            i = bisect_left(self.speeds, self.speeds[above - 1])
            found.append((self.speeds[i], self.keys[i]))
        if above < len(self.speeds):
            found.append((self.speeds[above], self.keys[above]))
        return found


def _plan(
    peers: Sequence[PeerLoad], num_stages: int, min_step: float, max_steps: int | None, min_holders: int = 1
) -> tuple[list[Move], float, float, int, int]:
    """plan_moves, also returning the bottleneck and the holder deficit (online peers missing below min_holders,
    summed over stages) before and after the plan."""
    # one record per peer, in peer-id order: every peer then sums in the same order and gets the same floats
    by_id = {p.peer_id: p for p in peers if 0 <= p.stage < num_stages}
    ordered = [by_id[peer_id] for peer_id in sorted(by_id)]
    totals = [0.0] * num_stages
    online = [0] * num_stages  # online peers per stage, pinned ones included: a stage is never abandoned
    movable: list[list[tuple[float, str]]] = [[] for _ in range(num_stages)]  # movable online peers per stage
    for p in ordered:
        totals[p.stage] += p.throughput
        if p.online:
            online[p.stage] += 1
            if p.movable:
                movable[p.stage].append((p.throughput, p.peer_id))
    start = bottleneck(totals)
    candidates = [SortedByThroughput(entries) for entries in movable]
    keep = max(min_holders, 1)  # online peers a stage should keep (a stage with fewer is thin)

    def deficit() -> int:
        return sum(max(0, keep - count) for count in online)

    deficit_before = deficit()
    final_stage: dict[str, int] = {}

    def move(peer_id: str, throughput: float, source: int, target: int) -> None:
        # the same expressions as a step's value, so each step raises the sorted totals in floating point too
        totals[source], totals[target] = totals[source] - throughput, totals[target] + throughput
        online[source] -= 1
        online[target] += 1
        candidates[source].remove(throughput, peer_id)
        candidates[target].add(throughput, peer_id)
        final_stage[peer_id] = target

    # first, holders: the thinnest stage takes the slowest movable peer of the stage with the most online peers
    # above `keep` (each such move lowers the deficit by one and makes none, so this ends)
    while min_holders > 1 and deficit() > 0:  # (min_holders 1: an unserved stage is the throughput steps' business)
        thin = min(range(num_stages), key=lambda stage: (online[stage], stage))
        sources = [s for s in range(num_stages) if online[s] > keep and candidates[s].keys]
        if online[thin] >= keep or not sources:
            break
        source = max(sources, key=lambda s: (online[s], -s))
        move(candidates[source].keys[0], candidates[source].speeds[0], source, thin)
    steps = 4 * len(ordered) if max_steps is None else max_steps
    for _ in range(steps):
        low = min(range(num_stages), key=totals.__getitem__)  # lowest index among ties
        best: tuple[float, str, float, int] | None = None  # (value, peer_id, throughput, source)
        for source in range(num_stages):
            # never a stage's last online peer; nor one that leaves its stage thin, unless it ends another's thinness
            if source == low or online[source] < 2 or (online[source] <= keep and online[low] >= keep):
                continue
            # value min(T_s - t, T_b + t) peaks at t = (T_s - T_b) / 2: only the nearest peer on each side counts
            for throughput, peer_id in candidates[source].nearest((totals[source] - totals[low]) / 2):
                value = min(totals[source] - throughput, totals[low] + throughput)
                if best is None or value > best[0] or (value == best[0] and peer_id < best[1]):
                    best = (value, peer_id, throughput, source)
        # also when T_b == 0: an unserved stage takes any candidate with value > 0
        if best is None or not best[0] > totals[low] * (1 + min_step):
            break
        _, peer_id, throughput, source = best
        move(peer_id, throughput, source, low)

    moves = [
        Move(peer_id, by_id[peer_id].stage, stage)
        for peer_id, stage in sorted(final_stage.items())
        if stage != by_id[peer_id].stage
    ]
    return moves, start, bottleneck(totals), deficit_before, deficit()


def plan_moves(
    peers: Sequence[PeerLoad],
    num_stages: int,
    min_step: float = 0.01,
    max_steps: int | None = None,
    min_holders: int = 1,
) -> list[Move]:
    """A greedy sequence of moves that raises the bottleneck, as one Move per peer whose final stage differs.

    Repeat: let b be the stage with the lowest total (lowest index among ties). Every movable online peer p of
    a stage s != b that keeps another online peer is a candidate; moving it to b is worth min(T_s - t_p,
    T_b + t_p). Take the best candidate (ties: lowest peer id) if it beats T_b * (1 + min_step), else stop.
    At most max_steps steps (default 4 x the number of peers). Moves are sorted by peer id.

    With `min_holders` above 1, holders come first: while a stage has fewer online peers than that, it takes the
    slowest movable peer of the stage with the most online peers above it (ties: the lowest stage, the lowest
    peer id); and no step leaves a stage with fewer than min_holders online peers unless it gives that many to
    the stage it moves to (the deficit never grows).
    """
    return _plan(peers, num_stages, min_step, max_steps, min_holders)[0]


def apply_moves(peers: Sequence[PeerLoad], moves: Sequence[Move]) -> list[PeerLoad]:
    """The records as they would be after the moves (moved peers keep their other fields)."""
    target = {move.peer_id: move.target for move in moves}
    return [
        PeerLoad(p.peer_id, target[p.peer_id], p.throughput, p.online, p.movable) if p.peer_id in target else p
        for p in peers
    ]


def worthwhile_moves(peers: Sequence[PeerLoad], num_stages: int, min_gain: float, min_holders: int = 1) -> list[Move]:
    """The plan's moves if the plan gives a thin stage (under min_holders online peers) another holder, or raises
    the bottleneck by more than min_gain (relative); else none.

    The same for every peer reading the same records: should_move is this list looked up for one peer.
    """
    moves, current, final, thin_before, thin_after = _plan(peers, num_stages, 0.01, None, min_holders)
    if thin_after < thin_before or final > current * (1 + min_gain) or (current == 0 and final > 0):
        return moves
    return []


def should_move(
    peer_id: str, peers: Sequence[PeerLoad], num_stages: int, min_gain: float, min_holders: int = 1
) -> int | None:
    """The stage peer_id should move to now, or None to stay (see the module's docstring for why)."""
    for move in worthwhile_moves(peers, num_stages, min_gain, min_holders):
        if move.peer_id == peer_id:
            return move.target
    return None
