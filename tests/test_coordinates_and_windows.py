"""Pure logic of issue 14's routing: network coordinates (Vivaldi), the adaptive window, routes by expected time."""

from __future__ import annotations

import math
import random

import pytest

from swarm.client.window import AdaptiveWindow
from swarm.dht.records import Announcement, PeerState
from swarm.errors import MalformedDataError
from swarm.network.coordinates import Coordinate, Vivaldi, round_trip
from swarm.routing import ORIGIN, Router


def test_vivaldi_learns_the_round_trips_of_peers_it_never_measured_directly():
    # eight peers spread over a plane (up to 100 ms apart), each with an access link of its own (2 to 20 ms)
    rng = random.Random(0)
    places = [(rng.uniform(0, 0.1), rng.uniform(0, 0.1)) for _ in range(8)]
    access = [rng.uniform(0.002, 0.02) for _ in range(8)]
    truth = [[math.dist(places[i], places[j]) + access[i] + access[j] for j in range(8)] for i in range(8)]
    held_out = {(0, 7), (1, 6), (2, 5), (3, 4)}  # these pairs never measure each other
    peers = [Vivaldi(random.Random(i)) for i in range(8)]
    for _ in range(4000):
        i, j = rng.sample(range(8), 2)
        if (min(i, j), max(i, j)) not in held_out:
            peers[i].observe(peers[j].coordinate, truth[i][j] * rng.uniform(0.95, 1.05))  # noisy measurements
    errors = [
        abs(round_trip(peers[i].coordinate, peers[j].coordinate) - truth[i][j]) / truth[i][j] for i, j in held_out
    ]
    assert sum(errors) / len(errors) < 0.2, errors
    assert all(p.coordinate.known and p.coordinate.error < 0.3 for p in peers)


def test_coordinates_from_records_are_checked():
    good = Coordinate((0.01, -0.02), 0.005, 0.2)
    assert Coordinate.from_record(good.to_record()) == good
    for bad in [None, [], [1, 2, 3], [0, 0, 0, 0, 0], ["a", 0, 0, 0], [math.nan, 0, 0, 0], [1e9, 0, 0, 0]]:
        with pytest.raises(MalformedDataError):
            Coordinate.from_record(bad)
    assert Vivaldi().coordinate.known is False
    v = Vivaldi()
    v.observe(Coordinate(), 1e6)  # absurd round trips are ignored
    assert v.samples == 0


def test_window_grows_to_fill_the_pipe_and_shrinks_when_microbatches_queue():
    window = AdaptiveWindow(maximum=16)
    now = 0.0
    for _ in range(200):  # round trips stay at the pipe's base: nothing queues, so it grows to the maximum
        now += 0.1
        window.observe(0.3, now)
    assert window.size == 16
    for _ in range(200):  # now every microbatch waits twice the base in queues: it shrinks (within 30 s, before
        # the base forgets the shorter round trips)
        now += 0.1
        window.observe(0.9, now)
    assert window.size < 8
    window.failed()
    assert window.size >= 1
    # a route of 3 stages keeps 1-2 queued per stage: round trips 1.5x the base at a window of 6 (2 queued) let it
    # grow, where a one-stage route shrinks
    for stages, grows in ((3, True), (1, False)):
        route = AdaptiveWindow(maximum=16, stages=stages)
        route.size, now = 6, 0.0
        route.observe(1.0, now)  # the base
        for _ in range(12):
            now += 0.1
            route.observe(1.5, now)
        assert (route.size > 6) == grows, (stages, route.size)
    # a GPU swarm's long route: nothing queues yet, so the window doubles per window of completions (slow start)
    # and reaches 64 after about 64 completions, not the ~2,000 that growing by one would take
    gpu = AdaptiveWindow(maximum=64, stages=4)
    completions = 0
    while gpu.size < 64:
        completions += 1
        gpu.observe(2.0, completions * 0.01)
    assert completions < 80, completions
    gpu.busy()  # stage 0 said busy: one fewer, and it grows by one at a time from here
    assert gpu.size == 63 and not gpu.slow_start
    fixed = AdaptiveWindow(maximum=4, adaptive=False)
    fixed.observe(5.0, 1.0)
    assert fixed.size == 4


def announcement(peer_id: str, stage: int, coordinate: Coordinate | None = None, network: float = 0.0) -> Announcement:
    return Announcement(
        peer_id=peer_id,
        stage=stage,
        state=PeerState.ONLINE,
        throughput=100.0,
        compute_throughput=100.0,
        network_throughput=network,
        coordinate=coordinate,
        expiration=1e12,
    )


def test_routes_avoid_far_peers_when_the_network_counts_and_not_when_it_does_not():
    near, far = Coordinate((0.0, 0.0), 0.005, 0.1), Coordinate((1.0, 0.0), 0.005, 0.1)  # 1 s apart
    stages = [
        [announcement("a0", 0, near)],
        [announcement("near", 1, near), announcement("far", 1, far)],
        [announcement("c0", 2, near)],
    ]
    aware = Router(network_aware=True)
    routes = [aware.choose_route(stages, 8, 0.0, random.Random(i), origin=near) for i in range(20)]
    assert all([a.peer_id for a in r] == ["a0", "near", "c0"] for r in routes)
    blind = Router(network_aware=False)
    middles = {blind.choose_route(stages, 8, 0.0, random.Random(i))[1].peer_id for i in range(40)}
    assert middles == {"near", "far"}  # the same to it: ties broken at random


def test_observed_transfers_outweigh_estimates_and_queues_spill_work_to_slower_peers():
    stages = [[announcement("a", 0)], [announcement("fast", 1), announcement("slow", 1)]]
    router = Router()
    router.observed_hop(ORIGIN, "a", 8, 0.01, 0.001)
    router.observed_hop("a", "fast", 8, 0.01, 0.02)
    router.observed_hop("a", "slow", 8, 0.01, 0.2)  # ten times the transfer
    rng = random.Random(0)
    assert [p.peer_id for p in router.choose_route(stages, 8, 0.0, rng)] == ["a", "fast"]
    router.started("fast", 8 * 30)  # a long queue at the fast one: the slow one is worth it now
    assert [p.peer_id for p in router.choose_route(stages, 8, 0.0, rng)] == ["a", "slow"]
    router.failed("a", 0.0)  # a banned stage 0: no route
    assert router.choose_route(stages, 8, 1.0, rng) == []
    stages_without_last = [[announcement("b", 0)], []]
    assert [p.peer_id for p in router.choose_route(stages_without_last, 8, 0.0, rng)] == ["b"]
