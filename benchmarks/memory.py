"""Memory benchmark: what one stage of a preset holds while it trains one microbatch, with and without activation
checkpointing, measured on this machine's CPU.

    python -m benchmarks.memory [--preset llama-150m] [--stages 2] [--microbatch-size 8]

For each stage, in a process of its own (so that peak RSS is the stage's alone): the stage is built in the
preset's precision, one microbatch (the preset's size and context) runs forward and backward (the last stage's
loss in chunks of tokens, as a serving peer computes it), and an AdamW step is taken. Reported: activation bytes (every tensor autograd saves for backward, counted once per storage by a
saved-tensors hook; tensors that checkpointing keeps itself, each block's input, are not seen by it), the
resident memory that forward leaves held until backward (RSS after forward minus before: every activation
kept, checkpointed or not), the bytes of parameters, gradients and AdamW
state (float32), and the process's peak resident memory (ru_maxrss, which also counts torch's own ~0.3 GB and
transient buffers). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

import torch

from swarm.architectures.model import build_stage, count_parameters
from swarm.manifests.presets import new_manifest
from swarm.wire.state import make_optimizer


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(preset: str, stages: int, stage: int, checkpointing: bool, microbatch: int | None) -> dict:
    training = {"activation_checkpointing": checkpointing}
    if microbatch:
        training["microbatch_size"] = microbatch
    manifest = new_manifest("memory", preset, stages=stages, training=training)
    model = build_stage(manifest, stage)
    params = [p for p in model.parameters()]
    optimizer = make_optimizer(manifest, params)
    config, batch = manifest.model, manifest.training.microbatch_size
    if stage == 0:
        inputs = torch.randint(0, config.vocab_size, (batch, config.context_length))
    else:
        inputs = torch.randn(batch, config.context_length, config.width, requires_grad=True)
    saved: dict[int, int] = {}

    weights = {p.untyped_storage().data_ptr() for p in params}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:  # the weights (inputs of each checkpointed block) exist anyway
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    gc.collect()
    before = current_rss()
    begin = time.monotonic()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if model.last:  # as a serving peer does: the loss in chunks of tokens (StageModel.forward_loss)
            loss = model.forward_loss(inputs, torch.zeros(inputs.shape[:2], dtype=torch.long))
        else:
            loss = model(inputs).float().square().mean()
    held = current_rss() - before  # what forward keeps alive for backward (and the loss's logits)
    loss.backward()
    optimizer.step()
    seconds = time.monotonic() - begin
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    return {
        "stage": stage,
        "activation_checkpointing": checkpointing,
        "parameters": count_parameters(model),
        "activation_bytes": sum(saved.values()),
        "rss_held_after_forward_bytes": held,
        "weights_grads_adam_bytes": 2 * parameter_bytes + state_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-150m")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "stage,checkpointing": measure in here
    args = parser.parse_args()
    if args.one is not None:
        stage, checkpointing = args.one.split(",")
        print(json.dumps(measure(args.preset, args.stages, int(stage), checkpointing == "1", args.microbatch_size)))
        return
    rows = []
    for stage in range(args.stages):
        for checkpointing in (0, 1):
            command = [sys.executable, "-m", "benchmarks.memory", "--preset", args.preset, "--stages", str(args.stages)]
            command += ["--one", f"{stage},{checkpointing}"]
            if args.microbatch_size:
                command += ["--microbatch-size", str(args.microbatch_size)]
            rows.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
    manifest = new_manifest("memory", args.preset, stages=args.stages)
    result = {
        "preset": args.preset,
        "precision": manifest.training.precision,
        "microbatch_size": args.microbatch_size or manifest.training.microbatch_size,
        "context_length": manifest.model.context_length,
        "stages": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
