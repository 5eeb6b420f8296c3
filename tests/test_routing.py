"""Trainer-side routing (least expected finish time, bans) and announcement validation: pure logic."""

from __future__ import annotations

import collections
import dataclasses
import random

from swarm.dht.records import Announcement, TrainerReport, announceable, parse_announcement, parse_trainer_report
from swarm.routing import BASE_BAN, MAX_BAN, REPROBE_AFTER, WASTE_FACTOR, Router, online_peers


def ann(peer_id: str, throughput: float = 10.0, state: str = "online", expiration: float = 100.0) -> Announcement:
    return Announcement(peer_id=peer_id, stage=0, state=state, throughput=throughput, expiration=expiration)


def test_the_peer_that_would_finish_first_is_chosen():
    router, rng = Router(), random.Random(0)
    router.observed("slow", samples=8, seconds=0.8)  # 0.1 s per sample
    router.observed("fast", samples=8, seconds=0.2)  # 0.025 s per sample
    peers = [ann("slow"), ann("fast")]
    assert router.choose(peers, 8, now=0.0, rng=rng).peer_id == "fast"
    router.started("fast", 40)  # work outstanding there: (40 + 8) x 0.025 = 1.2 s, against 8 x 0.1 = 0.8 s
    assert router.choose(peers, 8, now=0.0, rng=rng).peer_id == "slow"
    router.finished("fast", 40)
    assert router.choose(peers, 8, now=0.0, rng=rng).peer_id == "fast"


def test_load_spreads_in_proportion_to_observed_speed():
    """Sending to the least expected finish time, with work staying outstanding, splits load by speed."""
    router, rng = Router(), random.Random(0)
    router.observed("a", 1, 0.01)
    router.observed("b", 1, 0.03)  # three times slower
    counts = collections.Counter()
    for _ in range(400):
        chosen = router.choose([ann("a"), ann("b")], 1, now=0.0, rng=rng).peer_id
        router.started(chosen, 1)
        counts[chosen] += 1
    assert 0.70 < counts["a"] / 400 < 0.80


def test_untried_peers_are_tried_early():
    router, rng = Router(), random.Random(0)
    router.observed("known", 8, 0.8)
    router.started("known", 8)
    # the new peer is assumed as fast as the fastest known one, and has nothing outstanding
    assert router.choose([ann("known"), ann("new", throughput=0.001)], 8, now=0.0, rng=rng).peer_id == "new"


def test_a_replica_timed_slow_once_is_tried_again_and_its_new_timing_replaces_the_old():
    """One slow call (a replica paused by an averaging round) must not leave it out for good: after REPROBE_AFTER
    choices without it, it is tried again, and what it does then is what counts."""
    router, rng = Router(), random.Random(0)
    router.observed("paused", 8, 8.0)  # 1 s per sample: timed during a pause
    router.observed("steady", 8, 0.8)
    peers = [ann("paused"), ann("steady")]
    picks = [router.choose(peers, 8, now=0.0, rng=rng).peer_id for _ in range(REPROBE_AFTER + 8)]
    assert picks[:REPROBE_AFTER] == ["steady"] * REPROBE_AFTER  # nothing outstanding: the faster one every time
    assert picks[REPROBE_AFTER:].count("paused") == 1  # then tried again, once until its new timing comes
    router.observed("paused", 8, 0.4)  # it is fast now: the old 1 s per sample is not blended in
    assert router.peers["paused"].seconds_per_sample == 0.05
    assert router.choose(peers, 8, now=0.0, rng=rng).peer_id == "paused"


