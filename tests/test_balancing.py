"""Stage choice, move plans, the optimum and efficiency (pure functions)."""

from __future__ import annotations

import collections
import itertools
import random
import time
from collections.abc import Callable, Sequence

import pytest

from swarm.balancing.moves import (
    Move,
    PeerLoad,
    apply_moves,
    bottleneck,
    choose_stage,
    plan_moves,
    should_move,
    stage_holders,
    stage_totals,
    worthwhile_moves,
)
from swarm.balancing.optimum import EXACT_LIMIT, efficiency, optimal_assignment, upper_bound
from swarm.errors import BalancingError


def swarm(*stages: Sequence[float]) -> list[PeerLoad]:
    """Online movable peers, named s{stage}p{index}, from one list of throughputs per stage."""
    return [PeerLoad(f"s{stage}p{i}", stage, t) for stage, speeds in enumerate(stages) for i, t in enumerate(speeds)]


def random_swarm(rng: random.Random, num_peers: int, num_stages: int) -> list[PeerLoad]:
    return [
        PeerLoad(
            f"peer{i:03d}",
            rng.randrange(num_stages),
            rng.lognormvariate(0, 1),
            online=rng.random() < 0.8,
            movable=rng.random() < 0.9,
        )
        for i in range(num_peers)
    ]


def brute_force_optimum(throughputs: Sequence[float], num_stages: int) -> float:
    best = 0.0
    # the first peer's stage can stay fixed: renaming stages changes nothing
    for rest in itertools.product(range(num_stages), repeat=len(throughputs) - 1):
        totals = [0.0] * num_stages
        for t, stage in zip(throughputs, (0, *rest)):
            totals[stage] += t
        best = max(best, min(totals))
    return best


def swarm_of(throughputs: Sequence[float], stages: Sequence[int]) -> list[PeerLoad]:
    return [PeerLoad(f"p{i}", stage, t) for i, (t, stage) in enumerate(zip(throughputs, stages))]


# the example of the design: speeds 1,1,1,1,2,2,4,4 over 4 stages, badly started (totals 3, 3, 5, 5)
BAD_START = swarm([1, 2], [1, 2], [1, 4], [1, 4])


def test_stage_totals_count_joining_peers_and_ignore_unknown_stages():
    peers = [
        PeerLoad("a", 0, 1.5),
        PeerLoad("b", 0, 2.0, online=False),
        PeerLoad("c", 2, 4.0, movable=False),
        PeerLoad("d", 7, 100.0),  # a stage this swarm does not have
    ]
    assert stage_totals(peers, 3) == [3.5, 0.0, 4.0]
    assert bottleneck([3.5, 0.0, 4.0]) == 0.0
    assert bottleneck(stage_totals(BAD_START, 4)) == 3


@pytest.mark.parametrize("throughput", [-1.0, float("nan"), float("inf")])
def test_bad_throughputs_are_refused(throughput):
    with pytest.raises(BalancingError, match="throughput"):
        PeerLoad("a", 0, throughput)


def test_choose_stage_takes_the_lowest_total():
    rng = random.Random(0)
    assert {choose_stage(BAD_START, 4, rng) for _ in range(50)} == {0, 1}
    assert choose_stage(swarm([5], [1], [3]), 3, rng) == 1
    assert choose_stage(swarm([5], [], [3]), 3, rng) == 1  # an unserved stage first


def test_choose_stage_breaks_ties_at_random():
    rng = random.Random(0)
    counts = collections.Counter(choose_stage(swarm([2], [1, 1], [3]), 3, rng) for _ in range(1000))
    assert set(counts) == {0, 1}
    assert 400 < counts[0] < 600


def test_choose_stage_leaves_out_the_asking_peer():
    peers = swarm([3], [2])
    rng = random.Random(0)
    assert choose_stage(peers, 2, rng) == 1
    # s0p0 re-checking its own choice: without itself stage 0 is empty, so stage 0 is where it helps most
    assert choose_stage(peers, 2, rng, exclude_peer="s0p0") == 0


