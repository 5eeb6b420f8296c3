"""How good an assignment of peers to stages is: `optimal_assignment` (the stage for each peer that maximises the
bottleneck: exact up to EXACT_LIMIT peers, a good heuristic beyond), `upper_bound` (a bound no assignment
exceeds) and `efficiency` (the current bottleneck over the best one). Pure functions, for status pages,
benchmarks and tests: the peers' own decisions are swarm/balancing/moves.py's.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence

from swarm.balancing.moves import PeerLoad, SortedByThroughput, bottleneck, stage_totals
from swarm.errors import BalancingError

EXACT_LIMIT = 18  # optimal_assignment is exact up to this many peers: worst case measured ~0.35 s (2 stages)


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
        SortedByThroughput([(t, i) for i, t in enumerate(throughputs) if stages[i] == stage])
        for stage in range(num_stages)
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
        raise BalancingError(f"a swarm has at least one stage, not {num_stages}")
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
