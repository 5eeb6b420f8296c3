"""Stage traffic benchmark: how many bytes a token costs at a stage boundary, and what that costs in loss.

    python -m benchmarks.stage_traffic --quick                      # about 8 minutes here
    python -m benchmarks.stage_traffic [--horizons 16384,65536] [--seeds 0,1]
                                       [--methods float32,8bit,subspace-64,subspace-32] [--width 512] [--stages 4]

The same Llama (width 512, 4 stages of one block each, byte tokens of the stdlib corpus, context 64, microbatches
of 16) is trained with each method from the same initialisation and on the same batches, in one process: the
stages are the swarm's own (swarm/architectures/model.py: build_stage, one AdamW each, clipped per stage as a
peer clips), and every boundary goes through the swarm's wire codec (swarm/wire/tensors.py: encode_tensor, then
decode_tensor) both ways, so what is trained on is what a peer would receive, and the bytes are the bytes of the
tensors' buffers. Methods:

- float32: hidden states and their gradients uncompressed (the loss reference);
- 8bit: today's default, hivemind's 8-bit codec on hidden states and gradients;
- 4bit: 4-bit hidden states and gradients (swarm/wire/four_bit.py: NF4 levels, a bfloat16 scale per token);
- subspace-R: model.subspace_rank R (swarm/architectures/subspace.py): R coordinates per token in 8-bit, exact;
  subspace-R-bf16 and subspace-R-4bit: the same coordinates in bfloat16 or in 4 bits.

A forward boundary also carries the token tensor a swarm sends with the hidden states (the int64 targets of the
forward pipeline, or a subspace swarm's int16 window); a backward boundary only the gradient. Held-out loss: 16
fixed batches of 32 windows of the corpus' held-out part, at every horizon (samples trained, constant learning
rate so that one run gives every horizon). Figures per method: forward and backward bytes per token, their ratio
to 8bit's (bytes_per_token_ratio_vs_8bit, the smaller of the two directions), and loss_ratio (held-out loss over
float32's at the same samples, mean over seeds, at each horizon; the largest over horizons is the headline). The
Protocol NanoGPT record (6.4x fewer bytes than bfloat16 at 3.1x the steps) is printed beside them for comparison.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.architectures.model import StageModel, build_stage
from swarm.dataset.shards import TextData, heldout_batches, sample_batch
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.wire.boundary import boundary_width, token_tensor, wire_token_dtype
from swarm.wire.tensors import decode_tensor, encode_tensor

NANOGPT_RECORD = {"bytes_ratio_vs_bf16": 6.4, "steps_ratio": 3.1}  # ReparamSSN: 322 B/token against 2,048
HELDOUT_BATCHES, HELDOUT_SIZE = 16, 32


@dataclass
class Meter:
    forward: int = 0
    backward: int = 0
    tokens: int = 0


@dataclass
class Method:
    name: str
    rank: int = 0
    compression: str = "8bit"

    @classmethod
    def parse(cls, text: str) -> Method:
        if text in ("float32", "8bit", "bfloat16", "4bit"):
            return cls(text, 0, text)
        parts = text.split("-")
        codings = {(): "8bit", ("bf16",): "bfloat16", ("4bit",): "4bit"}
        if parts[0] != "subspace" or not parts[1:2] or not parts[1].isdigit() or tuple(parts[2:]) not in codings:
            raise ValueError(f"a method is float32, bfloat16, 8bit, 4bit or subspace-RANK[-bf16|-4bit], not {text!r}")
        return cls(text, int(parts[1]), codings[tuple(parts[2:])])


@dataclass
class Run:
    method: str
    seed: int
    heldout: dict[int, float] = field(default_factory=dict)
    meter: Meter = field(default_factory=Meter)
    seconds: float = 0.0


def benchmark_manifest(method: Method, width: int, stages: int, seed: int, lr: float, microbatch: int = 16) -> Manifest:
    raw = fast_test_swarm_dict(
        name="stage-traffic",
        model={
            "architecture": "llama",
            "vocab_size": 256,
            "width": width,
            "depth": stages,
            "heads": width // 64,
            "intermediate_size": 256 * math.ceil(8 * width / 3 / 256),
            "context_length": 64,
            "seed": seed,
            "subspace_rank": method.rank,
        },
        stages={"count": stages},
        training={
            "microbatch_size": microbatch,
            "microbatches_per_step": 1,
            "learning_rate": lr,
            "activation_compression": method.compression,
        },
    )
    return manifest_from_dict(raw)


class WireBoundary(torch.autograd.Function):
    """A stage boundary: the hidden states go through the wire codec forward, their gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, compression: str, meter: Meter) -> torch.Tensor:
        ctx.compression, ctx.meter = compression, meter
        proto = encode_tensor(x.detach(), compression)
        meter.forward += len(proto.buffer)
        return decode_tensor(proto, x.numel(), "hidden states")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        proto = encode_tensor(grad.detach().contiguous(), ctx.compression)
        ctx.meter.backward += len(proto.buffer)
        return decode_tensor(proto, grad.numel(), "gradient"), None, None