def test_plan_reaches_the_optimum_of_the_example_in_two_moves():
    moves = plan_moves(BAD_START, 4)
    assert len(moves) == 2
    assert {m.source for m in moves} == {2, 3}
    assert {m.target for m in moves} == {0, 1}
    assert {m.peer_id for m in moves} == {"s2p0", "s3p0"}  # the two 1s (moving a 4 would empty too much)
    assert stage_totals(apply_moves(BAD_START, moves), 4) == [4, 4, 4, 4]


def test_plan_on_a_balanced_swarm_is_empty():
    optimal = swarm([1, 1, 2], [4], [1, 1, 2], [4])
    assert plan_moves(optimal, 4) == []
    assert plan_moves(apply_moves(BAD_START, plan_moves(BAD_START, 4)), 4) == []
    assert should_move("s0p0", optimal, 4, min_gain=0.0) is None


def test_plan_is_the_same_whatever_the_order_of_the_records():
    rng = random.Random(1)
    peers = random_swarm(rng, 60, 5)
    plan = plan_moves(peers, 5)
    assert plan  # a random start is never balanced
    for _ in range(5):
        shuffled = peers.copy()
        rng.shuffle(shuffled)
        assert plan_moves(shuffled, 5) == plan


def test_plan_never_takes_the_last_online_peer_of_a_stage():
    # stage 0's only online peer is the 10; the 5 is still joining, so it does not count as serving stage 0
    assert plan_moves([PeerLoad("big", 0, 10.0), PeerLoad("new", 0, 5.0, online=False), PeerLoad("x", 1, 1.0)], 2) == []
    assert plan_moves(swarm([10], [1]), 2) == []
    # with a second online peer, one may go
    assert plan_moves(swarm([10, 5], [1]), 2) == [Move("s0p1", 0, 1)]


def test_plan_never_moves_pinned_or_joining_peers():
    pinned = [PeerLoad("a", 0, 4.0, movable=False), PeerLoad("b", 0, 4.0, movable=False), PeerLoad("c", 1, 1.0)]
    assert plan_moves(pinned, 2) == []
    joining = [PeerLoad("a", 0, 4.0), PeerLoad("b", 0, 4.0, online=False), PeerLoad("c", 1, 1.0)]
    assert plan_moves(joining, 2) == []


def test_plan_properties_on_random_swarms():
    """Never a pinned or joining peer, never a stage left without online peers, never a lower bottleneck."""
    for seed in range(200):
        rng = random.Random(seed)
        num_stages = rng.randint(2, 6)
        peers = random_swarm(rng, rng.randint(1, 30), num_stages)
        moves = plan_moves(peers, num_stages)
        by_id = {p.peer_id: p for p in peers}
        assert len({m.peer_id for m in moves}) == len(moves)
        for move in moves:
            peer = by_id[move.peer_id]
            assert peer.online and peer.movable and move.source == peer.stage != move.target
        after = apply_moves(peers, moves)
        served_before = {p.stage for p in peers if p.online}
        served_after = {p.stage for p in after if p.online}
        assert served_before <= served_after
        assert bottleneck(stage_totals(after, num_stages)) >= bottleneck(stage_totals(peers, num_stages))
        assert sorted(stage_totals(after, num_stages)) >= sorted(stage_totals(peers, num_stages))


def test_an_unserved_stage_gets_a_peer_whenever_another_stage_can_spare_one():
    assert plan_moves(swarm([1, 1], [], [5]), 3) == [Move("s0p0", 0, 1)]
    # even a tiny gain counts when the bottleneck is 0
    assert [m.target for m in plan_moves(swarm([100, 0.001], []), 2)] == [1]
    for seed in range(100):
        rng = random.Random(seed)
        peers = [PeerLoad(f"p{i}", rng.randrange(3), rng.uniform(0.1, 2)) for i in range(rng.randint(4, 8))]
        totals = stage_totals(apply_moves(peers, plan_moves(peers, 4)), 4)
        assert totals[3] > 0  # stage 3 started unserved; 4 peers or more over stages 0-2: one has two


def thin_stages(peers: list[PeerLoad], num_stages: int) -> int:
    """Online holders missing below two, summed over the stages."""
    return sum(max(0, 2 - count) for count in stage_holders([p for p in peers if p.online], num_stages))


