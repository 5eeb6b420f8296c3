"""Where a peer serves its span of stages: pure functions over the spans and throughputs peers announce.

A peer serves a contiguous span of stages, as long as its memory allows (swarm/capacity/costs.py, longest_span:
`lengths[start]` stages from each start). Serving the longest span that fits is never worse: a compute-bound peer
does the same work per second whatever its length (a microbatch through twice the blocks takes twice as long), and
a network-bound one crosses one link per span, so longer spans carry more blocks per byte sent, and routes take
fewer hops. Where it goes is the choice: the start whose span leaves the swarm's per-stage throughput (`coverage`:
the samples per second all peers serving a stage can take) best, compared lowest first (the bottleneck, then the
next weakest stage, ...), as Petals' block_selection places a server's blocks where throughput is lowest.

A peer's throughput over a span: min(compute / blocks, network): `SpanPeer.rate`.

Spare holders: a stage's trained state lives only on the peers that serve it, and a volunteer can vanish at any
moment. So before throughput, placement looks at holders: every stage held by someone first, then every stage
held by at least `min_holders` peers (balancing.min_holders, 2 by default) where memory allows, and only then the
sorted coverage. A peer that joins fills the thinnest stages first, and a serving peer moves, without hysteresis,
when that gives a stage nobody or a single peer holds another holder (`toward_full_cover`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.balancing.moves import PeerLoad
from swarm.errors import BalancingError


@dataclass(frozen=True)
class SpanPeer:
    """What a peer offers: samples per second through one block (`compute`) and over its link (`network`, per hop,
    whatever the span's length), and the stages it serves (start, end), if any yet."""

    peer_id: str
    compute: float
    network: float
    start: int = 0
    end: int = 0

    def rate(self, blocks: float) -> float:
        """Samples per second through a span of `blocks` transformer blocks."""
        return min(self.compute / max(blocks, 1), self.network)


def span_peers(
    loads: Sequence[PeerLoad], blocks_per_stage: Sequence[float], exclude: str | None = None
) -> list[SpanPeer]:
    """The spans peers announce: a peer announces a record per stage it serves, each with its span's rate, so a
    peer's span runs from its lowest stage to its highest (`exclude`: this peer, whose truth the caller has)."""
    by_peer: dict[str, list[PeerLoad]] = {}
    for load in loads:
        if load.peer_id != exclude:
            by_peer.setdefault(load.peer_id, []).append(load)
    peers = []
    for peer_id, records in by_peer.items():
        start, end = min(r.stage for r in records), max(r.stage for r in records) + 1
        rate = min(r.throughput for r in records)
        blocks = sum(blocks_per_stage[start:end])
        peers.append(SpanPeer(peer_id, rate * blocks, float("inf"), start, end))  # its rate over its blocks
    return peers


def coverage(peers: Sequence[SpanPeer], blocks_per_stage: Sequence[float]) -> list[float]:
    """Samples per second each stage can take: the sum of the rates of the peers whose spans hold it."""
    totals = [0.0] * len(blocks_per_stage)
    for peer in peers:
        if not 0 <= peer.start < peer.end <= len(blocks_per_stage):
            continue  # not serving (yet), or a span outside the model
        rate = peer.rate(sum(blocks_per_stage[peer.start : peer.end]))
        for stage in range(peer.start, peer.end):
            totals[stage] += rate
    return totals


def _score(totals: list[float], peer: SpanPeer, start: int, end: int, blocks: Sequence[float]) -> list[float]:
    added = list(totals)
    rate = peer.rate(sum(blocks[start:end]))
    for stage in range(start, end):
        added[stage] += rate
    return sorted(added)


def choose_span(
    peer: SpanPeer,
    others: Sequence[SpanPeer],
    lengths: Sequence[int],
    blocks_per_stage: Sequence[float],
    rng: random.Random,
    min_holders: int = 1,
) -> tuple[int, int] | None:
    """The span (start, end) where `peer`, serving as many stages as fit from there (`lengths[start]`), leaves the
    most stages held, then the most held by `min_holders` peers, then the swarm's coverage best (lowest stages
    first); None if no stage fits at all. Ties go at random."""
    if len(lengths) != len(blocks_per_stage):
        raise BalancingError(f"{len(lengths)} span lengths for {len(blocks_per_stage)} stages")
    if peer.compute < 0 or peer.network < 0:
        raise BalancingError(f"peer {peer.peer_id} announces a negative throughput")
    others = [o for o in others if o.peer_id != peer.peer_id]
    totals = coverage(others, blocks_per_stage)
    counts = holders(others, len(blocks_per_stage))
    options = [(start, start + length) for start, length in enumerate(lengths) if length > 0]
    if not options:
        return None
    scored = [
        ((*_held(counts, (0, 0), span, min_holders), _score(totals, peer, *span, blocks_per_stage)), span)
        for span in options
    ]
    best = max(score for score, _ in scored)
    return rng.choice([span for score, span in scored if score == best])


def _held(counts: list[int], old: tuple[int, int], new: tuple[int, int], min_holders: int) -> tuple[int, int]:
    """(stages held by someone, stages held by at least min_holders peers) once a peer moves from `old` to `new`
    (old = (0, 0): a peer that joins); (-1, -1) for a move that would leave a stage nobody holds."""
    after = _moved(counts, old, new)
    if after is None:
        return -1, -1
    return sum(c > 0 for c in after), sum(c >= min_holders for c in after)


def better_span(
    peer: SpanPeer,
    others: Sequence[SpanPeer],
    lengths: Sequence[int],
    blocks_per_stage: Sequence[float],
    rng: random.Random,
    min_gain: float = 0.1,
    min_holders: int = 1,
) -> tuple[int, int] | None:
    """Where `peer` (serving peer.start..peer.end) should move, or None (stay). It moves when the swarm's sorted
    coverage rises by more than `min_gain` of the bottleneck at the first stage that changes, weakest first: the
    bottleneck itself, or, where several stages tie near it (one move cannot lift them all), the weakest stage the
    move helps without lowering a weaker one. Each move raises that sorted vector, so moves made one after another
    never cycle; min_gain is the hysteresis that keeps noise and stale records from moving peers back and forth
    (a move costs a state download), as a share of the bottleneck or of the peer's own rate, whichever is less.
    While a stage has nobody, or fewer than `min_holders` peers, holding every stage comes first, then holding each
    by min_holders peers (`toward_full_cover`), with no hysteresis."""
    others = [o for o in others if o.peer_id != peer.peer_id]
    now = sorted(coverage([*others, peer], blocks_per_stage))
    held_more = False
    if peer.end > peer.start and min(holders([*others, peer], len(blocks_per_stage))) < max(min_holders, 1):
        (start, end), held_more = toward_full_cover(peer, others, lengths, blocks_per_stage, rng, min_holders)
    else:
        # (holders first: a move never takes a stage below min_holders peers for throughput's sake)
        start, end = choose_span(peer, others, lengths, blocks_per_stage, rng, min_holders) or (peer.start, peer.end)
    if (start, end) == (peer.start, peer.end):
        return None
    if held_more:  # a stage nobody served gets a peer (now, or by the move this one makes room for)
        return start, end
    moved = SpanPeer(peer.peer_id, peer.compute, peer.network, start, end)
    after = sorted(coverage([*others, moved], blocks_per_stage))
    # the hysteresis is relative to what this peer brings (its rate over its span) where that is less than the
    # bottleneck: in a swarm of many peers a stage, no single move can lift the bottleneck by min_gain of itself
    own = peer.rate(sum(blocks_per_stage[peer.start : peer.end])) if peer.end > peer.start else float("inf")
    margin = min_gain * max(min(now[0] if now else 0.0, own), 1e-12)
    for before, later in zip(now, after):
        if abs(later - before) > 1e-9 * max(before, 1.0):
            return (start, end) if later > before + margin else None
    return None


def holders(peers: Sequence[SpanPeer], stages: int) -> list[int]:
    """How many peers hold each stage."""
    counts = [0] * stages
    for peer in peers:
        for stage in range(max(peer.start, 0), min(peer.end, stages)):
            counts[stage] += 1
    return counts


def _moved(counts: list[int], old: tuple[int, int], new: tuple[int, int]) -> list[int] | None:
    """The holders per stage after a peer moves from span `old` to `new`; None if it would leave a stage that only
    it holds (a move never does: that stage's trained state would leave with it)."""
    after = list(counts)
    for stage in range(*old):
        after[stage] -= 1
    if any(after[stage] == 0 and not new[0] <= stage < new[1] for stage in range(*old)):
        return None
    for stage in range(*new):
        after[stage] += 1
    return after


def _held_after_one_more_move(others: Sequence[SpanPeer], counts: list[int]) -> int:
    """The most stages held after one more move by one of `others`, each keeping the length of its span (what its
    memory is known to hold; it may hold more)."""
    stages, best = len(counts), sum(c > 0 for c in counts)
    if best == stages:
        return best  # every stage is held already
    for other in others:
        length = min(other.end, stages) - max(other.start, 0)
        for start in range(stages) if length > 0 else ():
            span = (start, min(start + length, stages))
            after = _moved(counts, (other.start, other.end), span) if span != (other.start, other.end) else None
            if after is not None:
                best = max(best, sum(c > 0 for c in after))
    return best


def toward_full_cover(
    peer: SpanPeer,
    others: Sequence[SpanPeer],
    lengths: Sequence[int],
    blocks_per_stage: Sequence[float],
    rng: random.Random,
    min_holders: int = 1,
) -> tuple[tuple[int, int], bool]:
    """Where a serving `peer` goes while some stage has nobody (or fewer than `min_holders` peers): the span that
    leaves the most stages held, then the most held after one more move by another peer (stepping aside so that
    another peer can fill the hole: with small peers at [1, 3] and [3, 4] and stage 0 empty, [3, 4] -> [2, 4] lets
    the other go to [0, 2]; no single move fills it, as each would leave a stage only its peer holds), then the
    most held by min_holders peers, then the best sorted coverage. Its own span is one of the choices. Second:
    whether the span found holds more stages (or more by min_holders peers) than staying."""
    stages = len(blocks_per_stage)
    counts = holders([*others, peer], stages)
    current = (peer.start, peer.end)
    options = [current] + [(s, s + n) for s, n in enumerate(lengths) if n > 0 and (s, s + n) != current]
    totals = coverage(others, blocks_per_stage)
    scored = []
    for span in options:
        after = counts if span == current else _moved(counts, current, span)
        if after is None:
            continue
        moved = SpanPeer(peer.peer_id, peer.compute, peer.network, *span)
        held = (
            sum(c > 0 for c in after),
            _held_after_one_more_move(others, after),
            sum(c >= min_holders for c in after),
        )
        scored.append((held, _score(totals, moved, *span, blocks_per_stage), span))
    best = max((held, score) for held, score, _ in scored)
    span = rng.choice([span for held, score, span in scored if (held, score) == best])
    return span, best[0] > scored[0][0]


def upper_bound(peers: Sequence[SpanPeer], longest: Sequence[float], blocks_per_stage: Sequence[float]) -> float:
    """A bottleneck no placement exceeds: each peer adds at most min(compute, network x its longest span's blocks)
    block-samples per second in all, and the stages share them; a stage of b blocks takes b times a
    one-block stage's work. `longest[i]`: the most blocks peer i can hold."""
    total = sum(min(p.compute, p.network * max(n, 0)) for p, n in zip(peers, longest))
    return total / max(sum(blocks_per_stage), 1)
