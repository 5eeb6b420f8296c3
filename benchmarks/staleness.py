"""Stale gradients: what keeping many microbatches in flight through each stage costs in held-out loss, with the
stages' own step gate (training.pipelining flush) and without it (async: steps by count, stale gradients with a
delay-scaled learning rate).

    python -m benchmarks.staleness --quick          # about 7 minutes here: 2,048 and 6,144 samples, seed 0
    python -m benchmarks.staleness [--horizons 8192,32768] [--seeds 0,1] [--in-flight 8] [--modes flush,async]
                                   [--activation-compression 8bit] [--subspace-rank 0] [--width 256] [--stages 4]
                                   [--replicas 2 --averaging-every 4096]

A Llama (width 256, 4 stages of one block each, byte tokens of the stdlib corpus, context 64, microbatches of 16,
a step every 8 microbatches at every stage, AdamW at a constant 0.001 so that one run gives every horizon) is
trained in one process by the swarm's own stage code: one StageCompute per stage (swarm/server/compute.py: the
weight stash, the activation cache, the accumulation and the step by count), and, under flush, one StepGate per
stage (swarm/server/step_gate.py), the same objects a peer uses. A trainer keeps `--in-flight` microbatches in
flight, each an asyncio task that goes forward through the stages and back; between two hops it yields a seeded
random number of times, so that hops of different microbatches interleave as over real links (a deterministic
run). Every boundary goes through the wire codec both ways (swarm/wire/tensors.py), as between peers. With
`--replicas R` there are R such pipelines, each with its own trainer and data, averaged by DiLoCo every
`--averaging-every` samples (all replicas together) with the swarm's outer step and 4-bit pseudo-gradients; under
flush a stage's round waits for its gates' open slots, as a peer's does, so the two delays cannot compose. The
held-out loss is then the replicas' mean, and a horizon counts the samples of all replicas.

Figures: per mode and in-flight count, the held-out loss at each horizon (32 fixed batches of 16 windows), its
ratio to the same stages with 1 in flight (loss_ratio; the worst over horizons and the mean over seeds), the
largest number of microbatches between their forward and their backward at each stage (in_flight), and the
staleness each stage measured (weight versions between a forward and its gradient's step: mean and maximum).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from hivemind.compression import CompressionInfo

from swarm.architectures.model import build_stage
from swarm.averaging.rules import averaging_compression, outer_step
from swarm.dataset.shards import TextData, heldout_batches, sample_batch
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.server.compute import StageCompute
from swarm.server.step_gate import StepGate
from swarm.wire.boundary import sends_window, token_tensor
from swarm.wire.messages import StageRequest
from swarm.wire.tensors import decode_tensor, encode_tensor

CONTEXT, MICROBATCH, STEP = 64, 16, 8
HELDOUT_BATCHES, HELDOUT_SIZE = 32, MICROBATCH  # a stage takes at most microbatch_size windows
MAX_YIELDS = 4  # a hop takes 1..MAX_YIELDS turns of the event loop: microbatches overtake each other


@dataclass
class Run:
    mode: str
    in_flight: int
    seed: int
    heldout: dict[int, float] = field(default_factory=dict)
    most_in_flight: list[int] = field(default_factory=list)  # per stage
    staleness_mean: list[float] = field(default_factory=list)
    staleness_max: list[int] = field(default_factory=list)
    rounds: int = 0  # DiLoCo rounds between the replicas
    seconds: float = 0.0


def stage_manifest(args: argparse.Namespace, mode: str, seed: int) -> Manifest:
    width = args.width
    raw = fast_test_swarm_dict(
        name="staleness",
        model={
            "architecture": "llama",
            "vocab_size": 256,
            "width": width,
            "depth": args.stages,
            "heads": max(width // 64, 1),
            "intermediate_size": 256 * math.ceil(8 * width / 3 / 256),
            "context_length": CONTEXT,
            "seed": seed,
            "subspace_rank": args.subspace_rank,
        },
        stages={"count": args.stages},
        averaging={"mode": "diloco", "every_samples": args.averaging_every, "compression": "4bit"},
        training={
            "microbatch_size": MICROBATCH,
            "microbatches_per_step": STEP,
            "learning_rate": args.lr,
            "activation_compression": args.activation_compression,
            "pipelining": mode,
            "max_in_flight": max(args.in_flight, 1),
        },
    )
    return manifest_from_dict(raw)


def wire(tensor: torch.Tensor, compression: str) -> torch.Tensor:
    """The tensor as the receiving peer sees it."""
    return decode_tensor(encode_tensor(tensor.contiguous(), compression), tensor.numel(), "wire")


def tokens_for(manifest: Manifest, stage: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The token tensor a stage's forward takes besides its inputs (as swarm/server/compute.py expects)."""
    last = stage == manifest.num_stages - 1
    if stage > 0 and (last or sends_window(manifest)):
        return [token_tensor(manifest, x, y)]
    return []