def test_a_stage_held_once_gets_a_second_holder_before_throughput_counts():
    """min_holders 2: a joiner takes the thin stage though another has less throughput; a plan gives a stage held
    once a second holder (the slowest peer of the stage with most peers) though the bottleneck falls; and no move
    leaves a stage thin to balance throughput, unless it ends another's thinness."""
    rng = random.Random(0)
    assert choose_stage(swarm([5, 5], [20]), 2, rng) == 0  # by throughput alone
    assert choose_stage(swarm([5, 5], [20]), 2, rng, min_holders=2) == 1
    assert choose_stage(swarm([5, 5], [20]), 2, rng, allowed=[0], min_holders=2) == 0  # memory still decides
    assert plan_moves(swarm([1, 2, 3], [10]), 2) == []  # a move would lower the bottleneck
    assert plan_moves(swarm([1, 2, 3], [10]), 2, min_holders=2) == [Move("s0p0", 0, 1)]
    assert worthwhile_moves(swarm([1, 2, 3], [10]), 2, min_gain=0.05, min_holders=2) == [Move("s0p0", 0, 1)]
    assert should_move("s0p0", swarm([1, 2, 3], [10]), 2, min_gain=0.05, min_holders=2) == 1
    # two stages of two: moving a fast peer to the weak stage would leave its own held once
    assert plan_moves(swarm([10, 10], [1, 1]), 2) != [] and plan_moves(swarm([10, 10], [1, 1]), 2, min_holders=2) == []
    # 3 peers, 2 stages: one stage is thin whatever happens, so throughput decides
    assert plan_moves(swarm([10, 10], [1]), 2, min_holders=2) == plan_moves(swarm([10, 10], [1]), 2) != []
    for seed in range(200):
        rng = random.Random(seed)
        num_stages = rng.randint(2, 6)
        peers = random_swarm(rng, rng.randint(1, 30), num_stages)
        after = apply_moves(peers, plan_moves(peers, num_stages, min_holders=2))
        assert thin_stages(after, num_stages) <= thin_stages(peers, num_stages)
        assert {p.stage for p in peers if p.online} <= {p.stage for p in after if p.online}


def test_plan_steps_are_capped():
    assert len(plan_moves(BAD_START, 4, max_steps=1)) == 1
    assert plan_moves(BAD_START, 4, max_steps=0) == []


def test_plan_is_fast_for_a_thousand_peers():
    # CPU time of this process, not wall time: other tests' peers share the cores (pytest-xdist)
    rng = random.Random(0)
    for num_stages in (8, 32):
        peers = [PeerLoad(f"p{i:04d}", rng.randrange(num_stages), rng.lognormvariate(0, 1)) for i in range(1000)]
        everyone_on_stage_0 = [PeerLoad(p.peer_id, 0, p.throughput) for p in peers]
        for start in (peers, everyone_on_stage_0):
            began = time.process_time()
            moves = plan_moves(start, num_stages)
            assert time.process_time() - began < 1.0
            assert moves
        assert efficiency(apply_moves(peers, plan_moves(peers, num_stages)), num_stages) > 0.95


def test_should_move_only_the_planned_peers():
    targets = {p.peer_id: should_move(p.peer_id, BAD_START, 4, min_gain=0.05) for p in BAD_START}
    assert {peer: t for peer, t in targets.items() if t is not None} == {
        m.peer_id: m.target for m in plan_moves(BAD_START, 4)
    }
    assert should_move("nobody", BAD_START, 4, min_gain=0.05) is None


def test_should_move_waits_for_a_gain_above_min_gain():
    peers = swarm([100, 6], [97])  # moving the 6 raises the bottleneck from 97 to 100: +3.1%
    assert plan_moves(peers, 2) == [Move("s0p1", 0, 1)]
    assert should_move("s0p1", peers, 2, min_gain=0.05) is None
    assert worthwhile_moves(peers, 2, min_gain=0.05) == []
    assert should_move("s0p1", peers, 2, min_gain=0.02) == 1
    # an unserved stage is always worth filling
    assert should_move("s0p0", swarm([1, 1], []), 2, min_gain=10.0) == 1


