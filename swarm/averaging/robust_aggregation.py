"""Robust aggregation of one part of an averaging round, and the checks that find the replica that spoiled it (pure
tensor math, no I/O; the all-reduce that uses it is swarm/averaging/robust_allreduce.py's).

Why CenteredClip (Karimireddy et al.; used by BTARD, Gorbunov et al., "Secure Distributed Training at Scale"):
stages have few replicas (2 to 8), so a coordinate-wise median or a trimmed mean throws away most of the honest
information (the median of 3 is one replica's value per coordinate, and its noise), while CenteredClip is the plain
weighted mean whenever every contribution lies within the clipping radius of the centre, which is the honest case,
and bounds what any one contribution can do when it does not. It starts from the coordinate-wise median (which
one bad replica of three cannot move outside the honest values) and clips each contribution's difference to the
centre at TAU_FACTOR times the median distance.

What one bad contribution can do, per part and round: move the result by at most its weight share (weights are
capped at the median weight) times the clipping radius, a small multiple of how far honest
replicas are apart; a contribution farther than OUTLIER_FACTOR times the median distance from the result is
flagged (the averager excludes its sender after repeated flags, swarm/averaging/robust_allreduce.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TAU_FACTOR = 2.0  # clipping radius, in median distances to the coordinate-wise median
CLIP_ITERATIONS = 3
MAX_WEIGHT_RATIO = 1.0  # a contribution weighs at most the median weight (weights are claimed; benchmarks/poisoning.py:
# at twice the median, a sign-flipped replica that was not yet flagged pulled its rounds 40% of the radius its way)
OUTLIER_FACTOR = 5.0  # farther than this many median distances from the result: flagged
RESULT_FACTOR = 4.0  # a reduced part farther than this from a peer's own part (in its reference distances): flagged
MIN_RMS = 1e-7  # per-element distances below this are treated as this (replicas that are all but equal)


@dataclass(frozen=True)
class PartVerdict:
    """The robust aggregate of one part, and each contribution's distance to it (root mean square per element)."""

    aggregate: torch.Tensor
    distances: tuple[float, ...]
    outliers: tuple[int, ...]  # indices of contributions flagged as far from the aggregate
    median_distance: float


def rms(tensor: torch.Tensor) -> float:
    return float(tensor.double().square().mean().sqrt()) if tensor.numel() else 0.0


def _plain_weights(weights: Sequence[float]) -> torch.Tensor:
    return torch.tensor([max(float(x), 0.0) if math.isfinite(x) else 0.0 for x in weights], dtype=torch.float64)


def capped_weights(weights: Sequence[float]) -> torch.Tensor:
    """The weights as CenteredClip uses them: none above MAX_WEIGHT_RATIO times the median (a replica that claims
    a million samples counts as a median one), none below zero."""
    w = _plain_weights(weights)
    positive = w[w > 0]
    if positive.numel() == 0:
        return torch.ones_like(w)
    return w.clamp(max=MAX_WEIGHT_RATIO * _median(positive.tolist()))


def robust_aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> PartVerdict:
    """The aggregate of one part: CenteredClip of every contribution, then again without those flagged as outliers
    (so that a contribution far off does not even pull the result by its clipped share)."""
    first = centered_clip(parts, weights)
    keep = [i for i in range(len(parts)) if i not in first.outliers]
    if not first.outliers or len(keep) < 2:
        return first
    second = centered_clip([parts[i] for i in keep], [weights[i] for i in keep])
    distances = tuple(
        rms(p.float() - second.aggregate) if i in keep else first.distances[i] for i, p in enumerate(parts)
    )
    return PartVerdict(second.aggregate, distances, first.outliers, _median(distances))


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> PartVerdict:
    """CenteredClip of `parts` (same shape) with `weights`. Parts holding NaN or Inf take no part and are flagged;
    with two or fewer finite parts, the weighted mean (nothing can tell which of two is wrong: robustness needs
    three replicas)."""
    finite = [bool(torch.isfinite(p).all()) for p in parts]
    kept = [i for i, ok in enumerate(finite) if ok] or list(range(len(parts)))
    stacked = torch.stack([parts[i].float() for i in kept])
    # with two, nothing can tell which is wrong: their weights stand (the reducer caps them against the whole group)
    w = (capped_weights if len(kept) > 2 else _plain_weights)([weights[i] for i in kept]).to(torch.float32)
    if w.sum() <= 0:
        w = torch.ones_like(w)
    shape = (-1,) + (1,) * (stacked.dim() - 1)
    if len(kept) <= 2:
        centre = (stacked * w.view(shape)).sum(0) / w.sum()
    else:
        centre = stacked.median(dim=0).values
        tau = TAU_FACTOR * max(_median([rms(p - centre) for p in stacked]), MIN_RMS)
        for _ in range(CLIP_ITERATIONS):
            differences = stacked - centre
            norms = torch.tensor([rms(d) for d in differences], dtype=torch.float64)
            scale = torch.clamp(tau / norms.clamp(min=1e-30), max=1.0).to(torch.float32)
            centre = centre + (differences * (w * scale).view(shape)).sum(0) / w.sum()
    distances = tuple(rms(p.float() - centre) if ok else float("inf") for p, ok in zip(parts, finite))
    return PartVerdict(centre, distances, outliers(distances), _median(distances))


def outliers(distances: Sequence[float]) -> tuple[int, ...]:
    """Contributions farther than OUTLIER_FACTOR times the median distance (any that held NaN or Inf, whose distance
    is infinite); among two or fewer, only those."""
    if len(distances) <= 2:
        return tuple(i for i, d in enumerate(distances) if not math.isfinite(d))
    threshold = OUTLIER_FACTOR * max(_median(distances), MIN_RMS)
    return tuple(i for i, d in enumerate(distances) if not d <= threshold)  # NaN is an outlier too


def suspicious_result(distance: float, reference: float) -> bool:
    """Whether a part that another peer reduced lies too far from this peer's own part: `distance` is its RMS
    distance, `reference` the farthest unflagged contribution from the aggregates this peer computed itself. An
    honest reducer's result lies among the honest contributions: within about twice that of this peer's part."""
    return not distance <= RESULT_FACTOR * max(reference, MIN_RMS)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return float("inf")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
