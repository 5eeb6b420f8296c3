"""The small, fast swarm that the tests, the benchmarks and their local swarms start: a 2-stage GPT smaller than
the "tiny" preset, whose peers start and train in seconds on 2 shared cores."""

from __future__ import annotations

import copy
from typing import Any

from swarm import PROTOCOL_VERSION

FAST_TEST_SWARM: dict[str, Any] = {
    "name": "test-swarm",
    "protocol_version": PROTOCOL_VERSION,
    "model": {"vocab_size": 256, "width": 64, "depth": 2, "heads": 2, "context_length": 32, "seed": 0},
    "stages": {"count": 2},
    "training": {
        "microbatch_size": 8,
        "microbatches_per_step": 1,
        "learning_rate": 0.003,
        "max_in_flight": 2,
        "adaptive_window": False,
        "timeouts": {"forward": 5, "backward": 5, "microbatch": 60},
    },
    "data": {"source": "stdlib", "shards": 4},
    "network": {"announce_period": 1.0},
    # the tests' swarms average parameters every 2048 samples, as before issue 15 made diloco the default: the
    # suite's timing bounds were set with it (the diloco paths have tests of their own)
    "averaging": {"mode": "parameters", "every_samples": 2048},
    "initial_peers": [],
}


def fast_test_swarm_dict(**overrides: Any) -> dict[str, Any]:
    """FAST_TEST_SWARM as a new manifest dictionary (not validated: tests also build bad ones from it); each
    override replaces a top-level field, or, for a dictionary, the keys it names in that section."""
    manifest = copy.deepcopy(FAST_TEST_SWARM)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    return manifest
