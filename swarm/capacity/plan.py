"""A swarm's plan before anyone starts (`swarm-init --plan`): which spans each kind of expected machine would serve,
the memory each peer would use, the swarm's tokens per second and what limits it. Pure: no device is read.

Machines are described as COUNTxMEMORY@FLOPS/UPLINK (`parse_expect`: "10x24GB@165TF/200mbit,20x8GB@40TF/50mbit").
Each kind's span length at every start comes from costs.longest_span, the placement from
balancing/spans.choose_span and better_span: the functions peers run, so the plan says what they then do. Peers join
one at a time, the kinds interleaved (as volunteers arrive), then move while a move clearly helps; the plan is
that placement. The same machines with fixed stages (one stage per peer, where it fits) are planned beside it.

Rates: a block's compute per sample is 6 FLOPs per parameter and token (8 with activation checkpointing) plus
attention's 6 x context x width per token, at `mfu` of the machine's FLOP rate; a hop's network rate is the uplink
over the bytes a span's peer sends per sample (swarm/throughput.py, as the protocol encodes them). The swarm's
tokens per second is its weakest stage's samples per second times the context; averaging traffic and link delays
are left out (docs/BALANCING.md, "Spans and memory").
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from swarm.architectures import architecture
from swarm.balancing.spans import SpanPeer, better_span, choose_span, coverage, upper_bound
from swarm.capacity.budget import MARGIN, parse_memory
from swarm.capacity.costs import MemorySettings, span_cost, span_lengths
from swarm.errors import CapacityError
from swarm.manifests.manifest import Manifest
from swarm.throughput import stage_bytes_per_sample

MFU = 0.4  # the share of a GPU's dense FLOP rate a stage reaches (benchmarks/gpu_scenarios.py's scenarios)
MOVE_PASSES = 4  # rounds of moves after everyone joined
KIND = re.compile(
    r"^\s*(?:(\d+)\s*x\s*)?([0-9.]+\s*[a-zA-Z]*)\s*@\s*([0-9.]+)\s*(tf|tflops|gf|gflops)\s*/\s*([0-9.]+)\s*"
    r"(kbit|mbit|gbit)\s*$",
    re.IGNORECASE,
)
FLOP_UNITS = {"tf": 1e12, "tflops": 1e12, "gf": 1e9, "gflops": 1e9}
BIT_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


@dataclass(frozen=True)
class MachineKind:
    """`count` machines with `memory` bytes free for a peer, `flops` dense 16-bit FLOP/s and an uplink of
    `uplink_bits` bits per second."""

    count: int
    memory: int
    flops: float
    uplink_bits: float
    name: str = ""


def parse_expect(text: str) -> list[MachineKind]:
    """'10x24GB@165TF/200mbit,20x8GB@40TF/50mbit' -> machine kinds (the count is optional: 1)."""
    kinds = []
    for part in text.split(","):
        match = KIND.match(part)
        if match is None:
            raise CapacityError(
                f"cannot read {part.strip()!r} as machines: write COUNTxMEMORY@FLOPS/UPLINK, e.g. "
                "10x24GB@165TF/200mbit (FLOPS in TF, dense 16-bit; UPLINK in kbit, mbit or gbit)"
            )
        count = int(match.group(1) or 1)
        flops = float(match.group(3)) * FLOP_UNITS[match.group(4).lower()]
        uplink = float(match.group(5)) * BIT_UNITS[match.group(6).lower()]
        if not 1 <= count <= 100_000 or not 0 < flops < 1e18 or not 0 < uplink < 1e13:
            raise CapacityError(f"{part.strip()!r}: counts go from 1 to 100,000, FLOP rates and uplinks above 0")
        kinds.append(MachineKind(count, parse_memory(match.group(2)), flops, uplink, part.strip()))
    return kinds


def stage_work(manifest: Manifest) -> list[float]:
    """Each stage's compute in blocks' worth: its transformer blocks, and for the last stage the LM head's matmul."""
    config = manifest.model
    block = architecture(config.architecture).block_parameters(config) + config.context_length * config.width
    head = config.vocab_size * config.width / block
    return [
        len(manifest.stage_layers(stage)) + (head if stage == manifest.num_stages - 1 else 0)
        for stage in range(manifest.num_stages)
    ]


