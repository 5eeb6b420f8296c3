"""Trainer-side choice of a peer per stage: least expected time to finish, with bans (pure logic, no I/O).

For each stage the trainer sends a microbatch to the online peer that would finish it soonest by the trainer's
own observations: (samples it has outstanding at that peer + the new ones) x the peer's seconds per sample, an
EMA of the forward calls the trainer timed. A peer the trainer has not timed yet is assumed as fast as the
fastest peer it has timed (or, if none, as its announced throughput says), so new peers get tried early.
A peer that fails or times out is banned for BASE_BAN seconds, doubling with each further failure up to
MAX_BAN; a success clears its record of failures.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from swarm.records import Announcement, PeerState

EMA_WEIGHT = 0.2  # weight of the newest observation in the seconds-per-sample EMA
BASE_BAN = 5.0
MAX_BAN = 60.0
MIN_THROUGHPUT = 1e-3  # a peer announcing 0 samples/s is still routable, as a very slow one


def online_peers(announcements: Sequence[Announcement], now: float) -> list[Announcement]:
    """Peers announced online whose records have not expired."""
    return [a for a in announcements if a.state == PeerState.ONLINE and a.expiration > now]


@dataclass
class PeerRecord:
    """What one trainer knows of one peer from its own calls."""

    seconds_per_sample: float | None = None  # EMA; None until the first timed call
    outstanding: int = 0  # samples sent to it whose work there is not finished
    failures: int = 0  # consecutive failures
    banned_until: float = 0.0


class Router:
    def __init__(self) -> None:
        self.peers: dict[str, PeerRecord] = {}

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
        return rng.choice(best)

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
        per_sample = max(seconds, 1e-6) / max(samples, 1)
        if record.seconds_per_sample is None:
            record.seconds_per_sample = per_sample
        else:
            record.seconds_per_sample += EMA_WEIGHT * (per_sample - record.seconds_per_sample)
        record.failures = 0

    def failed(self, peer_id: str, now: float) -> float:
        """Ban the peer after a failure; returns the ban's length in seconds (it doubles with each failure)."""
        record = self.record(peer_id)
        record.failures += 1
        ban = min(BASE_BAN * 2 ** (record.failures - 1), MAX_BAN)
        record.banned_until = now + ban
        return ban

    def is_banned(self, peer_id: str, now: float) -> bool:
        record = self.peers.get(peer_id)
        return record is not None and record.banned_until > now

    def forget(self, keep: Collection[str]) -> None:
        """Drop what is known of peers no longer announced (records of peers long gone would pile up)."""
        self.peers = {p: r for p, r in self.peers.items() if p in keep or r.outstanding > 0}
