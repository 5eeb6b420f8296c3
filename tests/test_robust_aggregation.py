"""Robust aggregation of a round's part (swarm/averaging/robust_aggregation.py): pure tensor math."""

from __future__ import annotations

import torch

from swarm.averaging.robust_aggregation import (
    MAX_WEIGHT_RATIO,
    TAU_FACTOR,
    capped_weights,
    centered_clip,
    rms,
    robust_aggregate,
    suspicious_result,
)


def _honest(count: int, spread: float = 0.01, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    base = torch.randn(4096)
    return [base + spread * torch.randn(4096) for _ in range(count)]


def test_honest_contributions_average_to_their_weighted_mean_and_nobody_is_flagged():
    parts = _honest(4)
    verdict = robust_aggregate(parts, [1.0, 0.5, 1.0, 1.0])  # (weights above the median's cap would be cut)
    mean = (parts[0] + 0.5 * parts[1] + parts[2] + parts[3]) / 3.5
    assert rms(verdict.aggregate - mean) < 1e-6 and verdict.outliers == ()


def test_a_far_contribution_is_flagged_and_left_out_whatever_weight_it_claims():
    parts = _honest(3)
    mean = sum(parts) / 3
    for bad in (parts[0] * 1.5, -parts[0], torch.full((4096,), float("nan")), torch.full((4096,), 1e6)):
        verdict = robust_aggregate([*parts, bad], [1.0, 1.0, 1.0, 1e6])
        assert verdict.outliers == (3,)
        assert rms(verdict.aggregate - mean) < 1e-6


def test_an_unflagged_contribution_moves_the_result_at_most_its_weight_share_times_the_radius():
    parts = _honest(3)
    mean = sum(parts) / 3
    bad = parts[0] + 0.03 * torch.randn(4096)  # plausible: a few times the honest spread, not flagged
    verdict = centered_clip([*parts, bad], [1.0, 1.0, 1.0, 1e6])
    assert verdict.outliers == ()
    centre = torch.stack([*parts, bad]).median(dim=0).values
    radius = TAU_FACTOR * sorted(rms(p - centre) for p in [*parts, bad])[1:3][-1]  # about the median distance
    share = MAX_WEIGHT_RATIO / (3 + MAX_WEIGHT_RATIO)
    assert rms(verdict.aggregate - mean) <= share * radius * 1.5


def test_claimed_weights_are_capped_at_a_multiple_of_the_median():
    assert capped_weights([1.0, 1.0, 1e6]).tolist() == [1.0, 1.0, MAX_WEIGHT_RATIO]
    assert capped_weights([4.0, 1.0, 1.0]).tolist() == [1.0, 1.0, 1.0]
    assert capped_weights([float("nan"), -5.0, 1.0]).tolist() == [0.0, 0.0, 1.0]


def test_two_contributions_cannot_be_told_apart_but_nan_still_is():
    a, b = _honest(2)
    verdict = robust_aggregate([a, b * 3], [3.0, 1.0])  # their claimed weights stand: nothing to compare with
    assert verdict.outliers == () and rms(verdict.aggregate - (3 * a + 3 * b) / 4) < 1e-6
    assert robust_aggregate([a, torch.full_like(a, float("inf"))], [1.0, 1.0]).outliers == (1,)


def test_a_result_far_from_every_replica_is_suspicious():
    assert not suspicious_result(0.02, 0.01)
    assert suspicious_result(0.5, 0.01)
    assert suspicious_result(float("nan"), 0.01)