def block_samples_per_second(manifest: Manifest, flops: float, mfu: float = MFU) -> float:
    """Samples per second a machine pushes through one block, forward and backward."""
    config = manifest.model
    per_token = architecture(config.architecture).block_parameters(config) + config.context_length * config.width
    multiplier = 8 if manifest.training.activation_checkpointing else 6
    return flops * mfu / (multiplier * per_token * config.context_length)


def span_bytes_per_sample(manifest: Manifest, start: int, end: int) -> int:
    """Bytes the peer of span [start, end) sends per sample (its uplink's load)."""
    last = manifest.num_stages - 1
    if start == 0 and end == manifest.num_stages:
        return 0  # the whole model: nothing crosses a link
    stage = 0 if start == 0 else last if end == manifest.num_stages else min(1, last)
    return stage_bytes_per_sample(manifest, stage)[1]


@dataclass
class KindPlan:
    kind: MachineKind
    spans: list[tuple[int, int]] = field(default_factory=list)  # one per serving peer
    memory_bytes: int = 0  # device memory of its most common span
    host_bytes: int = 0
    blocks: int = 0  # transformer blocks of its most common span
    samples_per_second: float = 0.0  # of one peer over its most common span
    bound: str = ""  # "compute" or "network"

    @property
    def serving(self) -> int:
        return len(self.spans)


@dataclass
class SwarmPlan:
    manifest: Manifest
    mode: str  # "spans" or "fixed stages"
    kinds: list[KindPlan]
    coverage: list[float]  # samples per second each stage can take
    bound: float  # upper_bound of the bottleneck over any placement (spans)

    @property
    def bottleneck_stage(self) -> int:
        return min(range(len(self.coverage)), key=self.coverage.__getitem__)

    @property
    def tokens_per_second(self) -> float:
        return min(self.coverage) * self.manifest.model.context_length

    @property
    def participation(self) -> float:
        """The share of the expected machines that serve a span."""
        total = sum(k.kind.count for k in self.kinds)
        return sum(k.serving for k in self.kinds) / max(total, 1)

    def bottleneck(self) -> str:
        """What limits the swarm, in words: an uncovered stage, or the compute or the links of a stage's peers."""
        stage = self.bottleneck_stage
        if self.coverage[stage] <= 0:
            if any(k.kind.count > k.serving for k in self.kinds):  # some machines hold no stage at all
                return f"stage {stage} has no peer: no machine that serves can hold it, or there are too few"
            return f"stage {stage} has no peer: too few machines for {len(self.coverage)} stages"
        holders = [k for k in self.kinds if any(s <= stage < e for s, e in k.spans)]
        network = [k.kind.name for k in holders if k.bound == "network"]
        if network and len(network) * 2 >= len(holders):
            return f"network: the uplinks of {', '.join(network)} serving stage {stage}"
        return f"compute of stage {stage}'s peers ({', '.join(k.kind.name for k in holders)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "stages": self.manifest.num_stages,
            "tokens_per_second": round(self.tokens_per_second, 1),
            "bottleneck": self.bottleneck(),
            "bottleneck_stage": self.bottleneck_stage,
            "share_of_bound": round(min(self.coverage) / self.bound, 3) if self.bound > 0 else 0.0,
            "participation": round(self.participation, 3),
            "coverage_samples_per_second": [round(c, 3) for c in self.coverage],
            "kinds": [
                {
                    "machines": k.kind.name,
                    "count": k.kind.count,
                    "serving": k.serving,
                    "blocks": k.blocks,
                    "memory_bytes": k.memory_bytes,
                    "host_memory_bytes": k.host_bytes,
                    "samples_per_second": round(k.samples_per_second, 3),
                    "bound": k.bound,
                    "spans": [list(s) for s in sorted(Counter(k.spans))],
                }
                for k in self.kinds
            ],
        }


