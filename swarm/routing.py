"""Trainer-side choice of a route (one peer per stage) or of one peer: least expected time, with bans (pure logic).

A route's expected time (`Router.choose_route`) adds, hop by hop, the queueing and compute at each peer
((samples outstanding there + the new ones) x its compute seconds per sample, from the hop timings of replies)
and the transfer between consecutive hops: the transfer this router observed between those two peers (an EMA),
or else an estimate: the round trip between their network coordinates (swarm/network/coordinates.py) plus the samples
over the slower end's announced network throughput. The best route is found exactly, stage by stage (a shortest
path through the stages' peers). With `network_aware=False` the transfers count for nothing (latency-blind, to
compare against).

For one stage alone (`Router.choose`, used by a hop that reroutes and by the relay pipeline):
For each stage the trainer sends a microbatch to the online peer that would finish it soonest by the trainer's
own observations: (samples it has outstanding at that peer + the new ones) x the peer's seconds per sample, an
EMA of the forward calls the trainer timed. A peer the trainer has not timed yet is assumed as fast as the
fastest peer it has timed (or, if none, as its announced throughput says), so new peers get tried early.
A peer that fails or times out is banned for BASE_BAN seconds, doubling with each further failure up to
MAX_BAN, and for at least WASTE_FACTOR times the seconds its failed call kept the caller waiting (a peer that
never answers, so that it costs at most 1 / (1 + WASTE_FACTOR) of the caller's time); a success clears its record
of failures.

What a trainer timed of a peer long ago is no longer evidence: a peer left out of REPROBE_AFTER choices in a row
(one slow call, during an averaging round's pause say, and a faster replica took all the work since) gets the
next choice (the next route goes through it), and its new timings replace the old ones, transfers to and from it
included. Without that, one replica can capture a trainer's whole traffic for good, and the stage's other
replicas, idle, have nothing to average (a flaky test showed it: tests/test_adversaries.py).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from swarm.dht.records import Announcement, PeerState
from swarm.network.coordinates import Coordinate, round_trip

ORIGIN = ""  # the trainer itself, as the first end of the transfer to stage 0

EMA_WEIGHT = 0.2  # weight of the newest observation in the seconds-per-sample EMA
BASE_BAN = 5.0
MAX_BAN = 60.0
WASTE_FACTOR = 4.0  # a ban lasts at least this many times the wait a failed call cost (a black hole: 20% at most)
MIN_THROUGHPUT = 1e-3  # a peer announcing 0 samples/s is still routable, as a very slow one
REPROBE_AFTER = 32  # choices that left a timed peer out in a row, after which it counts as untimed (tried again)


def online_peers(announcements: Sequence[Announcement], now: float) -> list[Announcement]:
    """Peers announced online whose records have not expired."""
    return [a for a in announcements if a.state == PeerState.ONLINE and a.expiration > now]


@dataclass
class PeerRecord:
    """What one trainer knows of one peer from its own calls."""

    seconds_per_sample: float | None = None  # EMA; None until the first timed call
    compute_per_sample: float | None = None  # EMA of its compute alone (from hop timings)
    outstanding: int = 0  # samples sent to it whose work there is not finished
    failures: int = 0  # consecutive failures
    banned_until: float = 0.0
    convicted: bool = False  # caught computing wrong results (client/checks.py): a success does not lift it
    passed_over: int = 0  # choices in a row that left it out (see REPROBE_AFTER)
    retrying: bool = False  # chosen again after REPROBE_AFTER choices without it: its next timing replaces the old

    def forget_old_timings(self) -> None:
        """Before a new timing of a peer tried again: the old ones are not blended in, it is taken as it is."""
        if self.retrying:
            self.seconds_per_sample = self.compute_per_sample = None
            self.retrying = False


class Router:
    def __init__(self, network_aware: bool = True) -> None:
        self.peers: dict[str, PeerRecord] = {}
        self.network_aware = network_aware
        self.transfers: dict[tuple[str, str], float] = {}  # (from, to) -> EMA of a transfer's seconds, both ways

    def choose_route(
        self,
        stages: Sequence[Sequence[Announcement]],
        samples: int,
        now: float,
        rng: random.Random,
        exclude_first: Collection[str] = (),
        origin: Coordinate | None = None,
    ) -> list[Announcement]:
        """The route (one announcement per stage, in order) with the least expected time for `samples` samples.
        It ends before the first stage with no allowed peer (a hop chooses there itself); [] if stage 0 has none.
        Ties are broken at random."""
        allowed_by_stage: list[list[Announcement]] = []
        for index, candidates in enumerate(stages):
            exclude = exclude_first if index == 0 else ()
            allowed = [a for a in candidates if a.peer_id not in exclude and not self.is_banned(a.peer_id, now)]
            if not allowed:
                break
            rng.shuffle(allowed)  # ties go to whichever comes first
            allowed_by_stage.append(allowed)
        probe = self._due_for_probe([a for allowed in allowed_by_stage for a in allowed])
        if probe is not None:  # this route goes through it, to time it again
            allowed_by_stage = [[probe] if probe in allowed else allowed for allowed in allowed_by_stage]
        route = self._least_time_route(allowed_by_stage, samples, origin)
        if route:
            self._passed_over([a for candidates in stages for a in candidates], route)
        return route

    def _least_time_route(
        self, allowed_by_stage: list[list[Announcement]], samples: int, origin: Coordinate | None
    ) -> list[Announcement]:
        """The exact shortest path through the stages' allowed peers (node times plus transfer times)."""
        best: dict[str, tuple[float, list[Announcement]]] = {ORIGIN: (0.0, [])}
        ends: dict[str, Announcement | None] = {ORIGIN: None}
        for allowed in allowed_by_stage:
            timed = [c for a in allowed if (r := self.peers.get(a.peer_id)) and (c := self._compute(r)) is not None]
            fastest = min(timed) if timed else None
            step: dict[str, tuple[float, list[Announcement]]] = {}
            for ann in allowed:
                node = self._node_time(ann, samples, fastest)
                options = [
                    (cost + self._transfer_time(ends[prev], ann, samples, origin), path)
                    for prev, (cost, path) in best.items()
                ]
                cost, path = min(options, key=lambda option: option[0])
                step[ann.peer_id] = (cost + node, [*path, ann])
            best = step
            ends = {a.peer_id: a for a in allowed}
        if not any(path for _, path in best.values()):
            return []
        return min(best.values(), key=lambda option: option[0])[1]

    def _due_for_probe(self, allowed: Sequence[Announcement]) -> Announcement | None:
        """The allowed peer left out longest, once that is REPROBE_AFTER choices or more; else None."""
        due = [(record.passed_over, a) for a in allowed if (record := self.peers.get(a.peer_id)) is not None]
        due = [(passed, a) for passed, a in due if passed >= REPROBE_AFTER]
        return max(due, key=lambda item: item[0])[1] if due else None

    def _passed_over(self, candidates: Sequence[Announcement], chosen: Collection[Announcement]) -> None:
        chosen_ids = {a.peer_id for a in chosen}
        for ann in candidates:
            record = self.peers.get(ann.peer_id)
            if record is None:
                continue
            if ann.peer_id not in chosen_ids:
                record.passed_over += 1
            else:
                record.retrying = record.retrying or record.passed_over >= REPROBE_AFTER
                record.passed_over = 0

    def _compute(self, record: PeerRecord) -> float | None:
        return record.compute_per_sample if self.network_aware else record.seconds_per_sample

    def _node_time(self, ann: Announcement, samples: int, fastest_known: float | None) -> float:
        record = self.peers.get(ann.peer_id) or PeerRecord()
        per_sample = self._compute(record)
        if per_sample is None:
            rate = ann.compute_throughput if self.network_aware and ann.compute_throughput > 0 else ann.throughput
            per_sample = fastest_known if fastest_known is not None else 1.0 / max(rate, MIN_THROUGHPUT)
        return (record.outstanding + samples) * per_sample

    def _transfer_time(
        self, source: Announcement | None, target: Announcement, samples: int, origin: Coordinate | None
    ) -> float:
        """Expected seconds to send `samples` from `source` (None: the trainer) to `target` and back."""
        if not self.network_aware or (source is not None and source.peer_id == target.peer_id):
            return 0.0  # latency-blind, or two stages of one peer's span: nothing crosses a link
        key = (source.peer_id if source is not None else ORIGIN, target.peer_id)
        if key in self.transfers:
            return self.transfers[key]
        start = source.coordinate if source is not None else origin
        latency = 0.0
        if start is not None and start.known and target.coordinate is not None and target.coordinate.known:
            latency = round_trip(start, target.coordinate)
        if source is None:  # tokens to stage 0: latency only
            return latency
        rates = [r for r in (source.network_throughput, target.network_throughput) if r > 0]
        return latency + (samples / min(rates) if rates else 0.0)

    def observed_hop(self, source: str, peer_id: str, samples: int, compute: float, transfer: float) -> None:
        """A reply's timing of one hop: the peer's compute, and the transfer to it from `source` and back."""
        record = self.record(peer_id)
        key = (source, peer_id)
        if record.retrying:  # tried again after its timings grew old: the transfers to and from it are as old
            self.transfers = {k: v for k, v in self.transfers.items() if peer_id not in k}
        record.forget_old_timings()
        record.compute_per_sample = _ema(record.compute_per_sample, max(compute, 1e-6) / max(samples, 1))
        self.transfers[key] = _ema(self.transfers.get(key), transfer)
        self.observed(peer_id, samples, compute + transfer)

    def record(self, peer_id: str) -> PeerRecord:
        return self.peers.setdefault(peer_id, PeerRecord())

    def choose(
        self,
        candidates: Sequence[Announcement],
        samples: int,
        now: float,
        rng: random.Random,
        exclude: Collection[str] = (),
    ) -> Announcement | None:
        """The candidate with the least expected time to finish `samples` more; None if all are excluded or
        banned. Ties (e.g. several untried peers) are broken at random."""
        allowed = [a for a in candidates if a.peer_id not in exclude and not self.is_banned(a.peer_id, now)]
        if not allowed:
            return None
        probe = self._due_for_probe(allowed)
        if probe is not None:
            self._passed_over(allowed, [probe])
            return probe
        timed = [r.seconds_per_sample for a in allowed if (r := self.peers.get(a.peer_id)) and r.seconds_per_sample]
        fastest_known = min(timed) if timed else None
        best: list[Announcement] = []
        best_time = float("inf")
        for ann in allowed:
            expected = self.expected_time(ann, samples, fastest_known)
            if expected < best_time * (1 - 1e-9):
                best, best_time = [ann], expected
            elif expected <= best_time * (1 + 1e-9):
                best.append(ann)
        chosen = rng.choice(best)
        self._passed_over(allowed, [chosen])
        return chosen

    def expected_time(self, ann: Announcement, samples: int, fastest_known: float | None) -> float:
        record = self.peers.get(ann.peer_id) or PeerRecord()
        per_sample = record.seconds_per_sample
        if per_sample is None:
            per_sample = fastest_known if fastest_known is not None else 1.0 / max(ann.throughput, MIN_THROUGHPUT)
        return (record.outstanding + samples) * per_sample

    def started(self, peer_id: str, samples: int) -> None:
        self.record(peer_id).outstanding += samples

    def finished(self, peer_id: str, samples: int) -> None:
        record = self.record(peer_id)
        record.outstanding = max(record.outstanding - samples, 0)

    def observed(self, peer_id: str, samples: int, seconds: float) -> None:
        """A call of `samples` samples to this peer succeeded in `seconds`."""
        record = self.record(peer_id)
        record.forget_old_timings()
        record.seconds_per_sample = _ema(record.seconds_per_sample, max(seconds, 1e-6) / max(samples, 1))
        record.failures = 0

    def failed(self, peer_id: str, now: float, wasted: float = 0.0) -> float:
        """Ban the peer after a failure that kept the caller waiting `wasted` seconds; returns the ban's length in
        seconds (it doubles with each failure, and is at least WASTE_FACTOR x wasted)."""
        record = self.record(peer_id)
        record.failures += 1
        ban = min(max(BASE_BAN * 2 ** (record.failures - 1), WASTE_FACTOR * wasted), MAX_BAN)
        record.banned_until = max(record.banned_until, now + ban)  # never shortens a conviction
        return ban

    def ban(self, peer_id: str, until: float) -> None:
        """Leave the peer out of routes until `until` (a peer caught computing wrong results)."""
        record = self.record(peer_id)
        record.banned_until = max(record.banned_until, until)
        record.convicted = True

    def is_banned(self, peer_id: str, now: float) -> bool:
        record = self.peers.get(peer_id)
        return record is not None and record.banned_until > now

    def forget(self, keep: Collection[str]) -> None:
        """Drop what is known of peers no longer announced (records of peers long gone would pile up)."""
        self.peers = {p: r for p, r in self.peers.items() if p in keep or r.outstanding > 0 or r.convicted}
        self.transfers = {k: v for k, v in self.transfers.items() if k[1] in self.peers}


def _ema(previous: float | None, value: float) -> float:
    """The EMA after a new observation (the first one is taken as it is)."""
    return value if previous is None else previous + EMA_WEIGHT * (value - previous)
