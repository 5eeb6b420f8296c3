"""A swarm-peer that does not compute its stage honestly: the activations it returns from training forwards are its
real outputs with the positions of each sequence shuffled (finite, of the right size and statistics, but not its
stage's computation). Everything else (announcements, averaging, backward) is an ordinary peer's.

Run as `python -m tests.adversaries.dishonest_peer SWARM-PEER-FLAGS...`.
"""

from __future__ import annotations

import sys

import torch

from peers.swarm_peer import main
from swarm.server import compute

_honest_forward = compute.StageCompute._forward


def _dishonest_forward(self, req, caller):
    outputs = _honest_forward(self, req, caller)
    if req.train and not self.last:
        activations = outputs[0]
        outputs[0] = activations[:, torch.randperm(activations.shape[1])]
    return outputs


compute.StageCompute._forward = _dishonest_forward

if __name__ == "__main__":
    sys.exit(main())
