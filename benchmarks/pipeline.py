"""Pipeline benchmark: one process vs. a local swarm with one peer per stage, same model, data and samples.

    python -m benchmarks.pipeline [--samples 2048] [--manifest examples/demo.json] [--pipeline forward|relay]
                                  [--max-in-flight 4] [--fixed-window]

(a) trains the whole model in one process (torch's default threads); (b) trains it through 2 stage peers on
loopback (1 thread each) driven by a trainer in this process. Prints one JSON line: samples per second of
each, their ratio b/a, bytes per sample between stages (stage 0's peer's, or with the relay pipeline the
trainer's) and on the trainer's own link, the trainer's window at the end, final train losses, and peak memory
(VmHWM) of the largest peer process against the single process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from peers import runtime
from swarm.architectures.model import build_full_model
from swarm.client.trainer import Trainer
from swarm.dataset.shards import TextData, sample_batch
from swarm.dht import node
from swarm.dht.records import PeerState, fetch_announcements
from swarm.local.processes import start_local_peer, stop_peers
from swarm.manifests.loading import load_manifest
from swarm.manifests.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]  # the repository


def peak_memory_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def single_process(manifest: Manifest, samples: int) -> dict:
    """(a): the same training, forward+backward of the whole model, one optimizer step per k microbatches."""
    training = manifest.training
    data = TextData.load(manifest.data.source, manifest.data.heldout_fraction, shard=0, shards=manifest.data.shards)
    rng = np.random.default_rng(0)
    model = build_full_model(manifest.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
    microbatches = samples // training.microbatch_size
    start = time.perf_counter()
    losses = []
    for i in range(microbatches):
        x, y = sample_batch(data.train, training.microbatch_size, manifest.model.context_length, rng)
        loss = model.loss(model(x), y) / training.microbatches_per_step
        loss.backward()
        losses.append(float(loss) * training.microbatches_per_step)
        if (i + 1) % training.microbatches_per_step == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    return {
        "samples_per_second": microbatches * training.microbatch_size / elapsed,
        "final_train_loss": float(np.mean(losses[-10:])),
        "peak_memory_mb": peak_memory_mb(__import__("os").getpid()),
        "threads": torch.get_num_threads(),
    }


def swarm(manifest_path: Path, samples: int) -> dict:
    """(b): 2 stage peers on loopback, a trainer here."""
    manifest = load_manifest(manifest_path)
    dht = node.start_dht([], node.LOOPBACK)
    logs = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    manifest = manifest.with_initial_peers([str(a) for a in dht.get_visible_maddrs()])
    path = logs / "manifest.json"
    path.write_text(manifest.to_json())
    data = TextData.load(manifest.data.source, manifest.data.heldout_fraction, shard=0, shards=manifest.data.shards)
    peers = []
    keep_logs = logs
    try:
        for stage in range(manifest.num_stages):
            peers.append(start_local_peer(path, stage, logs / f"peer{stage}.log", trainer=False))

        async def run() -> dict:
            p2p = await dht.replicate_p2p()
            while True:
                online = [
                    any(a.state == PeerState.ONLINE for a in await fetch_announcements(dht, manifest.swarm_id, s))
                    for s in range(manifest.num_stages)
                ]
                if all(online):
                    break
                await asyncio.sleep(0.5)
            trainer = Trainer(manifest, dht, p2p, str(dht.peer_id), seed=0)
            start = time.perf_counter()
            await trainer.train(data.train, asyncio.Event(), max_samples=samples)
            elapsed = time.perf_counter() - start
            loss = float(np.mean([r[1] for r in list(trainer.recent)[-10:]]))
            await asyncio.sleep(2 * manifest.network.announce_period)  # the stage peers' last counts
            first = [a for a in await fetch_announcements(dht, manifest.swarm_id, 0) if a.state == PeerState.ONLINE]
            between = sum(a.activation_bytes_sent + a.activation_bytes_received for a in first)
            if manifest.training.pipeline == "relay":  # stage 0's peer talks only to the trainer: count both links
                between = trainer.bytes_sent + trainer.bytes_received
            await p2p.shutdown()
            return {
                "samples_per_second": trainer.samples / elapsed,
                "final_train_loss": loss,
                "bytes_per_sample": between / trainer.samples,
                "trainer_bytes_per_sample": (trainer.bytes_sent + trainer.bytes_received) / trainer.samples,
                "window": trainer.window.size,
                "failed_microbatches": trainer.failed_microbatches,
                "peak_memory_mb": max(peak_memory_mb(p.pid) for p in peers),
            }

        return asyncio.run(run())
    finally:
        stop_peers(peers)
        dht.shutdown()
        print(f"peer logs: {keep_logs}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--manifest", default=str(ROOT / "examples" / "demo.json"))
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=4,
        help="microbatches the one trainer keeps in flight (default 4: with a single trainer, pipelining needs it)",
    )
    parser.add_argument("--pipeline", choices=["forward", "relay"], default="forward", help="default: forward")
    parser.add_argument(
        "--fixed-window", action="store_true", help="always --max-in-flight in flight (default: adaptive up to it)"
    )
    parser.add_argument(
        "--no-delay-scaled-lr",
        action="store_true",
        help="full learning rate at every stage, however late its gradients",
    )
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # internal: run (a) and exit
    args = parser.parse_args()
    runtime.setup_logging("WARNING")
    raw = json.loads(Path(args.manifest).read_text())
    raw.setdefault("training", {})["max_in_flight"] = args.max_in_flight
    raw["training"]["pipeline"] = args.pipeline
    raw["training"]["adaptive_window"] = not args.fixed_window
    raw["training"]["delay_scaled_lr"] = not args.no_delay_scaled_lr
    args.manifest = str(Path(tempfile.mkdtemp(prefix="swarm-pipeline-")) / "manifest.json")
    Path(args.manifest).write_text(json.dumps(raw))
    manifest = load_manifest(args.manifest)
    if args.single:
        print(json.dumps(single_process(manifest, args.samples)))
        return
    # (a) runs in its own process, so that its peak memory is its own
    single_out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.pipeline",
            "--single",
            "--samples",
            str(args.samples),
            "--manifest",
            args.manifest,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    a = json.loads(single_out.strip().splitlines()[-1])
    b = swarm(Path(args.manifest), args.samples)
    print(
        json.dumps(
            {
                "samples": args.samples,
                "single_samples_per_second": round(a["samples_per_second"], 2),
                "swarm_samples_per_second": round(b["samples_per_second"], 2),
                "ratio_b_over_a": round(b["samples_per_second"] / a["samples_per_second"], 3),
                "pipeline": args.pipeline,
                "bytes_per_sample_between_stages": round(b["bytes_per_sample"]),
                "trainer_bytes_per_sample": round(b["trainer_bytes_per_sample"]),
                "window": b["window"],
                "delay_scaled_lr": not args.no_delay_scaled_lr,
                "single_peak_memory_mb": round(a["peak_memory_mb"], 1),
                "largest_peer_peak_memory_mb": round(b["peak_memory_mb"], 1),
                "single_final_train_loss": round(a["final_train_loss"], 3),
                "swarm_final_train_loss": round(b["final_train_loss"], 3),
                "swarm_failed_microbatches": b["failed_microbatches"],
                "single_threads": a["threads"],
            }
        )
    )


if __name__ == "__main__":
    main()
