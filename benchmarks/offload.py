"""What --offload-optimizer costs in speed: an optimizer step of a span with AdamW's statistics in RAM (stepped
parameter by parameter through the device, swarm/server/offload.py) against a plain step, beside the time of one
microbatch's forward and backward through the same span.

    python -m benchmarks.offload [--preset llama-1b] [--stages 22] [--blocks 2] [--device cuda] [--steps 5]

The span is `--blocks` middle stages of the preset split in `--stages` (one block a stage by default). On a CPU
the statistics do not move (a CPU peer's device is its RAM): what is measured there is the cost of stepping
parameter by parameter alone. On a GPU the statistics cross PCIe twice a step (16 bytes a parameter). Reported
per optimizer step: plain and offloaded seconds, the difference, and that difference as a share of the
microbatches one step takes (the preset's microbatches_per_step), i.e. the slowdown of the stage's serving.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from swarm.architectures.model import build_stage, count_parameters
from swarm.manifests.presets import new_manifest
from swarm.server.offload import OffloadedStatistics
from swarm.wire.boundary import boundary_width
from swarm.wire.state import make_optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # the first step creates the statistics
    synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - began) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--stages", type=int, default=22)
    parser.add_argument("--blocks", type=int, default=2, help="stages in the span")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    manifest = new_manifest("offload", args.preset, stages=args.stages)
    stages = [build_stage(manifest, s).to(device) for s in range(1, 1 + args.blocks)]
    params = [p for stage in stages for p in stage.parameters() if p.requires_grad]
    config, training = manifest.model, manifest.training
    shape = (training.microbatch_size, config.context_length)
    tokens = torch.randint(0, config.vocab_size, shape, device=device)
    x = torch.randn(*shape, boundary_width(manifest), device=device)  # what stage 1 receives

    def microbatch() -> None:
        h = x.requires_grad_(True)
        for stage in stages:
            h = stage(h, tokens if stage.takes_tokens else None)
        h.float().square().mean().backward()

    seconds_microbatch = timed(microbatch, device, max(1, args.steps // 2))
    plain, offloaded = make_optimizer(manifest, params), make_optimizer(manifest, params)
    statistics = OffloadedStatistics(offloaded, device)
    seconds_plain = timed(plain.step, device, args.steps)
    seconds_offloaded = timed(statistics.step, device, args.steps)
    extra = seconds_offloaded - seconds_plain
    per_step = training.microbatches_per_step
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "preset": args.preset,
                "blocks": args.blocks,
                "parameters": sum(count_parameters(stage) for stage in stages),
                "microbatch_seconds": round(seconds_microbatch, 4),
                "microbatches_per_step": per_step,
                "step_seconds_plain": round(seconds_plain, 4),
                "step_seconds_offloaded": round(seconds_offloaded, 4),
                "extra_seconds_per_step": round(extra, 4),
                "slowdown": round(extra / (per_step * seconds_microbatch + seconds_plain), 4),
                "statistics_bytes_moved_per_step": 0 if device.type == "cpu" else 16 * sum(p.numel() for p in params),
            }
        )
    )


if __name__ == "__main__":
    main()