def test_optimal_assignment_matches_brute_force():
    for case in range(200):
        rng = random.Random(case)
        num_stages = rng.randint(2, 4)
        kind = case % 3  # real speeds, small integers (many ties), one decimal
        throughputs = [
            rng.lognormvariate(0, 1)
            if kind == 0
            else float(rng.randint(0, 5))
            if kind == 1
            else round(rng.uniform(0, 3), 1)
            for _ in range(rng.randint(num_stages, 8))
        ]
        stages, value = optimal_assignment(throughputs, num_stages)
        best = brute_force_optimum(throughputs, num_stages)
        assert value == pytest.approx(best, rel=1e-9, abs=1e-12), (throughputs, num_stages)
        assert bottleneck(stage_totals(swarm_of(throughputs, stages), num_stages)) == pytest.approx(value)
        assert upper_bound(throughputs, num_stages) >= best - 1e-9


def test_optimal_assignment_with_fewer_peers_than_stages_is_zero():
    assert optimal_assignment([5.0, 3.0], 3) == ([0, 1], 0.0)
    assert optimal_assignment([], 2) == ([], 0.0)
    assert upper_bound([5.0, 3.0], 3) == 0.0
    with pytest.raises(BalancingError, match="at least one stage"):
        optimal_assignment([5.0, 3.0], 0)


def test_upper_bound_accounts_for_peers_too_fast_to_share():
    assert upper_bound([10.0, 1.0, 1.0], 2) == 2.0  # not 6: the 10 cannot be split
    assert upper_bound([1.0, 1.0, 1.0, 1.0], 2) == 2.0


@pytest.mark.parametrize("num_stages", [2, 4])
def test_exact_optimum_is_fast_enough_at_the_limit(num_stages):
    # the hardest kinds measured: uniform speeds (no perfect split to stop at early, so the search must prove
    # its answer) and nearly equal speeds (identical GPUs); worst of several hundred cases about 0.37 s. CPU time
    # of this process, not wall time: other tests' peers share the cores (pytest-xdist)
    slowest = 0.0
    for seed in range(3):
        rng = random.Random(seed)
        for throughputs in (
            [rng.uniform(0.5, 1.5) for _ in range(EXACT_LIMIT)],
            [100 * (1 + 0.01 * rng.random()) for _ in range(EXACT_LIMIT)],
        ):
            began = time.process_time()
            _, value = optimal_assignment(throughputs, num_stages)
            slowest = max(slowest, time.process_time() - began)
            assert value <= upper_bound(throughputs, num_stages) + 1e-9
    assert slowest < 1.5  # margin for slow CI machines


@pytest.mark.parametrize("num_stages", [8, 32])
def test_heuristic_optimum_is_near_the_upper_bound_for_a_thousand_peers(num_stages):
    rng = random.Random(num_stages)
    throughputs = [rng.lognormvariate(0, 1) for _ in range(1000)]
    began = time.process_time()  # CPU time, not wall time: other tests' peers share the cores (pytest-xdist)
    stages, value = optimal_assignment(throughputs, num_stages)
    assert time.process_time() - began < 2.0
    assert value >= 0.98 * upper_bound(throughputs, num_stages)
    assert set(stages) == set(range(num_stages))
    assert bottleneck(stage_totals(swarm_of(throughputs, stages), num_stages)) == pytest.approx(value)


def test_efficiency():
    assert efficiency(BAD_START, 4) == pytest.approx(3 / 4)
    assert efficiency(apply_moves(BAD_START, plan_moves(BAD_START, 4)), 4) == pytest.approx(1.0)
    assert efficiency(swarm([1, 1], []), 2) == 0.0
    assert efficiency(swarm([1], []), 2) == 1.0  # nothing better is possible with one peer
    assert efficiency([], 2) == 1.0
    for seed in range(50):
        rng = random.Random(seed)
        num_stages = rng.randint(1, 6)
        value = efficiency(random_swarm(rng, rng.randint(1, 40), num_stages), num_stages)
        assert 0.0 <= value <= 1.0


# --- Oscillation: a naive rule flips back and forth, the plan settles ---

Rule = Callable[[str, list[PeerLoad], int], int | None]


