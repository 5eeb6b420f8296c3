"""Stale-gradient benchmark: two stages in one process, N microbatches in flight, with and without the delay-scaled
learning rate (swarm/server/staleness.py).

    python benchmarks/staleness.py [--samples 3072] [--windows 1,2,4,8] [--manifest examples/demo.json]

Stage 0 runs forward for a microbatch, and its backward only once `window` microbatches are in flight, as in a
pipeline whose round trip spans `window` microbatches; the last stage runs forward and backward at once. No network,
so the figure is the optimisation's alone: the mean train loss of the last 20 microbatches, and stage 0's measured
delay in optimizer steps. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm import protocol  # noqa: E402
from swarm.data import TextData, sample_batch  # noqa: E402
from swarm.manifest import manifest_from_dict  # noqa: E402
from swarm.model import build_stage  # noqa: E402
from swarm.server.compute import StageCompute  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(raw: dict, window: int, scaled: bool, samples: int) -> tuple[float, float]:
    raw = {**raw, "training": {**raw["training"], "delay_scaled_lr": scaled}, "stages": {"count": 2}}
    manifest = manifest_from_dict(raw)
    torch.manual_seed(0)
    first = StageCompute(manifest, 0, build_stage(manifest, 0), torch.device("cpu"))
    last = StageCompute(manifest, 1, build_stage(manifest, 1), torch.device("cpu"))
    data = TextData.load(manifest.data.source, manifest.data.heldout_fraction, shard=0, shards=manifest.data.shards)
    rng = np.random.default_rng(0)
    in_flight: collections.deque = collections.deque()
    losses: list[float] = []
    done = count = 0
    while done < samples:
        x, y = sample_batch(data.train, manifest.training.microbatch_size, manifest.model.context_length, rng)
        microbatch, count = f"m{count}", count + 1
        (hidden,) = first.process("forward", protocol.StageRequest(0, microbatch, True, [x]), "trainer")
        in_flight.append((microbatch, x, y, hidden))
        if len(in_flight) >= window:
            microbatch, x, y, hidden = in_flight.popleft()
            loss, grad = last.process("forward", protocol.StageRequest(1, microbatch, True, [hidden, y]), "trainer")
            first.process("backward", protocol.StageRequest(0, microbatch, True, [grad, x]), "trainer")
            losses.append(float(loss))
            done += x.shape[0]
    return float(np.mean(losses[-20:])), first.staleness.delay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--windows", default="1,2,4,8")
    parser.add_argument("--manifest", default=str(ROOT / "examples" / "demo.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    raw = json.loads(Path(args.manifest).read_text())
    raw["initial_peers"] = []
    result: dict[str, float] = {"samples": args.samples}
    for window in [int(w) for w in args.windows.split(",")]:
        for scaled in (False, True):
            loss, delay = run(raw, window, scaled, args.samples)
            key = f"window_{window}_{'scaled' if scaled else 'full'}_lr"
            result[f"{key}_loss"] = round(loss, 3)
            result[f"{key}_delay"] = round(delay, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
