"""Convergence benchmark: does a swarm whose replicas average train as well as synchronous data parallel, on the
same tokens, at a fraction of its traffic?

    python -m benchmarks.convergence [--samples 16384] [--seeds 0,1] [--runs agbcd] [--manifest examples/demo.json]
                                     [--every-samples N] [--compression 8bit] [--outer-lr X] [--outer-momentum X]
                                     [--max-in-flight 1] [--links 20mbit/25ms]
    python -m benchmarks.convergence --samples 65536 --runs gbd      # the longer horizon (about an hour a seed)

Five runs on the same samples, model and optimizer: (a) one process with the replica's batch (as many sequential
optimizer steps as both replicas together: no averaging scheme can reach it at equal samples); (g) one process
with the global batch, as many samples per optimizer step as all replicas of a stage together, i.e. synchronous
data parallel with a per-step all-reduce: the anchors' baseline, written (a') in the docs; (b), (c), (d) a local
swarm with 2 replicas per stage (one stage peer each, 1 thread) driven by two trainers in this process, each on its
own data shard and half of the samples: (b) parameter averaging, (c) DiLoCo mode, (d) replicas that never average.
(a) and (g) alternate microbatches from the same two shards. The averaging settings are the manifest's (the flags
override them). Every run is repeated for each seed (the model's initialisation and the data order change); each
figure is the mean over the seeds, with its spread (max - min) and the values.

Held-out loss: every peer's final state is downloaded; the model is assembled for every combination of
replicas (one per stage) and evaluated on fixed held-out batches; the figure is the mean over combinations,
i.e. the loss of the models the swarm actually serves.

Bytes: "averaging bytes per token" is what the peers sent in averaging rounds (their announced totals) per
token trained. "allreduce_over_actual" is what (g), run as synchronous data parallel over the same replicas,
would have sent (each replica 2(n-1)/n x 4 bytes x its stage's parameters per optimizer step, fp32 gradients)
over what was sent. Rounds: per swarm run, the peers' averaging-round events by outcome (applied, skipped,
dropped, alone, caught_up) and the stage states taken to catch up, summed over the peers.

Links: with --links, every stage peer sits behind an emulated home link (swarm/local/emulated_links.py; the delay is
one-way per link, a path between two peers crosses two); rounds_succeeded is applied / (applied + skipped +
dropped) over the peers' rounds.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    download_parameters,
    eval_batches,
    heldout_loss,
    online_by_stage,
    swarm_heldout_losses,
    wait_online,
)
from peers import runtime
from swarm.architectures.model import build_full_model, build_stage, count_parameters
from swarm.client.trainer import Trainer
from swarm.dataset.shards import TextData, sample_batch
from swarm.dht import node
from swarm.local.emulated_links import EmulatedLinks, LinkSpec
from swarm.local.processes import start_local_peer, stop_peers
from swarm.manifests.loading import load_manifest
from swarm.manifests.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]  # the repository

REPLICAS = 2
EVAL_BATCHES = 16
SWARM_RUNS = {"b": "parameters", "c": "diloco", "d": "none"}
ALL_RUNS = "agbcd"


def shard_data(manifest: Manifest, shard: int) -> np.ndarray:
    return TextData.load(manifest.data.source, manifest.data.heldout_fraction, shard, manifest.data.shards).train


def with_seed(manifest: Manifest, seed: int) -> Manifest:
    """The manifest whose model initialises from `seed` (the data order follows the seed too: see the runs)."""
    return dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, seed=seed))


def single_process(manifest: Manifest, samples: int, batches, seed: int, microbatches_per_step: int) -> dict:
    """(a) and (g): one model, microbatches alternating between the two trainers' shards, one optimizer step per
    `microbatches_per_step` microbatches (a: the replica's step; g: the global batch of all replicas)."""
    torch.manual_seed(seed)
    training = manifest.training
    shards = [shard_data(manifest, s) for s in range(REPLICAS)]
    rngs = [np.random.default_rng(100 * seed + s) for s in range(REPLICAS)]
    model = build_full_model(manifest.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
    begin, steps = time.monotonic(), 0
    for i in range(samples // training.microbatch_size):
        tokens = shards[i % REPLICAS]
        x, y = sample_batch(tokens, training.microbatch_size, manifest.model.context_length, rngs[i % REPLICAS])
        (model.loss(model(x), y) / microbatches_per_step).backward()
        if (i + 1) % microbatches_per_step == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    seconds = time.monotonic() - begin
    state = {name: p.detach() for name, p in model.named_parameters()}
    return {"heldout_loss": heldout_loss(manifest, state, batches), "seconds": seconds, "optimizer_steps": steps}


def swarm_run(
    manifest: Manifest, mode: str, samples: int, batches, seed: int, workdir: Path, link: LinkSpec | None = None
) -> dict:
    """(b)/(c)/(d): 2 replicas per stage, 2 trainers here, then every replica's state downloaded. With `link`,
    every stage peer sits behind an emulated link of its own (a round between two replicas crosses both)."""
    with EmulatedLinks() if link else contextlib.nullcontext() as links:
        return _swarm_run(manifest, mode, samples, batches, seed, workdir, links, link)


def _swarm_run(
    manifest: Manifest, mode: str, samples: int, batches, seed: int, workdir: Path, links, link: LinkSpec | None
) -> dict:
    averaging = dataclasses.replace(manifest.averaging, mode=mode)
    if averaging.compression == "4bit" and mode == "parameters":  # 4 bits are diloco's default, refused here
        averaging = dataclasses.replace(averaging, compression="8bit")
    manifest = dataclasses.replace(manifest, averaging=averaging)
    logs = workdir / f"{mode}-seed{seed}"
    logs.mkdir(parents=True)
    dht = node.start_dht([], node.LOOPBACK)
    manifest = manifest.with_initial_peers([str(a) for a in dht.get_visible_maddrs()])
    path = logs / "manifest.json"
    path.write_text(manifest.to_json())
    peers = []
    try:
        for stage, replica in itertools.product(range(manifest.num_stages), range(REPLICAS)):
            extra = ["--checkpoint-dir", str(logs / "checkpoints"), "--checkpoint-every", "0"]
            if links is not None:
                extra += links.peer_flags(f"stage{stage}-replica{replica}", link)
            name = f"stage{stage}-replica{replica}.log"
            peers.append(start_local_peer(path, stage, logs / name, trainer=False, extra=extra))
        result = asyncio.run(_drive(dht, manifest, samples, batches, seed))
        return {**result, **round_outcomes(peers)}
    finally:
        stop_peers(peers)
        dht.shutdown()


def round_outcomes(peers) -> dict:
    """What the peers printed about their rounds: outcomes counted over all peers, the state downloads to catch up
    (catch_up: the whole state, local steps dropped; rebase: DiLoCo's anchor, local steps kept), and how long
    applied rounds took to find their group and to all-reduce."""
    rounds = [e for p in peers for e in p.events("averaging_round")]
    taken = Counter(e.get("reason") for p in peers for e in p.events("state_taken"))
    applied = [e for e in rounds if e.get("outcome") == "applied"]
    return {
        "round_outcomes": dict(Counter(e.get("outcome") for e in rounds)),
        "state_downloads": {reason: taken[reason] for reason in ("catch_up", "rebase") if taken[reason]},
        "matchmaking_seconds_max": max((e.get("matchmaking_seconds", 0) for e in applied), default=0.0),
        "allreduce_seconds_max": max((e.get("allreduce_seconds", 0) for e in applied), default=0.0),
    }


async def _drive(dht, manifest: Manifest, samples: int, batches, seed: int) -> dict:
    p2p = await dht.replicate_p2p()
    if not await wait_online(dht, manifest, REPLICAS, timeout=180):
        raise RuntimeError("the swarm's peers did not come online within 3 minutes")
    trainers = [Trainer(manifest, dht, p2p, f"{dht.peer_id}-trainer{k}", seed=100 * seed + k) for k in range(REPLICAS)]
    begin = time.monotonic()
    stop = asyncio.Event()
    await asyncio.gather(
        *[t.train(shard_data(manifest, k), stop, max_samples=samples // REPLICAS) for k, t in enumerate(trainers)]
    )
    seconds = time.monotonic() - begin

    # the replicas' final states, and the peers' final counters (after one more announcement)
    await asyncio.sleep(manifest.network.announce_period * 1.5)
    online = await online_by_stage(dht, manifest)
    states = await download_parameters(p2p, manifest, online, timeout=120)
    losses = swarm_heldout_losses(manifest, states, batches)
    distances = [
        sum(float((x[k] - y[k]).norm() ** 2) for k in x) ** 0.5 for x, y in (replicas[:2] for replicas in states)
    ]
    announcements = [a for anns in online for a in anns]
    allreduce = 0.0
    for stage, anns in enumerate(online):
        params = count_parameters(build_stage(manifest, stage))
        allreduce += sum(a.optimizer_steps for a in anns) * 2 * (REPLICAS - 1) / REPLICAS * 4 * params
    await p2p.shutdown()
    return {
        "heldout_loss": float(np.mean(losses)),
        "replica_distance": float(np.mean(distances)),
        "seconds": seconds,
        "samples": sum(t.samples for t in trainers),
        "failed_microbatches": sum(t.failed_microbatches for t in trainers),
        "averaging_bytes": sum(a.averaging_bytes_sent for a in announcements),
        "rounds": min(a.averaging_rounds for a in announcements),
        "allreduce_bytes": allreduce,
    }


def summary(values: list[float], digits: int = 4) -> dict:
    """Mean, spread (max - min) and the values of a figure over the seeds."""
    return {
        "mean": round(float(np.mean(values)), digits),
        "spread": round(float(np.ptp(values)), digits),
        "runs": [round(float(v), digits) for v in values],
    }


def report(key: str, runs: list[dict], tokens: int) -> dict:
    """The JSON fields of one run letter over its seeds."""
    fields: dict = {f"heldout_loss_{key}": summary([r["heldout_loss"] for r in runs])}
    fields[f"seconds_{key}"] = round(float(np.mean([r["seconds"] for r in runs])), 1)
    if key in SWARM_RUNS:
        fields[f"replica_distance_{key}"] = summary([r["replica_distance"] for r in runs], 3)
        fields[f"failed_microbatches_{key}"] = sum(r["failed_microbatches"] for r in runs)
        outcomes: Counter = Counter()
        downloads: Counter = Counter()
        for r in runs:
            outcomes.update(r["round_outcomes"])
            downloads.update(r["state_downloads"])
        fields[f"round_outcomes_{key}"] = dict(outcomes)
        due = outcomes["applied"] + outcomes["skipped"] + outcomes["dropped"]
        fields[f"rounds_succeeded_{key}"] = round(outcomes["applied"] / due, 3) if due else None
        fields[f"state_downloads_{key}"] = dict(downloads)
        fields[f"allreduce_seconds_max_{key}"] = max(r["allreduce_seconds_max"] for r in runs)
        fields[f"matchmaking_seconds_max_{key}"] = max(r["matchmaking_seconds_max"] for r in runs)
    if key in ("b", "c"):
        sent = sum(r["averaging_bytes"] for r in runs)
        fields[f"rounds_{key}"] = [r["rounds"] for r in runs]
        fields[f"averaging_bytes_per_token_{key}"] = round(sent / (tokens * len(runs)), 3)
        allreduce = sum(r["allreduce_bytes"] for r in runs)
        fields[f"allreduce_over_actual_{key}"] = round(allreduce / sent, 1) if sent else math.inf
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16384, help="samples trained by each run (default 16384)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds, each a repetition (default 0,1)")
    parser.add_argument("--manifest", default=str(ROOT / "examples" / "demo.json"))
    parser.add_argument("--runs", default=ALL_RUNS, help=f"which runs, by letter (default {ALL_RUNS})")
    parser.add_argument("--every-samples", type=int, default=None, help="override averaging.every_samples")
    parser.add_argument("--compression", default=None, help="override averaging.compression")
    parser.add_argument("--outer-lr", type=float, default=None, help="override averaging.outer_learning_rate")
    parser.add_argument("--outer-momentum", type=float, default=None, help="override averaging.outer_momentum")
    parser.add_argument(
        "--links", default=None, help="put every stage peer behind an emulated link, e.g. 20mbit/25ms (one-way)"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=None, help="override training.max_in_flight (microbatches per trainer)"
    )
    args = parser.parse_args()
    runtime.setup_logging("WARNING")
    torch.set_num_threads(1)  # like each peer: the comparison is of the method, on the same compute per step
    manifest = load_manifest(args.manifest)
    overrides = {
        name: value
        for name, value in (
            ("every_samples", args.every_samples),
            ("compression", args.compression),
            ("outer_learning_rate", args.outer_lr),
            ("outer_momentum", args.outer_momentum),
        )
        if value is not None
    }
    manifest = dataclasses.replace(manifest, averaging=dataclasses.replace(manifest.averaging, **overrides))
    if args.max_in_flight is not None:
        training = dataclasses.replace(manifest.training, max_in_flight=args.max_in_flight)
        manifest = dataclasses.replace(manifest, training=training)
    seeds = [int(s) for s in args.seeds.split(",")]
    link = LinkSpec.parse(args.links) if args.links else None
    batches = eval_batches(manifest, EVAL_BATCHES)
    tokens = args.samples * manifest.model.context_length
    averaging = manifest.averaging
    result: dict = {
        "samples": args.samples,
        "tokens": tokens,
        "seeds": seeds,
        "every_samples": averaging.every_samples,
        "compression": averaging.compression,
        "outer_learning_rate": averaging.outer_learning_rate,
        "outer_momentum": averaging.outer_momentum,
        "max_in_flight": manifest.training.max_in_flight,
        "links": args.links,
    }
    workdir = Path(tempfile.mkdtemp(prefix="swarm-convergence-"))
    print(f"peer logs: {workdir}", file=sys.stderr)
    runs: dict[str, list[dict]] = {}
    per_step = {"a": manifest.training.microbatches_per_step, "g": REPLICAS * manifest.training.microbatches_per_step}
    for key in (k for k in ALL_RUNS if k in args.runs):
        for seed in seeds:
            seeded = with_seed(manifest, seed)
            if key in per_step:
                run = single_process(seeded, args.samples, batches, seed, per_step[key])
            else:
                run = swarm_run(seeded, SWARM_RUNS[key], args.samples, batches, seed, workdir, link)
            runs.setdefault(key, []).append(run)
            print(f"({key}) seed {seed}: {json.dumps(run)}", file=sys.stderr)
    for key, key_runs in runs.items():
        result.update(report(key, key_runs, tokens))
    for key in runs:
        for base in ("a", "g"):
            if base in runs and key != base:
                ratio = result[f"heldout_loss_{key}"]["mean"] / result[f"heldout_loss_{base}"]["mean"]
                result[f"ratio_{key}_to_{base}"] = round(ratio, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
