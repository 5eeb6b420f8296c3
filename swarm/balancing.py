"""Which stage each peer serves: pure functions over announced records (no I/O).

`peer_loads` turns announcements into loads, `choose_stage` is a joining peer's choice, `should_move` an online
peer's check (through `plan_moves`, the greedy plan it simulates), `worthwhile_moves` that answer for every peer
at once (for simulations and status pages), `apply_moves` the records as they would be after some moves, and
`optimal_assignment`, `upper_bound` and `efficiency` how far an assignment is from the best one. The rules, and
why a plan rather than a single move: docs/ARCHITECTURE.md, "Balancing".

What the I/O around these relies on: every peer computes the same plan from the same records (records are put
in peer-id order first and ties go to the lowest peer id), every step of a plan strictly raises the sorted
vector of stage totals (so plans end and cannot cycle), and a plan never takes a stage's last online peer nor
moves a joining or pinned one.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarm.dht.records import Announcement, PeerState

EXACT_LIMIT = 18  # optimal_assignment is exact up to this many peers: worst case measured ~0.35 s (2 stages)


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
            raise ValueError(f"throughput must be finite and >= 0, got {self.throughput!r} for {self.peer_id}")


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


def bottleneck(totals: Sequence[float]) -> float:
    """The swarm's throughput: its slowest stage's total."""
    return min(totals)


def choose_stage(
    peers: Sequence[PeerLoad], num_stages: int, rng: random.Random, exclude_peer: str | None = None
) -> int:
    """The stage with the lowest total, ties broken at random with rng.

    exclude_peer's own record is left out, so a peer re-checking its choice does not count itself.
    """
    totals = stage_totals([p for p in peers if p.peer_id != exclude_peer], num_stages)
    lowest = min(totals)
    # a relative tolerance: the same totals summed in another order may differ in the last bits
    tied = [stage for stage, total in enumerate(totals) if total <= lowest + 1e-9 * max(lowest, 1.0)]
    return rng.choice(tied)


class _Sorted:
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
    peers: Sequence[PeerLoad], num_stages: int, min_step: float, max_steps: int | None
) -> tuple[list[Move], float, float]:
    """plan_moves, also returning the bottleneck before and after the plan."""
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
    candidates = [_Sorted(entries) for entries in movable]

    final_stage: dict[str, int] = {}
    steps = 4 * len(ordered) if max_steps is None else max_steps
    for _ in range(steps):
        low = min(range(num_stages), key=totals.__getitem__)  # lowest index among ties
        best: tuple[float, str, float, int] | None = None  # (value, peer_id, throughput, source)
        for source in range(num_stages):
            if source == low or online[source] < 2:
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
        # the same expressions as the value, so each step raises the sorted totals in floating point too
        totals[source], totals[low] = totals[source] - throughput, totals[low] + throughput
        online[source] -= 1
        online[low] += 1
        candidates[source].remove(throughput, peer_id)
        candidates[low].add(throughput, peer_id)
        final_stage[peer_id] = low

    moves = [
        Move(peer_id, by_id[peer_id].stage, stage)
        for peer_id, stage in sorted(final_stage.items())
        if stage != by_id[peer_id].stage
    ]
    return moves, start, bottleneck(totals)


def plan_moves(
    peers: Sequence[PeerLoad], num_stages: int, min_step: float = 0.01, max_steps: int | None = None
) -> list[Move]:
    """A greedy sequence of moves that raises the bottleneck, as one Move per peer whose final stage differs.

    Repeat: let b be the stage with the lowest total (lowest index among ties). Every movable online peer p of
    a stage s != b that keeps another online peer is a candidate; moving it to b is worth min(T_s - t_p,
    T_b + t_p). Take the best candidate (ties: lowest peer id) if it beats T_b * (1 + min_step), else stop.
    At most max_steps steps (default 4 x the number of peers). Moves are sorted by peer id.
    """
    return _plan(peers, num_stages, min_step, max_steps)[0]


def apply_moves(peers: Sequence[PeerLoad], moves: Sequence[Move]) -> list[PeerLoad]:
    """The records as they would be after the moves (moved peers keep their other fields)."""
    target = {move.peer_id: move.target for move in moves}
    return [
        PeerLoad(p.peer_id, target[p.peer_id], p.throughput, p.online, p.movable) if p.peer_id in target else p
        for p in peers
    ]


def worthwhile_moves(peers: Sequence[PeerLoad], num_stages: int, min_gain: float) -> list[Move]:
    """The plan's moves if the plan raises the bottleneck by more than min_gain (relative), else none.

    The same for every peer reading the same records: should_move is this list looked up for one peer.
    """
    moves, current, final = _plan(peers, num_stages, 0.01, None)
    if final > current * (1 + min_gain) or (current == 0 and final > 0):
        return moves
    return []


def should_move(peer_id: str, peers: Sequence[PeerLoad], num_stages: int, min_gain: float) -> int | None:
    """The stage peer_id should move to now, or None to stay (see the module's docstring for why)."""
    for move in worthwhile_moves(peers, num_stages, min_gain):
        if move.peer_id == peer_id:
            return move.target
    return None


def upper_bound(throughputs: Sequence[float], num_stages: int) -> float:
    """A bound that no assignment's bottleneck exceeds.

    The j fastest peers sit in at most j stages, so the other num_stages - j stages (or more) share at most the
    rest: bottleneck <= (total - sum of the j fastest) / (num_stages - j), for every j < num_stages.
    """
    if len(throughputs) < num_stages:
        return 0.0
    fastest = sorted(throughputs, reverse=True)
    rest = sum(fastest)
    bound = rest / num_stages
    for j in range(1, num_stages):
        rest -= fastest[j - 1]
        bound = min(bound, rest / (num_stages - j))
    return bound


def _largest_first(throughputs: Sequence[float], num_stages: int) -> list[int]:
    """Each peer, fastest first, to the stage with the lowest total so far (LPT)."""
    stages = [0] * len(throughputs)
    heap = [(0.0, stage) for stage in range(num_stages)]
    for i in sorted(range(len(throughputs)), key=lambda i: -throughputs[i]):
        total, stage = heapq.heappop(heap)
        stages[i] = stage
        heapq.heappush(heap, (total + throughputs[i], stage))
    return stages


def _improve(throughputs: Sequence[float], stages: list[int], num_stages: int) -> None:
    """Moves into the bottleneck stage and swaps between it and another stage, best first, until none helps."""
    totals = [0.0] * num_stages
    for i, stage in enumerate(stages):
        totals[stage] += throughputs[i]
    members = [
        _Sorted([(t, i) for i, t in enumerate(throughputs) if stages[i] == stage]) for stage in range(num_stages)
    ]

    for _ in range(10 * len(throughputs)):
        low = min(range(num_stages), key=totals.__getitem__)
        outgoing = [0.0, *members[low].speeds]  # who leaves the bottleneck stage; 0.0: nobody (a plain move)
        best: tuple[float, float, int, int, int] | None = None  # (value, delta, source, position in it, outgoing)
        for source in range(num_stages):
            if source == low:
                continue
            speeds = members[source].speeds
            half_gap = (totals[source] - totals[low]) / 2
            for out, t_out in enumerate(outgoing):
                # the change delta = t_in - t_out is worth min(T_s - delta, T_b + delta), best at delta = half_gap
                above = bisect_right(speeds, t_out + half_gap)
                for position in (above - 1, above):
                    if 0 <= position < len(speeds):
                        delta = speeds[position] - t_out
                        value = min(totals[source] - delta, totals[low] + delta)
                        if best is None or value > best[0]:
                            best = (value, delta, source, position, out)
        if best is None or not best[0] > totals[low]:
            return
        _, delta, source, position, out = best
        totals[source], totals[low] = totals[source] - delta, totals[low] + delta
        i_in = members[source].keys[position]
        if out > 0:
            i_out = members[low].keys[out - 1]
            members[low].remove(throughputs[i_out], i_out)
            members[source].add(throughputs[i_out], i_out)
            stages[i_out] = source
        members[source].remove(throughputs[i_in], i_in)
        members[low].add(throughputs[i_in], i_in)
        stages[i_in] = low


def _cover(speeds: Sequence[float], num_stages: int, floor: float) -> list[int] | None:
    """A stage per peer such that every stage total is above floor, or None if there is none (speeds descending).

    Stages are filled one at a time, each starting with the fastest peer left (so stages are never told apart by
    their index alone) and closed as soon as its total passes floor: any peer beyond that could as well go to a
    later stage, where it can only help. The last stage takes every peer left.
    """
    count = len(speeds)
    stage_of = [-1] * count
    dead_ends: set[tuple[int, tuple[float, ...]]] = set()  # (stage, speeds left) known not to work out

    def open_stage(stage: int) -> bool:
        left = tuple(speed for speed, where in zip(speeds, stage_of) if where < 0)
        # different first stages often leave the same peers for the rest: try each such rest once
        if (stage, left) in dead_ends:
            return False
        # every stage still to fill must pass floor: the free peers together must be able to pay for that
        # (summed afresh: a running total kept by subtraction drifts, and could let an exact tie pass)
        if not sum(left) > (num_stages - stage) * floor:
            return False
        first = stage_of.index(-1)
        if stage == num_stages - 1:
            for i in range(first, count):
                if stage_of[i] < 0:
                    stage_of[i] = stage
            return True
        stage_of[first] = stage
        if extend(stage, first + 1, speeds[first]):
            return True
        stage_of[first] = -1
        dead_ends.add((stage, left))
        return False

    def dominated(stage: int, total: float) -> bool:
        # the same rule for every peer of a closed stage but its first: if a slower free peer could take its
        # place and the stage still pass floor, the swapped stage is at least as good for everyone else
        free = [i for i in range(count) if stage_of[i] < 0]
        if not free:
            return False
        slowest = speeds[free[-1]]
        members = [i for i in range(count) if stage_of[i] == stage][1:]
        return any(speeds[i] > slowest and total - speeds[i] + slowest > floor for i in members)

    def extend(stage: int, start: int, total: float) -> bool:
        if total > floor:
            return open_stage(stage + 1)
        free_here = [i for i in range(start, count) if stage_of[i] < 0]
        if not total + sum(speeds[i] for i in free_here) > floor:
            return False
        # of the peers that would close the stage, only the slowest is worth trying: with it, the faster ones
        # stay free for later stages, which can only be better for them
        closing = [i for i in free_here if total + speeds[i] > floor]
        if closing:
            last = closing[-1]
            stage_of[last] = stage
            if not dominated(stage, total + speeds[last]) and open_stage(stage + 1):
                return True
            stage_of[last] = -1
        tried = None
        for i in free_here[len(closing) :]:
            if speeds[i] == tried:
                continue  # two peers of equal speed lead to the same subtrees
            tried = speeds[i]
            stage_of[i] = stage
            if extend(stage, i + 1, total + speeds[i]):
                return True
            stage_of[i] = -1
        return False

    return stage_of if open_stage(0) else None


def _exact(throughputs: Sequence[float], num_stages: int) -> list[int]:
    """The best assignment: from the heuristic's, ask for one whose every stage beats it, until there is none."""
    order = sorted(range(len(throughputs)), key=lambda i: -throughputs[i])
    speeds = [throughputs[i] for i in order]  # all sums below in this one order, so they compare exactly
    ceiling = upper_bound(speeds, num_stages)
    stages = _largest_first(speeds, num_stages)
    _improve(speeds, stages, num_stages)
    value = bottleneck(_totals_of(speeds, stages, num_stages))
    while value < ceiling:
        found = _cover(speeds, num_stages, value)
        if found is None:
            break
        stages, value = found, bottleneck(_totals_of(speeds, found, num_stages))
    result = [0] * len(throughputs)
    for position, i in enumerate(order):
        result[i] = stages[position]
    return result


def _totals_of(throughputs: Sequence[float], stages: Sequence[int], num_stages: int) -> list[float]:
    """Stage totals of an assignment given as one stage per peer."""
    totals = [0.0] * num_stages
    for throughput, stage in zip(throughputs, stages, strict=True):
        totals[stage] += throughput
    return totals


def optimal_assignment(throughputs: Sequence[float], num_stages: int) -> tuple[list[int], float]:
    """The stage for each peer that maximises the bottleneck, and that bottleneck.

    Heuristic: largest-first greedy (each peer, fastest first, to the stage with the lowest total), then
    improved by the best move of one peer into the bottleneck stage or swap of two peers between the bottleneck
    stage and another, repeated while one raises the lower of the two stages involved above the bottleneck.

    Exact up to EXACT_LIMIT peers, by branch and bound from the heuristic's answer: search for an assignment
    whose every stage beats the best bottleneck so far (stages filled one at a time, pruned when the peers left
    cannot lift the remaining stages above it), take it, and repeat until there is none.

    With fewer peers than stages the optimum is 0 (some stage is unserved). Pins are ignored: this is the best
    any placement of these peers could do.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if len(throughputs) < num_stages:
        return list(range(len(throughputs))), 0.0
    if len(throughputs) <= EXACT_LIMIT:
        stages = _exact(throughputs, num_stages)
    else:
        stages = _largest_first(throughputs, num_stages)
        _improve(throughputs, stages, num_stages)
    return stages, bottleneck(_totals_of(throughputs, stages, num_stages))


def efficiency(peers: Sequence[PeerLoad], num_stages: int) -> float:
    """The current bottleneck (online and joining peers) over the best bottleneck of the same peers, in [0, 1]."""
    peers = [p for p in peers if 0 <= p.stage < num_stages]
    current = bottleneck(stage_totals(peers, num_stages))
    best = optimal_assignment([p.throughput for p in peers], num_stages)[1]
    if best <= 0:
        return 1.0
    # the heuristic optimum (large swarms) may fall below an assignment that is better still
    return min(1.0, current / best)