def token_bytes(manifest: Manifest, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the token tensor that goes with a forward boundary (targets or the window)."""
    tensor = token_tensor(manifest, inputs, targets)
    return len(encode_tensor(tensor, token_dtype=wire_token_dtype(manifest)).buffer)


def loss_of(stages: list[StageModel], manifest: Manifest, x: torch.Tensor, y: torch.Tensor, meter: Meter | None):
    tokens = x
    hidden = stages[0](x)
    for stage in stages[1:]:
        if meter is not None:
            hidden = WireBoundary.apply(hidden, manifest.training.activation_compression, meter)
            meter.forward += token_bytes(manifest, x, y)
        passed = tokens if stage.takes_tokens else None
        if stage.last:
            return stage.forward_loss(hidden, y, passed)
        hidden = stage(hidden, passed)
    raise AssertionError("no last stage")


def heldout_loss(stages: list[StageModel], manifest: Manifest, batches: list) -> float:
    with torch.no_grad():
        return float(np.mean([float(loss_of(stages, manifest, x, y, None)) for x, y in batches]))


def set_learning_rate(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def update(stages: list[StageModel], optimizers: list[torch.optim.Optimizer], manifest: Manifest) -> None:
    """Each stage clips its own gradient and steps, as a peer does."""
    for stage, opt in zip(stages, optimizers):
        torch.nn.utils.clip_grad_norm_(stage.parameters(), manifest.training.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)


def train(method: Method, seed: int, horizons: list[int], args: argparse.Namespace, data: TextData, held: list) -> Run:
    manifest = benchmark_manifest(method, args.width, args.stages, seed, args.lr)
    stages = [build_stage(manifest, s) for s in range(args.stages)]
    optimizers = [torch.optim.AdamW(s.parameters(), lr=args.lr, weight_decay=0.01) for s in stages]
    rng = np.random.default_rng(1000 + seed)  # the same batches for every method
    run, samples, begin = Run(method.name, seed), 0, time.perf_counter()
    batch, length = manifest.training.microbatch_size, manifest.model.context_length
    for horizon in horizons:
        while samples < horizon:
            x, y = sample_batch(data.train, batch, length, rng)
            set_learning_rate(optimizers, args.lr * min(1.0, (samples + batch) / args.warmup_samples))
            meter = None if method.name == "float32" else run.meter
            loss = loss_of(stages, manifest, x, y, meter)
            loss.backward()
            update(stages, optimizers, manifest)
            samples += batch
            run.meter.tokens += batch * length
        run.heldout[horizon] = heldout_loss(stages, manifest, held)
        print(
            f"{method.name} seed {seed}: {samples} samples, held-out loss {run.heldout[horizon]:.4f} "
            f"({time.perf_counter() - begin:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    run.seconds = time.perf_counter() - begin
    return run


def wire_bytes(method: Method, args: argparse.Namespace, data: TextData) -> tuple[float, float]:
    """Bytes per token of one forward boundary and one backward boundary, as the codec encodes them (for float32,
    which trains without the codec, too)."""
    manifest = benchmark_manifest(method, args.width, args.stages, 0, args.lr)
    x, y = sample_batch(data.train, 16, 64, np.random.default_rng(0))
    hidden = torch.randn(16, 64, boundary_width(manifest))
    values = len(encode_tensor(hidden, method.compression).buffer)
    return (values + token_bytes(manifest, x, y)) / x.numel(), values / x.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="horizons 1024,3072, methods float32,subspace-48")
    parser.add_argument("--horizons", default="16384,65536", help="samples at which the held-out loss is taken")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--methods", default="float32,8bit,subspace-64,subspace-48,subspace-32")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--stages", type=int, default=4, help="stages of one block each")
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--warmup-samples", type=int, default=800, help="linear learning-rate warm-up")
    args = parser.parse_args()
    if args.quick:
        args.horizons, args.methods = "1024,3072", "float32,subspace-48"
    horizons = sorted(int(h) for h in args.horizons.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = [Method.parse(m) for m in args.methods.split(",")]
    if methods[0].name != "float32":
        parser.error("the first method must be float32: the others' losses are compared with it")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    data = TextData.load("stdlib", 0.05)
    held = heldout_batches(data.heldout, HELDOUT_BATCHES, HELDOUT_SIZE, 64)
    eight_bit = wire_bytes(Method.parse("8bit"), args, data)
    bf16 = wire_bytes(Method.parse("bfloat16"), args, data)
    runs = {m.name: [train(m, seed, horizons, args, data, held) for seed in seeds] for m in methods}
    reference = {h: float(np.mean([r.heldout[h] for r in runs["float32"]])) for h in horizons}
    results = {}
    for method in methods:
        forward, backward = wire_bytes(method, args, data)
        measured = runs[method.name][0].meter
        if method.name != "float32":  # what the codec actually produced while training
            forward, backward = (
                measured.forward / measured.tokens / (args.stages - 1),
                (measured.backward / measured.tokens / (args.stages - 1)),
            )
        losses = {h: [round(r.heldout[h], 4) for r in runs[method.name]] for h in horizons}
        ratios = {h: round(float(np.mean(losses[h])) / reference[h], 4) for h in horizons}
        results[method.name] = {
            "forward_bytes_per_token": round(forward, 2),
            "backward_bytes_per_token": round(backward, 2),
            "bytes_per_token_ratio_vs_8bit": round(min(eight_bit[0] / forward, eight_bit[1] / backward), 2),
            "bytes_per_token_ratio_vs_bf16": round(min(bf16[0] / forward, bf16[1] / backward), 2),
            "heldout_loss": {str(h): losses[h] for h in horizons},
            "loss_ratio": {str(h): ratios[h] for h in horizons},
            "worst_loss_ratio": max(ratios.values()),
            "seconds_per_run": round(float(np.mean([r.seconds for r in runs[method.name]])), 1),
        }
    # the headline: the first subspace method (the compression this benchmark is about), else the first other
    best = [m.name for m in methods if m.rank] or [m.name for m in methods if m.name != "float32"]
    headline = results[best[0]] if best else results["float32"]
    print(
        json.dumps(
            {
                "benchmark": "stage_traffic",
                "model": {"architecture": "llama", "width": args.width, "stages": args.stages, "context": 64},
                "horizons": horizons,
                "seeds": seeds,
                "headline_method": best[0] if best else "float32",
                "bytes_per_token_ratio_vs_8bit": headline["bytes_per_token_ratio_vs_8bit"],
                "loss_ratio": headline["worst_loss_ratio"],
                "eight_bit_bytes_per_token": {"forward": round(eight_bit[0], 2), "backward": round(eight_bit[1], 2)},
                "methods": results,
                "protocol_nanogpt_record": NANOGPT_RECORD,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
