"""A swarm-peer that computes its stage's outputs honestly but sends back wrong gradients: the gradient of its inputs,
with the positions of each sequence shuffled (finite, of the right size and statistics, and the loss it reports is
the true one). Everything else is an ordinary peer's. Serve a stage after the first: stage 0's gradients go
nowhere.

Run as `python -m tests.adversaries.wrong_gradients_peer SWARM-PEER-FLAGS...`.
"""

from __future__ import annotations

import sys

import torch

from peers.swarm_peer import main
from swarm.server import compute

_honest_forward = compute.StageCompute._forward
_honest_backward = compute.StageCompute._backward


def _shuffled(gradient: torch.Tensor) -> torch.Tensor:
    return gradient[:, torch.randperm(gradient.shape[1])]


def _forward(self, req, caller):
    outputs = _honest_forward(self, req, caller)
    if req.train and self.last and len(outputs) == 2:  # the last stage's [loss, gradient of its inputs]
        outputs[1] = _shuffled(outputs[1])
    return outputs


def _backward(self, req, caller):
    grads = _honest_backward(self, req, caller)
    return [_shuffled(g) for g in grads]


compute.StageCompute._forward = _forward
compute.StageCompute._backward = _backward

if __name__ == "__main__":
    sys.exit(main())
