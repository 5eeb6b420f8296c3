"""Checked work: a trainer sends a small fraction of its microbatches twice, through two routes that differ at one
stage, and compares the two losses (pure logic; the trainer, swarm/client/trainer.py, sends them).

Replicas of a stage hold nearly the same parameters (they average every round), so the same microbatch through
two replicas gives nearly the same loss; a peer that does not compute its stage (outputs that are finite and of
plausible size but wrong) gives a different one. Both copies are ordinary training microbatches, so a peer cannot
tell a check from other work and behave only when watched (the check's cost: CHECK_FRACTION more microbatches).

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
CONVICTING_PARTNERS = 2
CONVICTION_BAN = 3600.0


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


@dataclass
class WorkChecks:
    """The checks of one trainer, and what they found."""

    fraction: float = CHECK_FRACTION
    agreed: dict[str, set[str]] = field(default_factory=dict)  # peer -> peers it agreed with
    disagreed: dict[str, set[str]] = field(default_factory=dict)
    convicted: set[str] = field(default_factory=set)
    checks: int = 0
    disagreements: int = 0

    def plan(self, route: Sequence[str], stages: Sequence[Sequence[str]], rng: random.Random) -> CheckPlan | None:
        """Whether to check this microbatch, and how: a full route, and a stage with another peer to compare."""
        if rng.random() >= self.fraction or len(route) != len(stages):
            return None
        choices = [
            (stage, others)
            for stage, peers in enumerate(stages)
            if (others := [p for p in peers if p != route[stage] and p not in self.convicted and p not in route])
        ]
        if not choices:
            return None
        stage, others = rng.choice(choices)
        other_route = list(route)
        other_route[stage] = rng.choice(others)
        return CheckPlan(stage, tuple(route), tuple(other_route))

    def record(self, plan: CheckPlan, loss: float, other_loss: float) -> list[str]:
        """Record a check's two losses; the peers it newly convicts."""
        first, second = plan.route[plan.stage], plan.other_route[plan.stage]
        self.checks += 1
        if losses_disagree(loss, other_loss):
            self.disagreements += 1
            self.disagreed.setdefault(first, set()).add(second)
            self.disagreed.setdefault(second, set()).add(first)
        else:
            self.agreed.setdefault(first, set()).add(second)
            self.agreed.setdefault(second, set()).add(first)
        newly = [peer for peer in (first, second) if peer not in self.convicted and self._guilty(peer)]
        self.convicted.update(newly)
        return newly

    def _guilty(self, peer: str) -> bool:
        if self.agreed.get(peer):
            return False
        vouched = [p for p in self.disagreed.get(peer, ()) if self.agreed.get(p, set()) - {peer}]
        return len(vouched) >= CONVICTING_PARTNERS
