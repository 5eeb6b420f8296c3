"""Benchmark: a real swarm of peers with different memory, serving spans, against the equal-stage swarm.

    python -m benchmarks.span_swarm [--samples 8192] [--seeds 0] [--runs es]

The same 8-block model (the tiny preset, 8 layers) trained on the same samples by two trainers in this process
(each on its own data shard and half of the samples), two ways:
  (e) equal stages: 4 stages of 2 blocks, 2 peers each (8 peers), the swarm of today;
  (s) spans: 8 one-block stages (balancing.spans), 6 peers whose --max-memory caps (set by the peers' own arithmetic,
      swarm/capacity/costs.py) hold 4, 4, 2, 2, 1 and 1 blocks; each chooses where its span goes. Halfway
      through, one of the peers holding 4 blocks is killed (the one whose leaving leaves the most blocks with no
      other holder): the others must move to cover its blocks again, and training goes on.
Held-out loss: every serving peer's final state of every stage is downloaded and the model assembled from one
holder per stage, for up to MAX_COMBINATIONS random combinations (all of them when fewer); the figure is the mean.
Goal (issue 32): the spans swarm's loss at most 1.02x the equal-stage swarm's.

Prints one JSON line: per run the held-out loss, seconds, samples/s (absolute, this CPU) and failed microbatches;
for the spans run the spans the peers chose, the blocks' holders before and after the kill, and the seconds from
the kill until every block was served again. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    download_parameters,
    eval_batches,
    heldout_loss,
    online_by_stage,
    stop_on_sigterm,
)
from swarm.capacity.budget import MARGIN
from swarm.capacity.costs import MemorySettings, longest_span, span_cost
from swarm.client.export import assemble_full_state
from swarm.client.trainer import Trainer
from swarm.dataset.shards import TextData
from swarm.dht import node
from swarm.local.processes import PeerProcess, start_local_peer, stop_peers
from swarm.manifests.manifest import Manifest
from swarm.manifests.presets import new_manifest

BLOCKS = 8
SPAN_PEERS = (4, 4, 2, 2, 1, 1)  # blocks each peer's memory holds
EQUAL_STAGES, EQUAL_REPLICAS = 4, 2
TRAINERS = 2
EVAL_BATCHES = 16
MAX_COMBINATIONS = 32
POLL = 1.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def swarm_manifest(seed: int, spans: bool) -> Manifest:
    model = {"depth": BLOCKS, "context_length": 64, "seed": seed}
    stages, balancing = (BLOCKS, {"spans": True, "check_period": 5.0}) if spans else (EQUAL_STAGES, None)
    return new_manifest(f"spans-{spans}-{seed}", "tiny", stages=stages, model=model, balancing=balancing)


def memory_cap(manifest: Manifest, blocks: int) -> int:
    """A --max-memory under which a CPU peer holds `blocks` one-block stages from any start, not one more."""
    cpu = MemorySettings(cuda=False)
    needed = max(span_cost(manifest, s, s + blocks, cpu).device_bytes for s in range(BLOCKS - blocks + 1))
    cap = int(needed / (1 - MARGIN)) + 1024
    fits = longest_span(manifest, 1, int(cap * (1 - MARGIN)), cpu)
    assert fits == blocks, f"a cap for {blocks} blocks holds {fits}"
    return cap


def covered(peers: list[PeerProcess]) -> list[int]:
    """How many living, serving peers hold each stage, by their last status lines."""
    holders = [0] * BLOCKS
    for peer in peers:
        lines = peer.status_lines() if peer.poll() is None else []
        if lines and lines[-1].get("state") == "online" and lines[-1].get("span"):
            start, end = lines[-1]["span"]
            for stage in range(start, end):
                holders[stage] += 1
    return holders


def spans_of(peers: list[PeerProcess]) -> list[list[int] | None]:
    return [(peer.status_lines() or [{}])[-1].get("span") for peer in peers]


async def train_swarm(
    manifest: Manifest, dht, samples: int, seed: int, halfway=None
) -> tuple[float, int, int, float, list]:
    """Two trainers, samples/2 each; `halfway()` (blocking) runs once they are half done, training on meanwhile.
    Returns (seconds, samples, failed microbatches, held-out loss, what halfway returned)."""
    p2p = await dht.replicate_p2p()
    shards = [
        TextData.load(manifest.data.source, manifest.data.heldout_fraction, k, manifest.data.shards).train
        for k in range(TRAINERS)
    ]
    trainers = [Trainer(manifest, dht, p2p, f"{dht.peer_id}-t{k}", seed=100 * seed + k) for k in range(TRAINERS)]
    stop, begin = asyncio.Event(), time.monotonic()
    runs = [
        asyncio.create_task(t.train(shards[k], stop, max_samples=samples // TRAINERS)) for k, t in enumerate(trainers)
    ]
    extra = None
    if halfway is not None:
        while sum(t.samples for t in trainers) < samples // 2 and not all(r.done() for r in runs):
            await asyncio.sleep(POLL)
        extra = await asyncio.to_thread(halfway, trainers)
    await asyncio.gather(*runs)
    seconds = time.monotonic() - begin
    await asyncio.sleep(manifest.network.announce_period * 2)
    online = await online_by_stage(dht, manifest)
    states = await download_parameters(p2p, manifest, online, timeout=120, on_error=lambda *e: log(f"skipped {e}"))
    loss = swarm_loss(manifest, states, seed)
    await p2p.shutdown()
    return seconds, sum(t.samples for t in trainers), sum(t.failed_microbatches for t in trainers), loss, extra


def swarm_loss(manifest: Manifest, states: list[list[dict]], seed: int) -> float:
    """The mean held-out loss of models assembled from one holder per stage (random combinations, at most
    MAX_COMBINATIONS)."""
    batches = eval_batches(manifest, EVAL_BATCHES)
    rng = random.Random(seed)
    if any(not holders for holders in states):
        raise RuntimeError(f"a stage has no state to evaluate: holders per stage {[len(h) for h in states]}")
    total = int(np.prod([len(h) for h in states]))
    if total <= MAX_COMBINATIONS:
        combinations = list(itertools.product(*states))
    else:
        combinations = [[rng.choice(holders) for holders in states] for _ in range(MAX_COMBINATIONS)]
    losses = [heldout_loss(manifest, assemble_full_state(manifest, list(c)), batches) for c in combinations]
    return float(np.mean(losses))


def wait_serving(peers: list[PeerProcess], ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the swarm did not come up in {timeout:g}s: spans {spans_of(peers)}")
        for peer in peers:
            if peer.poll() is not None:
                raise RuntimeError(f"a peer exited: {peer.tail()}")
        time.sleep(POLL)


def start_swarm(seed: int, spans: bool, workdir: Path) -> tuple[Manifest, object, Path]:
    """The run's manifest joined to a DHT node of this process, written to the run's folder."""
    manifest = swarm_manifest(seed, spans=spans)
    dht = node.start_dht([], node.LOOPBACK)
    manifest = manifest.with_initial_peers([str(a) for a in dht.get_visible_maddrs()])
    path = workdir / f"{'spans' if spans else 'equal'}-{seed}.json"
    path.write_text(manifest.to_json())
    return manifest, dht, path


def equal_run(seed: int, samples: int, workdir: Path) -> dict:
    manifest, dht, path = start_swarm(seed, False, workdir)
    peers: list[PeerProcess] = []
    try:
        for stage, replica in itertools.product(range(EQUAL_STAGES), range(EQUAL_REPLICAS)):
            peers.append(start_local_peer(path, stage, workdir / f"equal-{seed}-{stage}-{replica}.log", trainer=False))
        wait_serving(
            peers, lambda: all(len(p.status_lines()) and p.status_lines()[-1].get("state") == "online" for p in peers)
        )
        log(f"equal stages: {len(peers)} peers online; training")
        seconds, done, failed, loss, _ = asyncio.run(train_swarm(manifest, dht, samples, seed))
    finally:
        stop_peers(peers)
        dht.shutdown()
    return {"heldout_loss": loss, "seconds": seconds, "samples": done, "failed_microbatches": failed}


def span_run(seed: int, samples: int, workdir: Path) -> dict:
    manifest, dht, path = start_swarm(seed, True, workdir)
    peers: list[PeerProcess] = []
    figures: dict = {}
    try:
        for k, blocks in enumerate(SPAN_PEERS):
            extra = ["--max-memory", str(memory_cap(manifest, blocks)), "--status-every", "1"]
            peers.append(start_local_peer(path, None, workdir / f"spans-{seed}-{k}.log", trainer=False, extra=extra))
        wait_serving(peers, lambda: min(covered(peers)) >= 1 and all(s for s in spans_of(peers)))
        figures["spans_chosen"] = spans_of(peers)
        log(f"spans: peers serve {figures['spans_chosen']}; holders per block {covered(peers)}; training")

        def kill_a_large_peer(trainers) -> dict:
            holders = covered(peers)
            # of the peers holding the most blocks, the one whose leaving uncovers the most blocks: the others
            # must move to serve them again
            largest = [p for p, s in zip(peers, spans_of(peers)) if s and s[1] - s[0] == max(SPAN_PEERS)]
            large = max(largest, key=lambda p: covered([q for q in peers if q is not p]).count(0))
            span = spans_of([large])[0]
            killed_at = time.monotonic()
            large.kill()
            log(f"killed the peer serving {span}; holders were {holders}")
            living = [p for p in peers if p is not large]
            unheld = covered(living).count(0)
            while min(covered(living)) < 1 and time.monotonic() - killed_at < 300:
                time.sleep(POLL)
            recovered = time.monotonic() - killed_at
            log(f"every block served again after {recovered:.1f}s: spans {spans_of(living)}")
            return {
                "killed_span": span,
                "holders_before_kill": holders,
                "blocks_unheld_at_kill": unheld,
                "holders_after_kill": covered(living),
                "spans_after_kill": spans_of(living),
                "covered_again_seconds": round(recovered, 1) if min(covered(living)) >= 1 else None,
            }

        seconds, done, failed, loss, after = asyncio.run(train_swarm(manifest, dht, samples, seed, kill_a_large_peer))
        figures.update(after or {})
        figures["moves"] = sum((p.status_lines() or [{}])[-1].get("moves", 0) for p in peers if p.poll() is None)
    finally:
        stop_peers(peers)
        dht.shutdown()
    return {"heldout_loss": loss, "seconds": seconds, "samples": done, "failed_microbatches": failed, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8192, help="samples per run, over both trainers")
    parser.add_argument("--seeds", default="0", help="comma-separated model/data seeds")
    parser.add_argument("--runs", default="es", help="e: equal stages, s: spans")
    args = parser.parse_args()
    stop_on_sigterm()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {"e": [], "s": []}
    with tempfile.TemporaryDirectory(prefix="span-swarm-") as folder:
        for seed in seeds:
            for run in args.runs:
                log(f"seed {seed}: {'equal stages' if run == 'e' else 'spans'}")
                workdir = Path(folder) / f"{run}{seed}"
                workdir.mkdir()
                result = (equal_run if run == "e" else span_run)(seed, args.samples, workdir)
                result["samples_per_second"] = round(result["samples"] / result["seconds"], 1)
                log(f"seed {seed} {run}: {result}")
                results[run].append(result)
    out: dict = {"samples": args.samples, "seeds": seeds, "span_peers_blocks": list(SPAN_PEERS)}
    for run, name in (("e", "equal"), ("s", "spans")):
        if results[run]:
            out[f"heldout_loss_{name}"] = round(float(np.mean([r["heldout_loss"] for r in results[run]])), 4)
            out[f"samples_per_second_{name}"] = round(
                float(np.mean([r["samples_per_second"] for r in results[run]])), 1
            )
            out[f"failed_microbatches_{name}"] = sum(r["failed_microbatches"] for r in results[run])
            out[f"runs_{name}"] = results[run]
    if results["e"] and results["s"]:
        out["loss_ratio_spans_over_equal"] = round(out["heldout_loss_spans"] / out["heldout_loss_equal"], 4)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
