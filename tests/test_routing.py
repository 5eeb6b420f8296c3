"""Weighted peer choice and stage choice (pure functions)."""

from __future__ import annotations

import collections
import random

from swarm.records import Announcement, TrainerReport, parse_announcement, parse_trainer_report
from swarm.routing import choose_peer, choose_stage_by_throughput, online_peers


def ann(peer_id: str, throughput: float, state: str = "online", expiration: float = 100.0) -> Announcement:
    return Announcement(peer_id=peer_id, stage=0, state=state, throughput=throughput, expiration=expiration)


def test_choice_is_weighted_by_throughput():
    rng = random.Random(0)
    peers = [ann("slow", 10.0), ann("fast", 30.0)]
    counts = collections.Counter(choose_peer(peers, rng).peer_id for _ in range(4000))
    assert 0.70 < counts["fast"] / 4000 < 0.80


def test_excluded_peers_are_never_chosen():
    rng = random.Random(0)
    peers = [ann("a", 1.0), ann("b", 1000.0)]
    assert {choose_peer(peers, rng, exclude={"b"}).peer_id for _ in range(100)} == {"a"}
    assert choose_peer(peers, rng, exclude={"a", "b"}) is None
    assert choose_peer([], rng) is None


def test_zero_throughput_peer_still_reachable():
    rng = random.Random(0)
    assert choose_peer([ann("idle", 0.0)], rng).peer_id == "idle"


def test_only_online_unexpired_peers_are_candidates():
    peers = [
        ann("on", 1),
        ann("off", 1, state="offline"),
        ann("joining", 1, state="joining"),
        ann("old", 1, expiration=5),
    ]
    assert [a.peer_id for a in online_peers(peers, now=10.0)] == ["on"]


def test_stage_choice_takes_the_least_served_stage():
    rng = random.Random(0)
    assert choose_stage_by_throughput([5.0, 1.0, 3.0], rng) == 1
    assert {choose_stage_by_throughput([0.0, 0.0], rng) for _ in range(50)} == {0, 1}


def test_malformed_announcements_are_dropped():
    good = ann("p", 3.0).to_record()
    assert parse_announcement("p", good, 0, 1.0) is not None
    assert parse_announcement("other", good, 0, 1.0) is None  # subkey must match
    assert parse_announcement("p", good, 1, 1.0) is None  # stored under another stage
    assert parse_announcement("p", {**good, "throughput": float("nan")}, 0, 1.0) is None
    assert parse_announcement("p", {**good, "state": "dancing"}, 0, 1.0) is None
    assert parse_announcement("p", {**good, "protocol_version": 99}, 0, 1.0) is None
    assert parse_announcement("p", {**good, "device": "x" * 1000}, 0, 1.0) is None
    assert parse_announcement("p", "not a dict", 0, 1.0) is None
    assert parse_announcement("p", {**good, "samples_served": float("inf")}, 0, 1.0) is None
    assert parse_announcement("p", {**good, "samples_served": "3"}, 0, 1.0) is None
    assert parse_announcement("p", {**good, "throughput": 1e308}, 0, 1.0) is None  # would swamp routing
    assert parse_announcement("p", {**good, "stage": True}, 0, 1.0) is None


def test_malformed_trainer_reports_are_dropped():
    good = TrainerReport(peer_id="t", loss=2.5, samples_per_second=10.0, samples=100).to_record()
    assert parse_trainer_report("t", good, 1.0) is not None
    assert parse_trainer_report("t", {**good, "loss": float("nan")}, 1.0) is not None  # no microbatch done yet
    for bad in (
        {"loss": float("inf")},
        {"loss": -1.0},
        {"samples": -5},
        {"samples": 1.5},
        {"failed_microbatches": None},
    ):
        assert parse_trainer_report("t", {**good, **bad}, 1.0) is None, bad
    assert parse_trainer_report("other", good, 1.0) is None