def heldout_loss(stages: list[StageCompute], manifest: Manifest, batches: list) -> float:
    losses = []
    for index, (x, y) in enumerate(batches):
        hidden = x
        for s, compute in enumerate(stages):
            request = StageRequest(s, f"h{index}", False, [hidden, *tokens_for(manifest, s, x, y)])
            (hidden,) = compute.process("forward", request, "eval")
        losses.append(float(hidden))
    return float(np.mean(losses))


@dataclass
class Replica:
    """One replica of the pipeline: its stages, their step gates (flush) and its trainer's data."""

    stages: list[StageCompute]
    gates: list[StepGate] | None
    data_rng: np.random.Generator
    between: list[int]  # microbatches between their forward and their backward at each stage now


def make_replica(manifest: Manifest, mode: str, seed: int, index: int) -> Replica:
    count = manifest.num_stages
    torch.manual_seed(seed)  # every replica starts from the same weights, as a swarm's do
    stages = [StageCompute(manifest, s, build_stage(manifest, s), torch.device("cpu")) for s in range(count)]
    gates = [StepGate(STEP, stage.forget_forwards) for stage in stages] if mode == "flush" else None
    return Replica(stages, gates, np.random.default_rng(seed + 100 * index), [0] * count)


class OuterSteps:
    """DiLoCo between the replicas, stage by stage, with the swarm's own outer step (swarm/averaging/rules.py):
    the anchor moves by the replicas' mean pseudo-gradient and every replica takes the anchor. Under flush a
    stage's round waits for its gates' open slots (StepGate.between_steps), as a peer's round does, so a round
    never lands between a forward and its backward; the last stage goes first, so that no round waits on one
    upstream (a microbatch that holds an earlier stage's slot only ever waits for later stages)."""

    def __init__(self, replicas: list[Replica], manifest: Manifest):
        self.replicas, self.config = replicas, manifest.averaging
        first = replicas[0].stages
        self.anchors = [[p.detach().clone() for p in stage.params] for stage in first]
        self.momenta = [[torch.zeros_like(p) for p in stage.params] for stage in first]
        self.compression = averaging_compression(self.config.compression)
        self.rounds = 0
        self.lock = asyncio.Lock()

    async def round(self, due: int) -> None:
        """Run rounds until `due` have run (a microbatch that passed a round's boundary calls it)."""
        async with self.lock:
            if self.rounds >= due:  # another microbatch ran it meanwhile
                return
            for s in reversed(range(len(self.anchors))):
                async with contextlib.AsyncExitStack() as stack:
                    for replica in self.replicas:
                        if replica.gates is not None:
                            await stack.enter_async_context(replica.gates[s].between_steps(1e9))
                    self._apply(s)
            self.rounds += 1

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.compression.extract(self.compression.compress(tensor, CompressionInfo.from_tensor(tensor)))

    @torch.no_grad()
    def _apply(self, s: int) -> None:
        stages = [replica.stages[s] for replica in self.replicas]
        # each replica's pseudo-gradient as the all-reduce sends it, and the mean as it comes back (4-bit by default)
        sent = [[self._wire(anchor - p.detach()) for anchor, p in zip(self.anchors[s], st.params)] for st in stages]
        pseudo = [self._wire(torch.stack(parts).mean(0)) for parts in zip(*sent)]
        outer_step(
            self.anchors[s], self.momenta[s], pseudo, self.config.outer_learning_rate, self.config.outer_momentum
        )
        for stage in stages:
            for p, anchor in zip(stage.params, self.anchors[s]):
                p.copy_(anchor)
            stage.weights_version += 1  # forwards from now on use the new weights (as StageCompute.finish_round)


