"""The forwards a stage keeps for their backward: each microbatch's inputs, outputs and the weights forward ran with,
by (caller, microbatch id), oldest first. Its size is the window of kept microbatches: as many as fit beside the
stage in the peer's memory (capacity/costs.py), else ACTIVATION_CACHE_BYTES' worth; out of memory it shrinks
(server/shedding.py). A backward whose forward is not here recomputes it from the inputs it carries
(server/compute.py), so dropping an entry costs time, never a result. Touched by the stage's worker thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from swarm.manifests.manifest import Manifest

ACTIVATION_CACHE_BYTES = 1 << 30
MIN_DEFAULT_KEPT = 8

Key = tuple[str, str]  # (caller, microbatch id)


@dataclass
class CachedForward:
    inputs: torch.Tensor
    outputs: torch.Tensor
    weights: list[torch.Tensor]  # the weights forward ran with (stashed), so backward uses the same ones
    created: float
    steps: int  # optimizer steps taken when forward ran (to measure the delay of its gradient)
    version: int  # the weights' version forward ran with (to measure the gradient's staleness)


class ActivationCache:
    """At most `limit` forwards, the oldest dropped first."""

    def __init__(self, manifest: Manifest, stage: int, kept_microbatches: int | None = None):
        self.limit = kept_microbatches or max(
            MIN_DEFAULT_KEPT, ACTIVATION_CACHE_BYTES // activation_bytes_estimate(manifest, stage)
        )
        self._forwards: OrderedDict[Key, CachedForward] = OrderedDict()

    def __len__(self) -> int:
        return len(self._forwards)

    def remember(self, key: Key, forward: CachedForward) -> None:
        self._forwards[key] = forward
        self._forwards.move_to_end(key)
        self._trim(self.limit)

    def get(self, key: Key) -> CachedForward | None:
        return self._forwards.get(key)

    def drop(self, key: Key) -> None:
        self._forwards.pop(key, None)

    def keep_at_most(self, limit: int) -> None:
        """Out of memory: keep at most `limit` forwards from now on, and drop the oldest beyond it now."""
        self.limit = limit
        self._trim(limit)

    def drop_older_than(self, seconds: float) -> None:
        """Drop forwards older than `seconds` (their microbatch's deadline has passed: the trainer gave up)."""
        now = time.monotonic()
        while self._forwards and now - next(iter(self._forwards.values())).created > seconds:
            self._forwards.popitem(last=False)

    def clear(self) -> None:
        self._forwards.clear()

    def _trim(self, limit: int) -> None:
        while len(self._forwards) > limit:
            self._forwards.popitem(last=False)


def activation_bytes_estimate(manifest: Manifest, stage: int) -> int:
    """Rough memory of one cached forward: about 20 float activations of [batch, length, width] per layer."""
    config, training = manifest.model, manifest.training
    per_layer = 20 * training.microbatch_size * config.context_length * config.width * 4
    return per_layer * max(1, len(manifest.stage_layers(stage)))
