"""A swarm-peer that poisons its stage's averaging rounds: in each round it sends, instead of its parameters, one
of the plausible poisons of docs/RELIABILITY.md in turn (scaled by 1.5, sign-flipped, a stale copy: the parameters
of its first round), and claims a weight of a million samples. It keeps its own parameters (it applies no
round). Everything else (serving, announcements) is an ordinary peer's.

Run as `python -m tests.adversaries.poisoning_peer SWARM-PEER-FLAGS...`.
"""

from __future__ import annotations

import itertools
import sys

import torch

from peers.swarm_peer import main
from swarm.averaging import averager

POISONS = ("scaled", "sign-flipped", "stale")
_honest_begin = averager.StageAverager.begin_round
_honest_run = averager.StageAverager.run_round
_kinds = itertools.cycle(POISONS)
_first: list[torch.Tensor] = []


@torch.no_grad()
def _poisoned_begin(self) -> None:
    _honest_begin(self)
    kind = next(_kinds)
    with self._averager.get_tensors() as buffers:
        if not _first:
            _first.extend(b.clone() for b in buffers)
        for buffer, stale in zip(buffers, _first):
            if kind == "scaled":
                buffer.mul_(1.5)
            elif kind == "sign-flipped":
                buffer.neg_()
            else:
                buffer.copy_(stale)
    print(f"poisoning this round: {kind}", flush=True)


def _heavy_run(self, weight: float, timeout: float | None = None) -> int:
    return _honest_run(self, 1e6, timeout)


def _keep_own(self, averaged: bool, alone: bool = False) -> bool:
    self._start = None
    return False


averager.StageAverager.begin_round = _poisoned_begin
averager.StageAverager.run_round = _heavy_run
averager.StageAverager.finish_round = _keep_own

if __name__ == "__main__":
    sys.exit(main())
