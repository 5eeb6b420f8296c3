"""swarm/pipeline_schedule.py: a synchronous pipeline step over links, event by event (benchmarks/protocol_nanogpt.py)."""

import pytest

from swarm.pipeline_schedule import StageCosts, step_seconds


def uniform(stages: int, forward: float = 1.0, backward: float = 2.0, size: int = 100) -> list[StageCosts]:
    return [StageCosts(forward, backward, size if s < stages - 1 else 0, size if s else 0) for s in range(stages)]


def test_without_links_a_step_is_the_pipeline_bubble_plus_its_work():
    # (microbatches + stages - 1) slots of forward + backward: the textbook 1F1B/GPipe step time
    assert step_seconds(uniform(4), 8, None, 0.0) == pytest.approx((8 + 4 - 1) * 3.0)
    assert step_seconds(uniform(1), 5, None, 0.0) == pytest.approx(5 * 3.0)


def test_one_microbatch_pays_every_transfer_and_delay_in_turn():
    # 3 boundaries forward and 3 back, each 100 bytes at 800 bit/s (1 s) plus 0.5 s of delay
    assert step_seconds(uniform(4), 1, 800.0, 0.5) == pytest.approx(4 * 3.0 + 6 * (1.0 + 0.5))


def test_a_slow_uplink_makes_the_step_link_bound():
    # each middle stage sends 8 activations and 8 gradients of 10 s each on one uplink: at least 160 s
    seconds = step_seconds(uniform(4), 8, 80.0, 0.0)
    assert seconds >= 160.0
    assert seconds < 160.0 + 4 * 3.0 + 2 * 3 * 10.0  # plus at most the fill and drain of the pipeline


def test_fewer_bytes_make_a_faster_step_and_delay_costs_each_boundary_at_most_once_per_direction():
    # GPU-like: 30 ms of compute per microbatch against 1 s (1,000 bytes) or 62 ms (62 bytes) on the link
    slow = step_seconds(uniform(8, 0.01, 0.02, size=1000), 4, 8000.0, 0.05)
    fast = step_seconds(uniform(8, 0.01, 0.02, size=62), 4, 8000.0, 0.05)
    assert fast < slow / 5
    no_delay = step_seconds(uniform(8, 0.01, 0.02, size=62), 4, 8000.0, 0.0)
    # at most once per boundary and direction on the critical path (less where it hides behind a queue)
    assert 0.5 * 2 * 7 * 0.05 < fast - no_delay <= 2 * 7 * 0.05 + 1e-9


def test_nothing_to_schedule_is_refused():
    with pytest.raises(ValueError):
        step_seconds([], 4, None, 0.0)
    with pytest.raises(ValueError):
        step_seconds(uniform(2), 0, None, 0.0)
