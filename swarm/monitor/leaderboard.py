"""The volunteers' leaderboard: what each peer really did, counted across restarts of peers, trainers and monitor.

Samples served are counted by the trainers whose microbatches a peer served (each trainer's signed report has a
table of samples per serving peer since the trainer started), not only by the peer about itself. Those counts
start again at zero when a trainer or peer restarts; `advance` banks what a counter had reached when it drops,
so a total only grows. Hours online are the monitor's own observation: the time between its samples that saw
the peer online. Everything lives in the history file, so a restarted monitor keeps counting where it stopped.

A peer's own count includes what it served for its own trainer, which that trainer does not vouch for; the two
counts are compared with that taken into account, and a gap beyond noise (reports lag by an announce period,
and a trainer that restarted before the monitor first saw it took its earlier count with it) is flagged.
"""

from __future__ import annotations

from typing import Any

from swarm.dht.records import TrainerReport
from swarm.monitor.history import History
from swarm.watch.status import short_id

MAX_GAP = 60.0  # seconds: a longer pause between two samples (the monitor was down) counts as offline
NOISE_FRACTION = 0.15  # a gap of claimed vs attested samples smaller than this fraction of the larger is noise
NOISE_SAMPLES = 200  # ... or smaller than this many samples
TOP = 50


def advance(banked: int, last: int, value: int) -> tuple[int, int]:
    """A counter that restarts from zero, made monotonic: (banked, last) after it reads `value`."""
    value = max(0, int(value))
    return (banked + last, value) if value < last else (banked, value)


def disagreement(claimed: int, attested: int, self_attested: int) -> str | None:
    """None if a peer's own count matches what trainers attest (plus what its own trainer ran through it) within
    noise; else which way it is off."""
    expected = attested + self_attested
    gap = claimed - expected
    if abs(gap) <= max(NOISE_SAMPLES, NOISE_FRACTION * max(claimed, expected)):
        return None
    return "claims more than trainers attest" if gap > 0 else "trainers attest more than it claims"


class Leaderboard:
    """Counts the volunteers' work into the history's `volunteers` and `attestations` tables."""

    def __init__(self, history: History):
        self.history = history
        self.last_update: float | None = None  # None after a (re)start: the gap before it is not counted

    def update(self, document: dict[str, Any], reports: list[TrainerReport], now: float) -> None:
        elapsed = 0.0 if self.last_update is None else min(max(now - self.last_update, 0.0), MAX_GAP)
        self.last_update = now
        peers = [p for p in document["peers"] if p["status"] != "gone"]
        known = {
            row[0]: row[1:]
            for row in self.history.execute(
                "SELECT peer_id, rounds_banked, rounds_last, claimed_banked, claimed_last FROM volunteers"
            )
        }
        statements: list[tuple[str, tuple]] = []
        for p in peers:
            rounds_banked, rounds_last, claimed_banked, claimed_last = known.get(p["peer_id"], (0, 0, 0, 0))
            rounds_banked, rounds_last = advance(rounds_banked, rounds_last, p["averaging_rounds"])
            claimed_banked, claimed_last = advance(claimed_banked, claimed_last, p["samples_served"])
            online = p["status"] == "online"
            statements.append((
                """INSERT INTO volunteers (peer_id, public_name, stage, first_seen, last_seen, online_seconds,
                       rounds_banked, rounds_last, claimed_banked, claimed_last) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (peer_id) DO UPDATE SET
                       public_name = CASE WHEN excluded.public_name != '' THEN excluded.public_name ELSE public_name END,
                       stage = excluded.stage, last_seen = CASE WHEN ? THEN excluded.last_seen ELSE last_seen END,
                       online_seconds = online_seconds + excluded.online_seconds,
                       rounds_banked = excluded.rounds_banked, rounds_last = excluded.rounds_last,
                       claimed_banked = excluded.claimed_banked, claimed_last = excluded.claimed_last""",
                (p["peer_id"], p["public_name"], p["stage"], now, now, elapsed if online else 0.0,
                 rounds_banked, rounds_last, claimed_banked, claimed_last, online),
            ))  # fmt: skip
        attested = {
            (row[0], row[1]): row[2:]
            for row in self.history.execute("SELECT trainer_id, peer_id, banked, last FROM attestations")
        }
        for report in reports:
            own = ((report.peer_id, report.own_samples),) if report.own_samples else ()
            for peer_id, samples in (*report.served, *own):
                banked, last = advance(*attested.get((report.peer_id, peer_id), (0, 0)), min(samples, report.samples))
                statements.append((
                    "INSERT OR REPLACE INTO attestations (trainer_id, peer_id, banked, last) VALUES (?, ?, ?, ?)",
                    (report.peer_id, peer_id, banked, last),
                ))  # fmt: skip
        self.history.executemany(statements)

    def rows(self, top: int = TOP) -> list[dict[str, Any]]:
        """The volunteers, the most attested samples first."""
        attested: dict[str, int] = {}
        self_attested: dict[str, int] = {}
        for trainer_id, peer_id, total in self.history.execute(
            "SELECT trainer_id, peer_id, banked + last FROM attestations"
        ):
            into = self_attested if trainer_id == peer_id else attested
            into[peer_id] = into.get(peer_id, 0) + total
        rows = []
        for peer_id, name, stage, first_seen, last_seen, online_seconds, rounds, claimed in self.history.execute(
            """SELECT peer_id, public_name, stage, first_seen, last_seen, online_seconds, rounds_banked + rounds_last,
                      claimed_banked + claimed_last FROM volunteers"""
        ):
            rows.append({
                "peer_id": peer_id, "short_id": short_id(peer_id), "public_name": name, "stage": stage,
                "attested_samples": attested.get(peer_id, 0), "own_trainer_samples": self_attested.get(peer_id, 0),
                "claimed_samples": claimed, "hours_online": round(online_seconds / 3600, 3),
                "averaging_rounds": rounds, "first_seen": first_seen, "last_seen": last_seen,
                "disagreement": disagreement(claimed, attested.get(peer_id, 0), self_attested.get(peer_id, 0)),
            })  # fmt: skip
        rows.sort(key=lambda r: (-r["attested_samples"], -r["hours_online"], r["peer_id"]))
        for rank, row in enumerate(rows, start=1):
            row["rank"] = rank
        return rows[:top]