def test_a_route_tries_again_a_replica_it_left_out_for_long():
    router, rng = Router(), random.Random(0)
    stages = [[ann("paused"), ann("steady")], [ann("last")]]
    router.observed_hop("", "paused", 8, compute=0.8, transfer=7.2)  # the pause counted as the transfer to it
    router.observed_hop("", "steady", 8, compute=0.8, transfer=0.0)
    router.observed_hop("paused", "last", 8, compute=0.8, transfer=9.0)  # and from it onwards
    router.observed_hop("steady", "last", 8, compute=0.8, transfer=0.0)
    firsts = [router.choose_route(stages, 8, 0.0, rng)[0].peer_id for _ in range(REPROBE_AFTER + 8)]
    assert firsts[:REPROBE_AFTER] == ["steady"] * REPROBE_AFTER and firsts[REPROBE_AFTER] == "paused"
    router.observed_hop("", "paused", 8, compute=0.4, transfer=0.0)  # its new timings replace the old ones
    router.observed_hop("paused", "last", 8, compute=0.8, transfer=0.1)
    assert router.peers["paused"].compute_per_sample == 0.05 and router.transfers[("paused", "last")] == 0.1
    assert router.choose_route(stages, 8, 0.0, rng)[0].peer_id == "paused"


def test_with_no_observation_announced_throughput_decides_and_ties_are_random():
    router, rng = Router(), random.Random(0)
    assert router.choose([ann("a", 5.0), ann("b", 50.0)], 8, now=0.0, rng=rng).peer_id == "b"
    picks = {router.choose([ann("a", 5.0), ann("b", 5.0)], 8, now=0.0, rng=rng).peer_id for _ in range(50)}
    assert picks == {"a", "b"}


def test_bans_grow_with_repeated_failures_and_a_success_clears_them():
    router, rng = Router(), random.Random(0)
    bans = [router.failed("p", now=0.0) for _ in range(8)]
    assert bans[0] == BASE_BAN and bans[1] == 2 * BASE_BAN and bans[2] == 4 * BASE_BAN
    assert bans[-1] == MAX_BAN and bans == sorted(bans)
    assert router.is_banned("p", now=MAX_BAN - 1) and not router.is_banned("p", now=MAX_BAN + 1)
    assert router.choose([ann("p")], 8, now=1.0, rng=rng) is None
    router.observed("p", 8, 0.1)
    assert router.failed("p", now=100.0) == BASE_BAN


def test_a_peer_that_kept_the_caller_waiting_is_banned_in_proportion_to_the_wait():
    """A black hole that held a call for 11 s is left out for WASTE_FACTOR x 11 s, not BASE_BAN: it costs the
    caller at most 1 / (1 + WASTE_FACTOR) of its time; a quick failure keeps the short, doubling ban."""
    router = Router()
    assert router.failed("hole", now=0.0, wasted=11.0) == WASTE_FACTOR * 11.0 > 2 * BASE_BAN
    assert router.is_banned("hole", now=WASTE_FACTOR * 11.0 - 1)
    assert router.failed("hole", now=50.0, wasted=30.0) == MAX_BAN  # capped like every ban
    assert router.failed("quick", now=0.0, wasted=0.1) == BASE_BAN


def test_excluded_peers_are_never_chosen():
    router, rng = Router(), random.Random(0)
    peers = [ann("a", 1.0), ann("b", 1000.0)]
    assert {router.choose(peers, 8, 0.0, rng, exclude={"b"}).peer_id for _ in range(20)} == {"a"}
    assert router.choose(peers, 8, 0.0, rng, exclude={"a", "b"}) is None
    assert router.choose([], 8, 0.0, rng) is None


def test_zero_throughput_peer_still_reachable():
    assert Router().choose([ann("idle", 0.0)], 8, 0.0, random.Random(0)).peer_id == "idle"


def test_only_online_unexpired_peers_are_candidates():
    peers = [
        ann("on", 1),
        ann("off", 1, state="offline"),
        ann("joining", 1, state="joining"),
        ann("old", 1, expiration=5),
    ]
    assert [a.peer_id for a in online_peers(peers, now=10.0)] == ["on"]


def test_forget_keeps_peers_with_work_outstanding():
    router = Router()
    router.observed("gone", 1, 0.1)
    router.started("busy", 4)
    router.observed("here", 1, 0.1)
    router.forget(keep={"here"})
    assert set(router.peers) == {"busy", "here"}


PEER = "12D3KooWEKYnHv3sXsjiyHYCaWwTAudbWmyGtnL2RZJUbA9FnEdV"


