"""Checked work: a trainer sends a small fraction of its microbatches twice, through two routes that differ at one
stage, and compares the two losses (pure logic; the trainer, swarm/client/trainer.py, sends them).

Replicas of a stage hold nearly the same parameters (they average every round), so the same microbatch through
two replicas gives nearly the same loss; a peer that does not compute its stage (outputs that are finite and of
plausible size but wrong) gives a different one. Both copies are ordinary training microbatches, so a peer cannot
tell a check from other work and behave only when watched (the check's cost: CHECK_FRACTION more microbatches).

The loss shows wrong outputs; wrong gradients do not change it. So every hop before the last reports a fingerprint
of the gradient its next hop sent back (gradient_fingerprint in swarm/wire/tensors.py: a few random projections of
it), on every train microbatch alike; when the two routes differ at stage s >= 1, the hop at stage s - 1 is the
same peer on both, and it received stage s's gradients from two different replicas: their fingerprints must agree
too.

One disagreement cannot tell which of two peers lied. A peer is convicted when it disagreed with
CONVICTING_PARTNERS different peers, each of which agreed with some other peer in another check: with three or
more replicas of a stage, an honest peer agrees with the other honest ones, and the liar with nobody. A convicted
peer is left out of this trainer's routes for CONVICTION_BAN seconds. Each trainer decides alone, from its own
checks: nobody can get an honest peer banned by saying so.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

CHECK_FRACTION = 0.05  # of microbatches sent twice
MIN_RELATIVE_GAP = 0.1  # losses further apart than this fraction of the larger one disagree
MIN_ABSOLUTE_GAP = 0.05  # ... and further apart than this (nats): tiny losses differ relatively more
# Two replicas' gradients disagree when the median gap between their fingerprints (as a fraction of the larger
# one's norm) over their last PAIR_CHECKS checks is above MAX_PRINT_GAP. One check's gap is too noisy to judge:
# on the tiny model, with a step of every peer between a check's two copies, honest pairs measured a median 0.68-0.79
# (90th percentile up to 1.05), a pair with a replica that shuffles its gradients 1.21-1.22 (10th: 0.97).
MAX_PRINT_GAP = 1.0
MIN_PAIR_CHECKS = 7  # gaps of a pair before it is judged on its gradients
PAIR_CHECKS = 15
CONVICTING_PARTNERS = 2
CONVICTION_BAN = 3600.0


def fingerprint_gap(first: Sequence[float], second: Sequence[float]) -> float | None:
    """How far apart two fingerprints are, as a fraction of the larger one's norm (0: equal; about 1.4: unrelated
    gradients); inf if either is not finite; None if there is nothing to compare."""
    if len(first) != len(second) or not first:
        return None
    if not all(math.isfinite(x) for x in (*first, *second)):
        return math.inf
    gap = math.sqrt(sum((a - b) ** 2 for a, b in zip(first, second)))
    scale = max(math.sqrt(sum(a * a for a in first)), math.sqrt(sum(b * b for b in second)))
    return gap / scale if scale > 0 else 0.0


def losses_disagree(first: float, second: float) -> bool:
    if not (math.isfinite(first) and math.isfinite(second)):
        return True
    gap = abs(first - second)
    return gap > MIN_ABSOLUTE_GAP and gap > MIN_RELATIVE_GAP * max(abs(first), abs(second))


@dataclass(frozen=True)
class CheckPlan:
    """Send the microbatch through `route` and again through `other_route` (the same but at `stage`)."""

    stage: int
    route: tuple[str, ...]
    other_route: tuple[str, ...]


def gradient_prints(plan: CheckPlan, hops: Sequence, other_hops: Sequence) -> tuple[Sequence[float], Sequence[float]]:
    """The fingerprints to compare for a check (`hops`: swarm.wire.hops.HopTiming of each route, stage 0 first): those of
    the gradient the checked stage sent back to the hop before it, when both routes ran as planned up to there."""
    s = plan.stage
    if s == 0 or len(hops) <= s or len(other_hops) <= s:
        return (), ()
    planned = (
        hops[s - 1].peer_id == plan.route[s - 1] == other_hops[s - 1].peer_id
        and hops[s].peer_id == plan.route[s]
        and other_hops[s].peer_id == plan.other_route[s]
    )
    return (hops[s - 1].gradient_print, other_hops[s - 1].gradient_print) if planned else ((), ())


@dataclass
class WorkChecks:
    """The checks of one trainer, and what they found."""

    fraction: float = CHECK_FRACTION
    agreed: dict[str, set[str]] = field(default_factory=dict)  # peer -> peers it agreed with
    disagreed: dict[str, set[str]] = field(default_factory=dict)
    convicted: set[str] = field(default_factory=set)
    gaps: dict[frozenset[str], list[float]] = field(default_factory=dict)  # a pair's last gradient gaps
    checks: int = 0
    disagreements: int = 0

    def plan(self, route: Sequence[str], stages: Sequence[Sequence[str]], rng: random.Random) -> CheckPlan | None:
        """Whether to check this microbatch, and how: a stage with two replicas to compare, each picked at random
        (not the route's own choice at that stage: routing keeps choosing the fastest, and a pair that is never
        checked can never vouch for its peers), and the two routes through them."""
        if rng.random() >= self.fraction or len(route) != len(stages):
            return None
        choices = []
        for stage, peers in enumerate(stages):
            elsewhere = set(route[:stage]) | set(route[stage + 1 :])
            candidates = sorted({p for p in peers if p not in self.convicted and p not in elsewhere} | {route[stage]})
            if len(candidates) >= 2:
                choices.append((stage, candidates))
        if not choices:
            return None
        stage, candidates = rng.choice(choices)
        first, second = rng.sample(candidates, 2)
        routes = list(route), list(route)
        routes[0][stage], routes[1][stage] = first, second
        return CheckPlan(stage, tuple(routes[0]), tuple(routes[1]))

    def record(
        self,
        plan: CheckPlan,
        loss: float,
        other_loss: float,
        prints: tuple[Sequence[float], Sequence[float]] = ((), ()),
    ) -> list[str]:
        """Record a check's two losses (and the two fingerprints of the gradient stage plan.stage sent back, when
        the hop before it reported them); the peers it newly convicts."""
        first, second = plan.route[plan.stage], plan.other_route[plan.stage]
        self.checks += 1
        if losses_disagree(loss, other_loss):
            self._verdict(first, second, agree=False)
        elif plan.stage == 0:
            self._verdict(first, second, agree=True)
        else:  # past stage 0 the losses agreeing clears nobody (a liar of gradients has true losses): the gradients
            gap = fingerprint_gap(*prints)
            if gap is None:
                return []  # inconclusive: a hop rerouted, or did not report
            pair = frozenset((first, second))
            gaps = self.gaps.setdefault(pair, [])
            gaps[:] = [*gaps, gap][-PAIR_CHECKS:]
            if len(gaps) < MIN_PAIR_CHECKS:
                return []
            self._verdict(first, second, agree=sorted(gaps)[len(gaps) // 2] <= MAX_PRINT_GAP)
        newly = [peer for peer in (first, second) if peer not in self.convicted and self._guilty(peer)]
        self.convicted.update(newly)
        return newly

    def _verdict(self, first: str, second: str, agree: bool) -> None:
        """What the pair's latest check says (a pair judged on its gradients may change its verdict)."""
        if not agree:
            self.disagreements += 1
        keep, drop = (self.agreed, self.disagreed) if agree else (self.disagreed, self.agreed)
        for a, b in ((first, second), (second, first)):
            keep.setdefault(a, set()).add(b)
            drop.get(a, set()).discard(b)

    def _guilty(self, peer: str) -> bool:
        if self.agreed.get(peer):
            return False
        vouched = [p for p in self.disagreed.get(peer, ()) if self.agreed.get(p, set()) - {peer}]
        return len(vouched) >= CONVICTING_PARTNERS