def naive_target(peer_id: str, peers: list[PeerLoad], num_stages: int) -> int | None:
    """Petals-like/SWARM-like: move to the bottleneck stage whenever my stage has the highest total and I am
    not alone there."""
    totals = stage_totals(peers, num_stages)
    me = next(p for p in peers if p.peer_id == peer_id)
    alone = sum(p.stage == me.stage for p in peers) == 1
    target = min(range(num_stages), key=totals.__getitem__)
    if totals[me.stage] == max(totals) and not alone and target != me.stage:
        return target
    return None


def planned_target(peer_id: str, peers: list[PeerLoad], num_stages: int) -> int | None:
    return should_move(peer_id, peers, num_stages, min_gain=0.05)


def simulate(
    peers: list[PeerLoad], num_stages: int, rule: Rule, rounds: int, seed: int, concurrent: bool
) -> tuple[list[int], list[PeerLoad]]:
    """Rounds of checks, each peer once per round in random order. Sequential: each peer decides from the
    current records and moves at once. Concurrent: every peer decides from the same records, then all move.
    Returns the moves made in each round and the final records."""
    rng = random.Random(seed)
    moves_per_round = []
    for _ in range(rounds):
        order = [p.peer_id for p in peers]
        rng.shuffle(order)
        moves = []
        for peer_id in order:
            source = next(p.stage for p in peers if p.peer_id == peer_id)
            target = rule(peer_id, peers, num_stages)
            if target is not None:
                moves.append(Move(peer_id, source, target))
                if not concurrent:
                    peers = apply_moves(peers, moves[-1:])
        if concurrent:
            peers = apply_moves(peers, moves)
        moves_per_round.append(len(moves))
    return moves_per_round, peers


@pytest.mark.parametrize("concurrent", [False, True])
def test_naive_rule_oscillates_where_the_plan_settles(concurrent):
    two_stages = swarm([2, 2], [3])  # totals 4, 3: naive moves a 2 over (2, 5), then a peer back, forever
    naive, _ = simulate(two_stages, 2, naive_target, rounds=50, seed=0, concurrent=concurrent)
    assert sum(naive) > 20
    assert sum(naive[-10:]) > 0
    ours, final = simulate(two_stages, 2, planned_target, rounds=50, seed=0, concurrent=concurrent)
    assert sum(ours) == 0  # 3 against 4 is already the best there is
    assert efficiency(final, 2) == 1.0

    for seed in range(4):
        # speeds within a factor 4 of each other: no stage ends up with one peer faster than all the others,
        # where the naive rule would stop because that peer is alone
        rng = random.Random(seed)
        twelve = [PeerLoad(f"p{i:02d}", rng.randrange(3), rng.uniform(0.5, 2.0)) for i in range(12)]
        naive, _ = simulate(twelve, 3, naive_target, rounds=50, seed=seed, concurrent=concurrent)
        assert sum(naive) > 20 and sum(naive[-10:]) > 0
        ours, final = simulate(twelve, 3, planned_target, rounds=50, seed=seed, concurrent=concurrent)
        assert sum(ours[3:]) == 0, ours  # settled after at most 3 rounds
        assert efficiency(final, 3) >= 0.9

    # and with the heavy-tailed speeds of real swarms, more peers and more stages
    for seed in range(10):
        rng = random.Random(seed)
        peers = [PeerLoad(f"p{i:02d}", rng.randrange(5), rng.lognormvariate(0, 1)) for i in range(40)]
        ours, final = simulate(peers, 5, planned_target, rounds=20, seed=seed, concurrent=concurrent)
        assert sum(ours[3:]) == 0, ours
        assert efficiency(final, 5) >= 0.9


def test_announcements_become_loads_joining_and_pinned_peers_included_but_not_movable():
    from swarm.balancing.moves import peer_loads
    from swarm.dht.records import Announcement

    def ann(peer_id: str, state: str, pinned: bool = False, expiration: float = 100.0) -> Announcement:
        return Announcement(peer_id, 0, state, 5.0, pinned=pinned, expiration=expiration)

    loads = peer_loads(
        [[ann("on", "online"), ann("join", "joining"), ann("pin", "online", pinned=True)], [ann("off", "offline")]]
        + [[ann("old", "online", expiration=5.0)]],
        now=10.0,
    )
    assert [(p.peer_id, p.online, p.movable) for p in loads] == [
        ("on", True, True),
        ("join", False, True),
        ("pin", True, False),
    ]