def plan_swarm(
    manifest: Manifest,
    kinds: list[MachineKind],
    settings: MemorySettings = MemorySettings(),
    spans: bool = True,
    mfu: float = MFU,
    seed: int = 0,
) -> SwarmPlan:
    """Place the expected machines: spans (as many stages as fit, where they help most) or fixed stages (one
    stage each, where it fits)."""
    rng = random.Random(seed)
    work = stage_work(manifest)
    lengths = {k.name: _lengths(manifest, k, settings, spans) for k in kinds}
    arrivals = _interleaved(kinds)
    peers: list[SpanPeer] = []
    owners: list[MachineKind] = []
    for index, kind in enumerate(arrivals):
        peer = _peer(manifest, kind, index, mfu)
        span = choose_span(peer, peers, lengths[kind.name], work, rng, manifest.balancing.min_holders)
        if span is not None:
            peers.append(SpanPeer(peer.peer_id, peer.compute, peer.network, *span))
            owners.append(kind)
    for _ in range(MOVE_PASSES):
        moved = False
        for i, peer in enumerate(peers):
            min_gain, min_holders = manifest.balancing.min_gain, manifest.balancing.min_holders
            span = better_span(peer, peers, lengths[owners[i].name], work, rng, min_gain, min_holders)
            if span is not None:
                peers[i] = SpanPeer(peer.peer_id, peer.compute, peer.network, *span)
                moved = True
        if not moved:
            break
    plans = [_kind_plan(manifest, k, [p for p, o in zip(peers, owners) if o is k], settings, work) for k in kinds]
    most = {k.name: max(sum(work[s : s + n]) for s, n in enumerate(lengths[k.name])) for k in kinds}
    bound = upper_bound(peers, [most[o.name] for o in owners], work)
    return SwarmPlan(manifest, "spans" if spans else "fixed stages", plans, coverage(peers, work), bound)


def _lengths(manifest: Manifest, kind: MachineKind, settings: MemorySettings, spans: bool) -> list[int]:
    budget = int(kind.memory * (1 - MARGIN))
    lengths = span_lengths(manifest, budget, settings)
    return lengths if spans else [min(length, 1) for length in lengths]


def _interleaved(kinds: list[MachineKind]) -> list[MachineKind]:
    """The machines in order of arrival: the kinds mixed evenly (each kind's i-th machine at about i / count)."""
    slots = [(i / k.count, n, k) for n, k in enumerate(kinds) for i in range(k.count)]
    return [k for _, _, k in sorted(slots, key=lambda slot: (slot[0], slot[1]))]


def _peer(manifest: Manifest, kind: MachineKind, index: int, mfu: float) -> SpanPeer:
    compute = block_samples_per_second(manifest, kind.flops, mfu)
    middle = span_bytes_per_sample(manifest, min(1, manifest.num_stages - 1), manifest.num_stages - 1) or 1
    return SpanPeer(f"{kind.name}#{index}", compute, kind.uplink_bits / 8 / middle)


def _kind_plan(
    manifest: Manifest, kind: MachineKind, peers: list[SpanPeer], settings: MemorySettings, work: list[float]
) -> KindPlan:
    plan = KindPlan(kind, [(p.start, p.end) for p in peers])
    if not peers:
        return plan
    start, end = Counter(plan.spans).most_common(1)[0][0]
    cost = span_cost(manifest, start, end, settings)
    peer = next(p for p in peers if (p.start, p.end) == (start, end))
    blocks = sum(work[start:end])
    plan.memory_bytes, plan.host_bytes = cost.device_bytes, cost.host_bytes
    plan.blocks = sum(len(manifest.stage_layers(s)) for s in range(start, end))
    plan.samples_per_second = peer.rate(blocks)
    plan.bound = "network" if peer.network < peer.compute / max(blocks, 1e-9) else "compute"
    return plan