def test_malformed_announcements_are_dropped():
    good = ann(PEER, 3.0).to_record()
    assert parse_announcement(PEER, good, 0, 1.0) is not None
    assert parse_announcement("other", good, 0, 1.0) is None  # subkey must match
    assert parse_announcement(PEER, good, 1, 1.0) is None  # stored under another stage
    for bad in (
        {"throughput": float("nan")},
        {"throughput": 1e308},  # would swamp routing and balancing
        {"compute_throughput": -1.0},
        {"delivered_throughput": "fast"},
        {"state": "dancing"},
        {"protocol_version": 99},
        {"device": "x" * 1000},
        {"public_name": None},
        {"samples_served": float("inf")},
        {"samples_served": "3"},
        {"outstanding": -1},
        {"uptime": float("nan")},
        {"pinned": "yes"},
        {"stage": True},
        {"public_name": "\x1b[2Jhello"},  # terminal escapes never reach peer-status's screen
        {"device": "gpu\n"},
        {"reachable": "no"},
        {"maddrs": "/ip4/1.2.3.4/tcp/1"},
        {"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 9},
        {"maddrs": [7]},
    ):
        assert parse_announcement(PEER, {**good, **bad}, 0, 1.0) is None, bad
    for peer_id in ("[/]", "p", "12D3KooW0OIl" + "x" * 10):  # not base58: never shown, keyed or dialed
        assert parse_announcement(peer_id, {**good, "peer_id": peer_id}, 0, 1.0) is None, peer_id
    missing = dict(good)
    del missing["network_throughput"]
    assert parse_announcement(PEER, missing, 0, 1.0) is None
    assert parse_announcement(PEER, "not a dict", 0, 1.0) is None
    older = {k: v for k, v in good.items() if k not in ("reachable", "maddrs")}  # before these fields existed
    assert parse_announcement(PEER, older, 0, 1.0).reachable is True


def test_announcements_stay_small():
    record = Announcement(
        peer_id="12D3KooW" + "x" * 44,
        stage=3,
        state="online",
        throughput=1e6,
        public_name="n" * 64,
        device="d" * 128,
        maddrs=tuple(f"/ip4/203.0.113.{i}/tcp/31337/p2p/12D3KooW" + "x" * 44 for i in range(8)),
    ).to_record()
    from hivemind.utils import MSGPackSerializer

    assert len(MSGPackSerializer.dumps(record)) < 2048  # DHT values over ~64 KB hang


def test_announceable_addresses_fit_a_record():
    long = "/dns4/" + "a" * 300 + "/tcp/1"
    addrs = ["/ip4/127.0.0.1/tcp/1", long, *[f"/ip4/10.0.0.{i}/tcp/1" for i in range(10)]]
    announced = announceable(addrs)
    assert len(announced) == 8 and long not in announced and "/ip4/127.0.0.1/tcp/1" not in announced
    assert announceable(["/ip4/127.0.0.1/tcp/1"]) == ("/ip4/127.0.0.1/tcp/1",)  # loopback only: still announced
    # a peer with a public address announces no loopback one, even with room left (issue 33: it did)
    public = ["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip6/::1/tcp/1/p2p/Qm", "/ip4/203.0.113.7/tcp/1/p2p/Qm"]
    assert announceable(public) == ("/ip4/203.0.113.7/tcp/1/p2p/Qm",)
    record = dataclasses.replace(ann(PEER), maddrs=announced).to_record()
    assert parse_announcement(PEER, record, 0, 1.0).maddrs == announced


def test_malformed_trainer_reports_are_dropped():
    good = TrainerReport(peer_id=PEER, loss=2.5, samples_per_second=10.0, samples=100).to_record()
    assert parse_trainer_report(PEER, good, 1.0) is not None
    assert parse_trainer_report(PEER, {**good, "loss": float("nan")}, 1.0) is not None  # no microbatch done yet
    for bad in (
        {"loss": float("inf")},
        {"loss": -1.0},
        {"samples": -5},
        {"samples": 1.5},
        {"failed_microbatches": None},
        {"maddrs": [None]},
    ):
        assert parse_trainer_report(PEER, {**good, **bad}, 1.0) is None, bad
    assert parse_trainer_report("other", good, 1.0) is None
