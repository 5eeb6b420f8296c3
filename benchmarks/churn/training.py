"""A churn run's trainers (__main__.py): Trainers in the benchmark's process that note when each
microbatch finished and count their bans of peers; training to the run's samples while the faults are injected;
the final model's held-out loss; the longest stalls; the trainers' own log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.churn.peers import START_TIMEOUT
from benchmarks.churn.swarm import Event, Swarm
from benchmarks.common import download_parameters, online_by_stage, swarm_heldout_losses, wait_online
from swarm.client.trainer import Trainer
from swarm.dataset.shards import TextData
from swarm.routing import Router

EVENTS_TIMEOUT = 300.0  # after training, for the remaining faults to finish (restarted peers to serve)
PROGRESS_PERIOD = 10.0


class CountingRouter(Router):
    """A trainer's router that counts the bans it gives peers (each failed call bans the peer for a while)."""

    def __init__(self) -> None:
        super().__init__()
        self.bans = 0

    def failed(self, peer_id: str, now: float, wasted: float = 0.0) -> float:
        self.bans += 1
        return super().failed(peer_id, now, wasted)


class TimedTrainer(Trainer):
    """A Trainer that notes when each of its microbatches finished (time.monotonic()) and counts its bans."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, router=CountingRouter(), **kwargs)  # its pipelines use the same router
        self.finished: list[float] = []

    def _collect(self, task: asyncio.Task) -> None:
        done = self.microbatches
        super()._collect(task)
        if self.microbatches > done:
            self.finished.append(time.monotonic())


def stalls(finished: list[float], outages: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(longest gap between two finished microbatches, when it began, longest gap not counting outages)."""
    longest, at, longest_served = 0.0, 0.0, 0.0
    for a, b in itertools.pairwise(sorted(finished)):
        if b - a > longest:
            longest, at = b - a, a
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in outages)
        longest_served = max(longest_served, b - a - covered)
    return longest, at, longest_served


async def stop_after_faults(
    trainers: list[TimedTrainer], injector: list[asyncio.Task], target: int, seconds: float, stop: asyncio.Event
) -> None:
    """--after-faults: stop the trainers once every fault has ended (a restarted peer serves again), `seconds` have
    passed since, and they have trained `target` samples."""
    await asyncio.gather(*injector, return_exceptions=True)  # a fault that failed is raised after training
    await asyncio.sleep(seconds)
    while sum(t.samples for t in trainers) < target:
        await asyncio.sleep(0.2)
    stop.set()


async def drive(swarm: Swarm, dht, events: list[Event], batches) -> dict:
    """Train to the samples (injecting `events`), wait for the faults to end, then evaluate the final model."""
    settings, manifest = swarm.settings, swarm.manifest
    p2p = await dht.replicate_p2p()
    poller = asyncio.create_task(swarm.poll(dht))
    try:
        if not await wait_online(dht, manifest, settings.replicas, START_TIMEOUT):
            raise RuntimeError("the peers did not all announce online")
        trainers = [
            TimedTrainer(manifest, dht, p2p, f"{dht.peer_id}-trainer{k}", seed=k) for k in range(settings.trainers)
        ]
        target = settings.samples

        def progress() -> float:
            return sum(t.samples for t in trainers) / target

        shards = [
            TextData.load(manifest.data.source, manifest.data.heldout_fraction, k, manifest.data.shards).train
            for k in range(settings.trainers)
        ]
        stop = asyncio.Event()
        began = time.monotonic()
        swarm.say(f"training {target} samples with {settings.trainers} trainers; {len(events)} faults planned")
        injector = [asyncio.create_task(swarm.run_event(e, progress)) for e in events]
        reporter = asyncio.create_task(report_progress(swarm, trainers, target))
        share = target // settings.trainers
        ender = None
        if settings.after_faults is not None:  # no sample count: the trainers train until ender stops them
            share = None
            ender = asyncio.create_task(stop_after_faults(trainers, injector, target, settings.after_faults, stop))
        await asyncio.gather(*[t.train(shard, stop, max_samples=share) for t, shard in zip(trainers, shards)])
        if ender is not None:
            await ender
        train_seconds = time.monotonic() - began
        reporter.cancel()
        swarm.say(f"trained {sum(t.samples for t in trainers)} samples in {train_seconds:.0f}s")
        pending = [task for task in injector if not task.done()]
        if pending:  # a fault that had not fired is called off; a restart under way is waited for
            for task, event in zip(injector, events):
                if event.fired_at is None:
                    task.cancel()
            done, late = await asyncio.wait(pending, timeout=EVENTS_TIMEOUT)
            for task in late:
                task.cancel()
        for task in injector:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        # the final states, from every peer that serves (after one more announcement of each)
        if not await wait_online(dht, manifest, settings.replicas, START_TIMEOUT):
            swarm.say("not every peer is online at the end; evaluating those that are")
        await asyncio.sleep(manifest.network.announce_period * 1.5)

        def failed(stage: int, peer_id: str, error: Exception) -> None:
            swarm.say(f"downloading the state of stage {stage} from {peer_id[-8:]} failed: {error!r}")

        states = await download_parameters(p2p, manifest, await online_by_stage(dht, manifest), 120, failed)
        for stage, replicas in enumerate(states):
            if not replicas:
                raise RuntimeError(f"no peer of stage {stage} gave its state at the end")
        losses = swarm_heldout_losses(manifest, states, batches)
        return {
            "trainers": trainers,
            "train_seconds": train_seconds,
            "began": began,
            "heldout_loss": float(np.mean(losses)),
            "heldout_loss_spread": float(np.max(losses) - np.min(losses)),
            "final_replicas": [len(replicas) for replicas in states],
        }
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await p2p.shutdown()


async def report_progress(swarm: Swarm, trainers: list[TimedTrainer], target: int) -> None:
    while True:
        await asyncio.sleep(PROGRESS_PERIOD)
        down = [p.name + (" (stopped)" if p.stopped else "") for p in swarm.peers if p.down]
        failed = sum(t.failed_microbatches for t in trainers)
        swarm.say(
            f"{sum(t.samples for t in trainers)}/{target} samples, {failed} microbatches lost"
            + (f"; down: {', '.join(down)}" if down else "")
        )


def capture_trainer_log(path: Path) -> list[logging.Handler]:
    """The trainers' log, INFO included (their bans of peers, with reasons), into `path`; warnings also to stderr."""
    logger = logging.getLogger(Trainer.__module__)
    formatter = logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.FileHandler(path), logging.StreamHandler(sys.stderr)]
    handlers[1].setLevel(logging.WARNING)
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handlers


def release_trainer_log(handlers: list[logging.Handler]) -> None:
    logger = logging.getLogger(Trainer.__module__)
    for handler in handlers:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
