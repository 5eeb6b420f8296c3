"""Trainer-side choice of a peer per stage (pure functions, no I/O).

For now: a random online peer, weighted by its announced throughput, skipping peers the trainer has
banned after a failure. (A later issue replaces this with least-expected-finish-time routing.)
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from swarm.records import Announcement

MIN_WEIGHT = 1e-3  # a peer that announces 0 throughput can still be chosen, rarely


def online_peers(announcements: Sequence[Announcement], now: float) -> list[Announcement]:
    """Peers announced online whose records have not expired."""
    return [a for a in announcements if a.state == "online" and a.expiration > now]


def choose_peer(
    candidates: Sequence[Announcement], rng: random.Random, exclude: Collection[str] = ()
) -> Announcement | None:
    """A random candidate, weighted by announced throughput; None if every candidate is excluded."""
    allowed = [a for a in candidates if a.peer_id not in exclude]
    if not allowed:
        return None
    weights = [max(a.throughput, MIN_WEIGHT) for a in allowed]
    return rng.choices(allowed, weights=weights, k=1)[0]


def choose_stage_by_throughput(totals: Sequence[float], rng: random.Random) -> int:
    """The stage with the least total announced throughput; ties broken at random."""
    lowest = min(totals)
    return rng.choice([stage for stage, total in enumerate(totals) if total <= lowest * (1 + 1e-9)])
