"""Stale-gradient benchmark: two stages in one process, N microbatches in flight, with and without the delay-scaled
learning rate (swarm/server/staleness.py).

    python benchmarks/staleness.py [--samples 3072] [--windows 1,2,4,8] [--manifest examples/demo.json]
                                   [--activation-compression float32|float16|8bit] [--lr both|full|scaled]

Stage 0 runs forward for a microbatch, and its backward only once `window` microbatches are in flight, as in a
pipeline whose round trip spans `window` microbatches; the last stage runs forward and backward at once. No network,
so the figure is the optimisation's alone: the held-out loss at the end (64 fixed held-out microbatches), the mean
train loss of the last 20 microbatches, and stage 0's measured delay in optimizer steps. Activations and gradients
pass through the wire encoding (swarm/wire/tensors.py) between the stages, as they would between peers, in the
manifest's activation_compression or --activation-compression. Prints one JSON line.
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

from swarm.architectures.model import build_stage  # noqa: E402
from swarm.dataset.shards import TextData, heldout_batches, sample_batch  # noqa: E402
from swarm.manifests.validation import manifest_from_dict  # noqa: E402
from swarm.server.compute import StageCompute  # noqa: E402
from swarm.wire import messages, tensors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def wire(tensor: torch.Tensor, compression: str) -> torch.Tensor:
    """The tensor as the receiving peer sees it."""
    return tensors.decode_tensor(tensors.encode_tensor(tensor, compression), tensor.numel(), "wire")


def heldout(first: StageCompute, last: StageCompute, batches: list) -> float:
    """Mean loss of the two stages' current weights on held-out batches (forward only)."""
    losses = []
    for index, (x, y) in enumerate(batches):
        (hidden,) = first.process("forward", messages.StageRequest(0, f"h{index}", False, [x]), "eval")
        (loss,) = last.process("forward", messages.StageRequest(1, f"h{index}", False, [hidden, y]), "eval")
        losses.append(float(loss))
    return float(np.mean(losses))


def run(raw: dict, window: int, scaled: bool, samples: int, compression: str) -> tuple[float, float, float]:
    training = {**raw["training"], "delay_scaled_lr": scaled, "activation_compression": compression}
    raw = {**raw, "training": training, "stages": {"count": 2}}
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
        (hidden,) = first.process("forward", messages.StageRequest(0, microbatch, True, [x]), "trainer")
        in_flight.append((microbatch, x, y, wire(hidden, compression)))
        if len(in_flight) >= window:
            microbatch, x, y, hidden = in_flight.popleft()
            loss, grad = last.process("forward", messages.StageRequest(1, microbatch, True, [hidden, y]), "trainer")
            grad = wire(grad, compression)
            first.process("backward", messages.StageRequest(0, microbatch, True, [grad, x]), "trainer")
            losses.append(float(loss))
            done += x.shape[0]
    batches = heldout_batches(data.heldout, 64, manifest.training.microbatch_size, manifest.model.context_length)
    return heldout(first, last, batches), float(np.mean(losses[-20:])), first.staleness.delay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--windows", default="1,2,4,8")
    parser.add_argument("--manifest", default=str(ROOT / "examples" / "demo.json"))
    parser.add_argument("--activation-compression", choices=list(tensors.COMPRESSIONS), help="default: the manifest's")
    parser.add_argument("--lr", choices=["both", "full", "scaled"], default="both", help="learning rate(s) to run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    raw = json.loads(Path(args.manifest).read_text())
    raw["initial_peers"] = []
    if args.activation_compression is None:
        args.activation_compression = manifest_from_dict(raw).training.activation_compression
    result: dict[str, float | str] = {"samples": args.samples, "activation_compression": args.activation_compression}
    lrs = {"both": (False, True), "full": (False,), "scaled": (True,)}[args.lr]
    for window in [int(w) for w in args.windows.split(",")]:
        for scaled in lrs:
            held, loss, delay = run(raw, window, scaled, args.samples, args.activation_compression)
            key = f"window_{window}_{'scaled' if scaled else 'full'}_lr"
            result[f"{key}_heldout"] = round(held, 3)
            result[f"{key}_loss"] = round(loss, 3)
            result[f"{key}_delay"] = round(delay, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