async def train(args: argparse.Namespace, mode: str, in_flight: int, seed: int, data: TextData, held: list) -> Run:
    manifest = stage_manifest(args, mode, seed)
    count, compression = manifest.num_stages, manifest.training.activation_compression
    replicas = [make_replica(manifest, mode, seed, r) for r in range(args.replicas)]
    outer = OuterSteps(replicas, manifest) if args.replicas > 1 else None
    run = Run(mode, in_flight, seed, most_in_flight=[0] * count)
    hop_rng = np.random.default_rng(seed + 1000)
    horizons = sorted(args.horizons)
    trained, begin = 0, time.perf_counter()
    per_replica = horizons[-1] // MICROBATCH // args.replicas
    far = time.monotonic() + 1e9

    async def hop() -> None:
        for _ in range(int(hop_rng.integers(1, MAX_YIELDS + 1))):
            await asyncio.sleep(0)

    async def microbatch(replica: Replica, number: int, x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal trained
        stages, gates, between = replica.stages, replica.gates, replica.between
        key, hidden, grad = ("trainer", f"m{number}"), x, None
        for s in range(count):
            await hop()
            if gates is not None:
                await gates[s].take(key, far, far)
            request = StageRequest(s, key[1], True, [hidden, *tokens_for(manifest, s, x, y)])
            outputs = stages[s].process("forward", request, key[0])
            if s < count - 1:
                between[s] += 1
                run.most_in_flight[s] = max(run.most_in_flight[s], between[s])
                hidden = wire(outputs[0], compression)
            else:
                grad = wire(outputs[1], compression)
                if gates is not None:
                    await gates[s].release(key, applied=True)
        for s in reversed(range(count - 1)):
            await hop()
            outputs = stages[s].process("backward", StageRequest(s, key[1], True, [grad]), key[0])
            between[s] -= 1
            if gates is not None:
                await gates[s].release(key, applied=True)
            grad = wire(outputs[0], compression) if s > 0 else None
        trained += x.shape[0]
        done = trained
        for horizon in horizons:  # the held-out loss as the run passes each horizon (the weights of that moment)
            if done - x.shape[0] < horizon <= done:
                run.heldout[horizon] = float(np.mean([heldout_loss(r.stages, manifest, held) for r in replicas]))
        if outer is not None and done // args.averaging_every > outer.rounds:
            await outer.round(done // args.averaging_every)

    async def trainer(index: int, replica: Replica) -> None:
        slots, tasks = asyncio.Semaphore(in_flight), []

        async def one(number: int, x: torch.Tensor, y: torch.Tensor) -> None:
            try:
                await microbatch(replica, number, x, y)
            finally:
                slots.release()

        for number in range(per_replica):
            await slots.acquire()
            x, y = sample_batch(data.train, MICROBATCH, CONTEXT, replica.data_rng)
            tasks.append(asyncio.create_task(one(index * per_replica + number, x, y)))
        await asyncio.gather(*tasks)

    await asyncio.gather(*(trainer(i, replica) for i, replica in enumerate(replicas)))
    stages = replicas[0].stages
    run.staleness_mean = [round(s.counters.staleness_mean, 3) for s in stages]
    run.staleness_max = [max(r.stages[s].counters.staleness_max for r in replicas) for s in range(count)]
    run.rounds = outer.rounds if outer is not None else 0
    run.seconds = time.perf_counter() - begin
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="horizons 2048,6144, seed 0")
    parser.add_argument("--horizons", default="8192,32768", help="samples at which the held-out loss is taken")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--in-flight", type=int, default=8, help="microbatches the trainer keeps in flight")
    parser.add_argument("--modes", default="flush,async", help="training.pipelining values to run")
    parser.add_argument("--activation-compression", default="8bit")
    parser.add_argument("--subspace-rank", type=int, default=0, help="model.subspace_rank (0: none)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--stages", type=int, default=4, help="stages of one block each")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--replicas", type=int, default=1, help="pipelines averaged with DiLoCo (default 1: none)")
    parser.add_argument(
        "--averaging-every",
        type=int,
        default=4096,
        help="samples (all replicas together) between DiLoCo rounds (default 4096, the swarm's)",
    )
    args = parser.parse_args()
    if args.replicas < 1 or args.averaging_every < 1:
        parser.error("--replicas and --averaging-every must be at least 1")
    if args.quick:
        args.horizons, args.seeds = "2048,6144", "0"
    args.horizons = sorted(int(h) for h in args.horizons.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    data = TextData.load("stdlib", 0.05)
    held = heldout_batches(data.heldout, HELDOUT_BATCHES, HELDOUT_SIZE, CONTEXT)
    # 1 in flight is the reference: no stage ever steps between a forward and its backward, whatever the mode
    reference = [asyncio.run(train(args, modes[0], 1, seed, data, held)) for seed in seeds]
    runs = {
        mode: [asyncio.run(train(args, mode, args.in_flight, seed, data, held)) for seed in seeds] for mode in modes
    }
    horizons = args.horizons
    base = {h: float(np.mean([r.heldout[h] for r in reference])) for h in horizons}
    results = {}
    for mode, done in runs.items():
        ratios = {h: round(float(np.mean([r.heldout[h] for r in done])) / base[h], 4) for h in horizons}
        results[mode] = {
            "heldout_loss": {str(h): [round(r.heldout[h], 4) for r in done] for h in horizons},
            "loss_ratio": {str(h): ratios[h] for h in horizons},
            "worst_loss_ratio": max(ratios.values()),
            "in_flight": [max(r.most_in_flight[s] for r in done) for s in range(args.stages - 1)],
            "staleness_mean": done[0].staleness_mean,
            "staleness_max": [max(r.staleness_max[s] for r in done) for s in range(args.stages)],
            "averaging_rounds": done[0].rounds,
            "seconds_per_run": round(float(np.mean([r.seconds for r in done])), 1),
        }
    headline = results[modes[0]]
    print(
        json.dumps(
            {
                "benchmark": "staleness",
                "model": {"architecture": "llama", "width": args.width, "stages": args.stages, "context": CONTEXT},
                "microbatches_per_step": STEP,
                "activation_compression": args.activation_compression,
                "subspace_rank": args.subspace_rank,
                "replicas": args.replicas,
                "averaging_every": args.averaging_every if args.replicas > 1 else None,
                "horizons": horizons,
                "seeds": seeds,
                "mode": modes[0],
                "in_flight": headline["in_flight"],
                "loss_ratio": headline["worst_loss_ratio"],
                "one_in_flight_heldout_loss": {str(h): [round(r.heldout[h], 4) for r in reference] for h in horizons},
                "modes": results,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
