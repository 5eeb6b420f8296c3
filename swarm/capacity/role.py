"""Which role a CPU peer fills: serve stages, or only train.

A CPU computes a transformer block tens of times slower than a GPU. Joining a swarm of GPUs as a stage server, it
would take microbatches that then wait on it (a slow hop holds the whole route up to its deadline), and it would
still download, average and announce its stages' state. As a trainer it helps more: its microbatches are computed by
the GPUs, and it needs neither their memory nor their speed. So a CPU peer serves only where its rate is a useful
share of the rate of the peers it would join (all-CPU swarms, like the demo, are served by CPUs), and otherwise
trains only and says why. A pinned stage (--stage) or a peer that does not train (--no-trainer) serves anyway.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

USEFUL_SHARE = 0.05  # of the median serving peer's rate through one block: below it, a CPU peer trains only


def slow_serving_reason(own_per_block: float, others_per_block: Sequence[float]) -> str | None:
    """Why a CPU peer whose compute runs `own_per_block` samples/s through one block should train instead of
    serving beside peers that serve `others_per_block` each; None when serving is useful (or nobody serves yet:
    then it is the only help there is)."""
    rates = [rate for rate in others_per_block if rate > 0]
    if not rates:
        return None
    median = statistics.median(rates)
    if own_per_block >= USEFUL_SHARE * median:
        return None
    return (
        f"this CPU computes {own_per_block:.1f} samples/s through a block, {own_per_block / median:.1%} of the "
        f"{median:.1f} of the swarm's median serving peer (under {USEFUL_SHARE:.0%}: a microbatch routed through "
        "it would wait on it)"
    )
