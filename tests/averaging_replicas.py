"""Replicas of one stage that average over real hivemind DHTs on loopback: what tests/test_averaging.py and
tests/test_averaging_hostile.py share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch
from hivemind import DHT

from conftest import LOOPBACK, tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.averaging.averager import StageAverager
from swarm.errors import AveragingError
from swarm.manifests.validation import manifest_from_dict


def averaging_manifest(**averaging):
    """The test swarm's manifest with quick rounds and these averaging settings."""
    raw = tiny_manifest_dict()
    raw["averaging"] = {"matchmaking_time": 2.0, "timeout": 20.0, **averaging}
    return manifest_from_dict(raw)


def loopback_dhts() -> Iterator[Callable[[int], list[DHT]]]:
    """The body of a test module's `dhts` fixture: a function that starts `count` DHTs on loopback, joined to each
    other; all of them are shut down at the end."""
    started = []

    def make(count):
        first = DHT(start=True, host_maddrs=[LOOPBACK])
        started.append(first)
        peers = [str(a) for a in first.get_visible_maddrs()]
        for _ in range(count - 1):
            started.append(DHT(start=True, initial_peers=peers, host_maddrs=[LOOPBACK]))
        return started[-count:]

    yield make
    for dht in started:
        dht.shutdown()


def replicas_of(manifest, dhts, seeds):
    """(parameters, averager) of stage 0 on each DHT, each moved from the seeded state by noise of its seed."""
    replicas = []
    for dht, seed in zip(dhts, seeds):
        model = build_stage(manifest, 0)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # replicas that drifted apart
        named = list(model.named_parameters())
        names, params = [n for n, _ in named], [p for _, p in named]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        replicas.append((params, StageAverager(manifest, 0, dht, names, params, optimizer)))
    return replicas


def run_round(replicas, weights):
    """One round of every replica at once, with these weights; the group sizes they saw (none may fail)."""
    for _, averager in replicas:
        averager.begin_round()
    sizes, errors = [None] * len(replicas), []

    def run(i):
        try:
            sizes[i] = replicas[i][1].run_round(weights[i], timeout=15)
        except AveragingError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for _, averager in replicas:
        averager.finish_round(averaged=True)
    return sizes


def outer_settings(manifest) -> tuple[float, float]:
    return manifest.averaging.outer_learning_rate, manifest.averaging.outer_momentum


def distance(a, b):
    return sum(float((x - y).norm() ** 2) for x, y in zip(a, b)) ** 0.5
