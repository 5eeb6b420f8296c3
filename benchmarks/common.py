"""What the benchmarks share: the manifest of a benchmark, the milestones of a peer's start, waiting for a swarm
to come online, and the held-out loss of a swarm (every online peer's state downloaded, the whole model assembled
from one replica per stage, in every combination).

What the tests share with the benchmarks lives in the library: the small fast test swarm
(swarm/local/fast_swarm.py: fast_test_swarm_dict) and starting local peers on free ports (swarm/local/processes.py:
start_peer, start_local_peer, free_ports), as swarm-demo and the tests start them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from swarm.architectures.model import build_full_model
from swarm.client.export import assemble_full_state, stage_parameters
from swarm.client.rpc import download_state
from swarm.dataset.shards import TextData, heldout_batches
from swarm.dht.records import Announcement, PeerState, fetch_announcements
from swarm.manifests.manifest import Manifest
from swarm.manifests.presets import new_manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.wire.state import stage_state_shapes

# ------------------------------------------------------------------------------------------------ manifests


def benchmark_manifest(path: str | None, name: str) -> Manifest:
    """The manifest at `path` without its initial peers (a benchmark starts a swarm of its own and contacts
    nobody), or, without a path, a new swarm `name` of the tiny preset (the demo's model)."""
    if path is None:
        return new_manifest(name, "tiny")
    return manifest_from_dict({**json.loads(Path(path).read_text()), "initial_peers": []})


# ------------------------------------------------------------------------------------------------ peers


# The first line of a peer's output matching each, in the order a start passes them (benchmarks/startup.py and
# the churn benchmark's restarts, benchmarks/churn/swarm.py, time a start by them).
START_MILESTONES = {
    "reachability_checked": r"reachable: |NOT reachable|reachability not checked",
    "dht_up": r"swarm '.*' \(id",
    "throughput_known": r"compute throughput of stage \d",
    "serving": r"^serving stage \d",
}


def start_milestones(output: str, seen: dict[str, float], elapsed: float) -> None:
    """Adds to `seen` (milestone -> seconds) each milestone that `output` passed and `seen` lacks."""
    for name, pattern in START_MILESTONES.items():
        if name not in seen and re.search(pattern, output, re.M):
            seen[name] = round(elapsed, 2)


def stop_on_sigterm() -> None:
    """A benchmark stopped with SIGTERM (e.g. by a time limit) still stops its peers: it raises
    KeyboardInterrupt, which runs the `finally` blocks that stop them."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"received signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


# ------------------------------------------------------------------------------------------------ the swarm


async def online_by_stage(dht, manifest: Manifest) -> list[list[Announcement]]:
    """The online announcements of each stage."""
    return [
        [a for a in await fetch_announcements(dht, manifest.swarm_id, s) if a.state == PeerState.ONLINE]
        for s in range(manifest.num_stages)
    ]


async def wait_online(dht, manifest: Manifest, replicas: int, timeout: float) -> bool:
    """Wait until every stage has `replicas` online peers; False if that did not happen within `timeout`."""
    deadline = time.monotonic() + timeout
    while not all(len(stage) == replicas for stage in await online_by_stage(dht, manifest)):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True


def eval_batches(manifest: Manifest, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` held-out microbatches of the manifest's data."""
    heldout = TextData.load_heldout(manifest.data.source, manifest.data.heldout_fraction)
    return heldout_batches(heldout, count, manifest.training.microbatch_size, manifest.model.context_length)


@torch.no_grad()
def heldout_loss(manifest: Manifest, state: dict[str, torch.Tensor], batches) -> float:
    """The held-out loss of the whole model with these parameters (by their full names)."""
    model = build_full_model(manifest.model)
    model.load_state_dict(state, strict=False)  # parameters only (no buffers to restore)
    model.eval()
    return float(np.mean([float(model.loss(model(x), y)) for x, y in batches]))


async def download_parameters(
    p2p,
    manifest: Manifest,
    online: list[list[Announcement]],
    timeout: float = 120.0,
    on_error: Callable[[int, str, Exception], None] | None = None,
) -> list[list[dict[str, torch.Tensor]]]:
    """Per stage, the parameters of each peer announced in `online[stage]`. A failed download raises, or, with
    `on_error(stage, peer_id, error)`, is reported there and skipped."""
    states: list[list[dict[str, torch.Tensor]]] = []
    for stage, announcements in enumerate(online):
        shapes = stage_state_shapes(manifest, stage)
        states.append([])
        for ann in announcements:
            try:
                items, _ = await download_state(p2p, ann.peer_id, manifest, stage, shapes, timeout)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(stage, ann.peer_id, e)
                continue
            states[-1].append(stage_parameters(items))
    return states


def swarm_heldout_losses(manifest: Manifest, states: list[list[dict[str, torch.Tensor]]], batches) -> list[float]:
    """The held-out loss of the model assembled from each combination of one replica per stage."""
    return [
        heldout_loss(manifest, assemble_full_state(manifest, list(combination)), batches)
        for combination in itertools.product(*states)
    ]
