"""Convergence benchmark: does a swarm whose replicas average train as well as one process, on the same tokens?

    python benchmarks/convergence.py [--samples 16384] [--manifest examples/demo.json] [--runs abcd]
                                     [--every-samples N] [--compression 8bit] [--max-in-flight 1]

(a) trains the whole model in one process; (b), (c), (d) train it in a local swarm with 2 replicas per stage
(one stage peer each, 1 thread) driven by two trainers in this process, each on its own data shard and half
of the samples: (b) with parameter averaging, (c) in DiLoCo mode, (d) with replicas that never average. (a)
alternates microbatches from the same two shards. All runs share the model, seed, optimizer, microbatch size
and steps; the averaging settings are the manifest's (--every-samples and --compression override them).

Held-out loss: every peer's final state is downloaded; the model is assembled for every combination of
replicas (one per stage) and evaluated on fixed held-out batches; the figure is the mean over combinations,
i.e. the loss of the models the swarm actually serves.

Bytes: "averaging bytes per token" is what the peers sent in averaging rounds (their announced totals) per
token trained. "allreduce_over_actual" is what all-reducing fp32 gradients after every local optimizer step
would have sent (each replica 2(n-1)/n x 4 bytes x its stage's parameters per step) over what was sent.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    download_parameters,
    eval_batches,
    heldout_loss,
    online_by_stage,
    swarm_heldout_losses,
    wait_online,
)
from peers import runtime  # noqa: E402
from peers.processes import start_local_peer, stop_peers  # noqa: E402
from swarm import joining  # noqa: E402
from swarm.client.trainer import Trainer  # noqa: E402
from swarm.data import TextData, sample_batch  # noqa: E402
from swarm.manifest import Manifest  # noqa: E402
from swarm.manifest_loading import load_manifest  # noqa: E402
from swarm.model import build_full_model, build_stage, count_parameters  # noqa: E402

REPLICAS = 2
EVAL_BATCHES = 16


def shard_data(manifest: Manifest, shard: int) -> np.ndarray:
    return TextData.load(manifest.data.source, manifest.data.heldout_fraction, shard, manifest.data.shards).train


def single_process(manifest: Manifest, samples: int, batches) -> dict:
    """(a): one model, microbatches alternating between the two trainers' shards, one step per k microbatches."""
    torch.manual_seed(0)
    training = manifest.training
    shards = [shard_data(manifest, s) for s in range(REPLICAS)]
    rngs = [np.random.default_rng(s) for s in range(REPLICAS)]
    model = build_full_model(manifest.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
    begin = time.monotonic()
    for i in range(samples // training.microbatch_size):
        tokens = shards[i % REPLICAS]
        x, y = sample_batch(tokens, training.microbatch_size, manifest.model.context_length, rngs[i % REPLICAS])
        (model.loss(model(x), y) / training.microbatches_per_step).backward()
        if (i + 1) % training.microbatches_per_step == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    seconds = time.monotonic() - begin
    state = {name: p.detach() for name, p in model.named_parameters()}
    return {"heldout_loss": heldout_loss(manifest, state, batches), "seconds": seconds}


def swarm_run(manifest: Manifest, mode: str, samples: int, batches, workdir: Path) -> dict:
    """(b)/(c)/(d): 2 replicas per stage, 2 trainers here, then every replica's state downloaded."""
    manifest = dataclasses.replace(manifest, averaging=dataclasses.replace(manifest.averaging, mode=mode))
    logs = workdir / mode
    logs.mkdir(parents=True)
    dht = joining.start_dht([], joining.LOOPBACK)
    manifest = manifest.with_initial_peers([str(a) for a in dht.get_visible_maddrs()])
    path = logs / "manifest.json"
    path.write_text(manifest.to_json())
    peers = []
    try:
        for stage, replica in itertools.product(range(manifest.num_stages), range(REPLICAS)):
            peers.append(
                start_local_peer(
                    path,
                    stage,
                    logs / f"stage{stage}-replica{replica}.log",
                    trainer=False,
                    extra=["--checkpoint-dir", str(logs / "checkpoints"), "--checkpoint-every", "0"],
                )
            )
        return asyncio.run(_drive(dht, manifest, samples, batches))
    finally:
        stop_peers(peers)
        dht.shutdown()


async def _drive(dht, manifest: Manifest, samples: int, batches) -> dict:
    p2p = await dht.replicate_p2p()
    if not await wait_online(dht, manifest, REPLICAS, timeout=180):
        raise RuntimeError("the swarm's peers did not come online within 3 minutes")
    trainers = [Trainer(manifest, dht, p2p, f"{dht.peer_id}-trainer{k}", seed=k) for k in range(REPLICAS)]
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
        "heldout_loss_spread": float(np.max(losses) - np.min(losses)),
        "replica_distance": float(np.mean(distances)),
        "seconds": seconds,
        "samples": sum(t.samples for t in trainers),
        "failed_microbatches": sum(t.failed_microbatches for t in trainers),
        "averaging_bytes": sum(a.averaging_bytes_sent for a in announcements),
        "activation_bytes": sum(a.activation_bytes_sent for a in announcements),
        "rounds": min(a.averaging_rounds for a in announcements),
        "allreduce_bytes": allreduce,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16384, help="samples trained by each run (default 16384)")
    parser.add_argument("--manifest", default=str(ROOT / "examples" / "demo.json"))
    parser.add_argument("--runs", default="abcd", help="which runs (default abcd)")
    parser.add_argument("--every-samples", type=int, default=None, help="override averaging.every_samples")
    parser.add_argument("--compression", default=None, help="override averaging.compression")
    parser.add_argument(
        "--max-in-flight", type=int, default=None, help="override training.max_in_flight (microbatches per trainer)"
    )
    args = parser.parse_args()
    runtime.setup_logging("WARNING")
    torch.set_num_threads(1)  # like each peer: the comparison is of the method, on the same compute per step
    manifest = load_manifest(args.manifest)
    overrides = {}
    if args.every_samples is not None:
        overrides["every_samples"] = args.every_samples
    if args.compression is not None:
        overrides["compression"] = args.compression
    manifest = dataclasses.replace(manifest, averaging=dataclasses.replace(manifest.averaging, **overrides))
    if args.max_in_flight is not None:
        training = dataclasses.replace(manifest.training, max_in_flight=args.max_in_flight)
        manifest = dataclasses.replace(manifest, training=training)
    batches = eval_batches(manifest, EVAL_BATCHES)
    tokens = args.samples * manifest.model.context_length
    result: dict = {
        "samples": args.samples,
        "tokens": tokens,
        "every_samples": manifest.averaging.every_samples,
        "compression": manifest.averaging.compression,
        "max_in_flight": manifest.training.max_in_flight,
        "initial_heldout_loss": round(
            heldout_loss(manifest, dict(build_full_model(manifest.model).named_parameters()), batches), 4
        ),
    }
    workdir = Path(tempfile.mkdtemp(prefix="swarm-convergence-"))
    runs = {}
    if "a" in args.runs:
        runs["a"] = single_process(manifest, args.samples, batches)
        print(f"(a) one process: held-out loss {runs['a']['heldout_loss']:.4f}", file=sys.stderr)
    for key, mode in (("b", "parameters"), ("c", "diloco"), ("d", "none")):
        if key in args.runs:
            runs[key] = swarm_run(manifest, mode, args.samples, batches, workdir)
            print(f"({key}) {mode}: {json.dumps(runs[key])}", file=sys.stderr)
    for key, run in runs.items():
        result[f"heldout_loss_{key}"] = round(run["heldout_loss"], 4)
        result[f"seconds_{key}"] = round(run["seconds"], 1)
        if "a" in runs and key != "a":
            result[f"ratio_{key}_to_a"] = round(run["heldout_loss"] / runs["a"]["heldout_loss"], 4)
        if key in ("b", "c", "d"):
            result[f"replica_distance_{key}"] = round(run["replica_distance"], 4)
            result[f"failed_microbatches_{key}"] = run["failed_microbatches"]
        if key in ("b", "c"):
            sent = run["averaging_bytes"]
            result[f"rounds_{key}"] = run["rounds"]
            result[f"averaging_bytes_per_token_{key}"] = round(sent / tokens, 2)
            result[f"allreduce_over_actual_{key}"] = round(run["allreduce_bytes"] / sent, 1) if sent else math.inf
    print(f"peer logs: {workdir}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
