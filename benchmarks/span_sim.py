"""Spans against fixed stages on volunteers' GPUs: who can take part, and how much of the best throughput the swarm
keeps while volunteers come and go.

    python -m benchmarks.span_sim [--peers 100] [--hours 6] [--seed 0] [--shapes 1b,7b]

For each model shape, three swarms of the same volunteers (same arrivals, sessions, GPUs and uplinks):
- "fixed-24GB": equal stages sized so that a 24 GB card holds one (the llama-1b preset's 4 stages of 5-6 blocks;
  a 7B in 8 stages of 4 blocks); a peer serves one stage if it fits, else only trains;
- "fixed-8GB": equal stages sized for 8 GB cards (one block a stage): everyone with 8 GB fits, and every
  microbatch crosses a home link per block;
- "spans": one block a stage, and each peer serves as many consecutive ones as its memory holds
  (swarm/capacity/costs.py), where the swarm is weakest (swarm/balancing/spans.py).
Peers arrive as a Poisson process that keeps about --peers present (the first over WARMUP), stay an exponential
session (--session-hours), leave without warning. A joining peer takes JOIN_SECONDS before it serves (the state
download); every --check-period (x 0.5-1.5) an online peer asks better_span (min_gain 0.1) and moves if told to.
Every simulated minute: the swarm's throughput (its weakest stage, in tokens/s) and its share of upper_bound (no
placement of the same peers does better), and the share of present volunteers serving. Every 10 minutes, its share
of a reference placement (the best of several from scratch, refined by moves: a stand-in for the optimum) of the
peers that could be serving (present for JOIN_SECONDS at least: no placement serves with a peer still downloading
its state), and of all present peers ("instant": as if newcomers served at once).

The volunteers' GPUs: the NVIDIA cards of 6 GB and more that lead the Steam Hardware & Software Survey
(2025-2026: 8 GB about 30% of all systems, 12 GB 19%, 6 GB 10%, 16 GB 7.5%; RTX 3060, 4060 (desktop and laptop),
4060 Ti, 4070, 3070, 5070 most common), in those proportions; dense 16-bit tensor FLOP rates with float32
accumulation from NVIDIA's Ampere and Ada whitepapers (rounded), MFU 0.4; 0.5 GB of each card left to the
desktop. Uplinks: an assumption (home upload speeds vary widely by country): 20 Mbit/s 20%, 50 Mbit/s 40%,
100 Mbit/s 20%, 200 Mbit/s 15%, 1 Gbit/s 5%. Prints a summary to stderr and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

from swarm.balancing.spans import SpanPeer, better_span, choose_span, coverage, holders, upper_bound
from swarm.capacity.costs import MemorySettings, span_lengths
from swarm.capacity.plan import block_samples_per_second, span_bytes_per_sample, stage_work
from swarm.manifests.manifest import Manifest
from swarm.manifests.presets import new_manifest

# (name, memory GB, dense 16-bit TFLOP/s with float32 accumulation, share of volunteers)
GPUS = [
    ("RTX 3060 12GB", 12, 25.6, 15),
    ("RTX 4060 8GB", 8, 30.1, 13),
    ("RTX 4060 laptop 8GB", 8, 23.0, 12),
    ("RTX 4060 Ti 8GB", 8, 44.1, 9),
    ("RTX 4070 12GB", 12, 58.3, 8),
    ("RTX 3060 laptop 6GB", 6, 20.0, 7),
    ("RTX 3070 8GB", 8, 40.6, 6),
    ("RTX 5070 12GB", 12, 61.7, 6),
    ("RTX 2060 6GB", 6, 25.8, 5),
    ("RTX 4070 Ti 12GB", 12, 80.2, 5),
    ("RTX 3080 10GB", 10, 59.5, 4),
    ("RTX 4080 16GB", 16, 97.5, 3),
    ("RTX 4090 24GB", 24, 165.2, 3),
    ("RTX 3090 24GB", 24, 71.0, 2),
    ("RTX 4060 Ti 16GB", 16, 44.1, 2),
]
UPLINKS = [(20e6, 20), (50e6, 40), (100e6, 20), (200e6, 15), (1e9, 5)]
DESKTOP_BYTES = 0.5e9  # what the volunteer's own screen and programs keep
MFU = 0.4
WARMUP = 600.0
JOIN_SECONDS = 60.0
SAMPLE_PERIOD = 60.0
STEP = 10.0
REFERENCE_PERIOD = 600.0  # seconds between two computations of the reference placement (it takes a while)
REFERENCE_TRIES = 4
REFINE_PASSES = 10


def shapes() -> dict[str, dict]:
    """Model shapes in one-block stages, with the stage count a 24 GB card holds one of (fixed-24GB)."""
    seven = {
        "architecture": "llama",
        "vocab_size": 32000,
        "width": 4096,
        "depth": 32,
        "heads": 32,
        "kv_heads": 32,
        "intermediate_size": 11008,
        "context_length": 4096,
        "subspace_rank": 256,
    }
    return {
        "1b": {"preset": "llama-1b", "model": None, "training": {}, "fixed_24gb": 4},
        "7b": {"preset": "llama-1b", "model": seven, "training": {"microbatch_size": 1}, "fixed_24gb": 8},
    }


@dataclass
class Volunteer:
    number: int
    gpu: str
    memory: float
    flops: float
    uplink: float
    arrives: float
    leaves: float


def volunteers(count: int, hours: float, session_hours: float, rng: random.Random) -> list[Volunteer]:
    """Arrivals that keep about `count` present: the first over WARMUP, then a Poisson stream of count/session."""
    people, now, rate = [], 0.0, count / (session_hours * 3600)
    for i in range(count):
        people.append(_draw(i, rng.uniform(0, WARMUP), session_hours, rng))
    now = WARMUP
    while now < hours * 3600:
        now += rng.expovariate(rate)
        people.append(_draw(len(people), now, session_hours, rng))
    return people


def _draw(number: int, arrives: float, session_hours: float, rng: random.Random) -> Volunteer:
    gpu = rng.choices(GPUS, weights=[g[3] for g in GPUS])[0]
    uplink = rng.choices(UPLINKS, weights=[u[1] for u in UPLINKS])[0][0]
    stays = rng.expovariate(1 / (session_hours * 3600))
    return Volunteer(number, gpu[0], gpu[1] * 1e9 - DESKTOP_BYTES, gpu[2] * 1e12, uplink, arrives, arrives + stays)


class Swarm:
    """One swarm of the volunteers: `lengths_of(volunteer)` says how many of its stages fit from each start."""

    def __init__(self, manifest: Manifest, spans: bool, rng: random.Random):
        self.manifest, self.spans, self.rng = manifest, spans, rng
        self.min_gain, self.min_holders = manifest.balancing.min_gain, manifest.balancing.min_holders
        self.states_lost = 0  # (departure, stage) where the stage's last holder with its state left
        self.last_departure = float("-inf")  # when a serving peer last left
        self.work = stage_work(manifest)
        self.peers: dict[int, SpanPeer] = {}
        self.ready: dict[int, float] = {}  # when a joining (or moving) peer starts serving its span
        self.moving_from: dict[int, SpanPeer] = {}  # a moving peer serves its old span until then
        self.next_check: dict[int, float] = {}
        self.lengths: dict[tuple[float, int], list[int]] = {}
        self.moves = 0
        middle = span_bytes_per_sample(manifest, min(1, manifest.num_stages - 1), manifest.num_stages - 1) or 1
        self.bytes_per_sample = middle

    def lengths_of(self, volunteer: Volunteer) -> list[int]:
        key = (volunteer.memory, 0)
        if key not in self.lengths:
            lengths = span_lengths(self.manifest, int(volunteer.memory * 0.9), MemorySettings())
            self.lengths[key] = lengths if self.spans else [min(n, 1) for n in lengths]
        return self.lengths[key]

    def join(self, volunteer: Volunteer, now: float) -> None:
        peer = SpanPeer(
            str(volunteer.number),
            block_samples_per_second(self.manifest, volunteer.flops, MFU),
            volunteer.uplink / 8 / self.bytes_per_sample,
        )
        span = choose_span(
            peer,
            self._serving(now, include_joining=True),
            self.lengths_of(volunteer),
            self.work,
            self.rng,
            self.min_holders,
        )
        if span is None:
            return  # trains only
        self.peers[volunteer.number] = SpanPeer(peer.peer_id, peer.compute, peer.network, *span)
        self.ready[volunteer.number] = now + JOIN_SECONDS
        self.next_check[volunteer.number] = now + JOIN_SECONDS + self._check_delay()

    def leave(self, volunteer: Volunteer, now: float) -> None:
        """It leaves without warning: a stage it held with its state, and no other serving peer holds, loses its
        trained state (a joining or moving peer has none yet: it downloads it while it joins)."""
        number = volunteer.number
        if number in self.peers:
            held = self.peers[number] if self.ready[number] <= now else self.moving_from.get(number)
            others = [p for p in self._serving(now) if p.peer_id != str(number)]
            counts = holders(others, len(self.work))
            if held is not None:
                self.states_lost += sum(1 for stage in range(held.start, held.end) if counts[stage] == 0)
                self.last_departure = now
        self.peers.pop(number, None)
        self.moving_from.pop(number, None)

    def check(self, volunteer: Volunteer, now: float) -> None:
        number = volunteer.number
        if number not in self.peers or now < self.next_check[number]:
            return
        self.next_check[number] = now + self._check_delay()
        peer = self.peers[number]
        others = [p for n, p in self.peers.items() if n != number]
        lengths = self.lengths_of(volunteer)
        span = better_span(peer, others, lengths, self.work, self.rng, self.min_gain, self.min_holders)
        if span is not None and now >= self.ready[number]:
            self.moving_from[number] = peer  # it downloads the new span's state, serving the old one meanwhile
            self.peers[number] = SpanPeer(peer.peer_id, peer.compute, peer.network, *span)
            self.ready[number] = now + JOIN_SECONDS
            self.moves += 1

    def _check_delay(self) -> float:
        return self.rng.uniform(0.5, 1.5) * self.manifest.balancing.check_period

    def _serving(self, now: float, include_joining: bool = False) -> list[SpanPeer]:
        serving = []
        for number, peer in self.peers.items():
            if include_joining or self.ready[number] <= now:
                serving.append(peer)
            elif number in self.moving_from:
                serving.append(self.moving_from[number])
        return serving

    def sample(self, now: float, present: list[Volunteer], with_reference: bool) -> dict[str, float]:
        serving = self._serving(now)
        tokens = min(coverage(serving, self.work), default=0.0) * self.manifest.model.context_length
        longest = []
        candidates = []
        for volunteer in present:
            lengths = self.lengths_of(volunteer)
            if not any(lengths):
                continue
            most = max(sum(self.work[s : s + n]) for s, n in enumerate(lengths))
            compute = block_samples_per_second(self.manifest, volunteer.flops, MFU)
            candidates.append(SpanPeer(str(volunteer.number), compute, volunteer.uplink / 8 / self.bytes_per_sample))
            longest.append(most)
        bound = upper_bound(candidates, longest, self.work) * self.manifest.model.context_length
        sample = {
            "since_departure": now - self.last_departure,
            "tokens_per_second": tokens,
            "share_of_bound": tokens / bound if bound > 0 else 0.0,
            "participation": len(self.peers) / max(len(present), 1),
        }
        if with_reference:
            # the best placement of the peers that could be serving now: those that arrived at least JOIN_SECONDS
            # ago (no placement lets a peer serve before it has downloaded its span's state)
            could = {str(v.number) for v in present if v.arrives + JOIN_SECONDS <= now}
            settled = [c for c in candidates if c.peer_id in could]
            reference = self.reference(settled, present) * self.manifest.model.context_length
            sample["share_of_reference"] = tokens / max(reference, tokens, 1e-9)
            # ... and of every peer present, as if a newcomer served at once (the stricter figure)
            instant = self.reference(candidates, present) * self.manifest.model.context_length
            sample["share_of_instant_reference"] = tokens / max(instant, tokens, 1e-9)
        return sample

    def reference(self, candidates: list[SpanPeer], present: list[Volunteer]) -> float:
        """The best bottleneck of REFERENCE_TRIES placements of the present peers from scratch (random orders and
        largest first), each refined by moves with no threshold until none helps: a stand-in for the optimum."""
        lengths = {str(v.number): self.lengths_of(v) for v in present}
        rng = random.Random(0)
        orders = [sorted(candidates, key=lambda p: -p.compute)]
        orders += [rng.sample(candidates, len(candidates)) for _ in range(REFERENCE_TRIES - 1)]
        best = 0.0
        for order in orders:
            placed: list[SpanPeer] = []
            for peer in order:
                span = choose_span(peer, placed, lengths[peer.peer_id], self.work, rng)
                if span is not None:
                    placed.append(SpanPeer(peer.peer_id, peer.compute, peer.network, *span))
            for _ in range(REFINE_PASSES):
                moved = False
                for i, peer in enumerate(placed):
                    span = better_span(peer, placed, lengths[peer.peer_id], self.work, rng, 0.0)
                    if span is not None:
                        placed[i] = SpanPeer(peer.peer_id, peer.compute, peer.network, *span)
                        moved = True
                if not moved:
                    break
            best = max(best, min(coverage(placed, self.work), default=0.0))
        return best


def run(manifest: Manifest, spans: bool, people: list[Volunteer], hours: float, seed: int) -> dict:
    swarm = Swarm(manifest, spans, random.Random(seed))
    samples, now, next_sample = [], 0.0, WARMUP + JOIN_SECONDS
    next_reference = next_sample
    joined: set[int] = set()
    while now < hours * 3600:
        present = [v for v in people if v.arrives <= now < v.leaves]
        for volunteer in people:
            if volunteer.number in joined and volunteer.leaves <= now:
                swarm.leave(volunteer, now)
                joined.discard(volunteer.number)
        for volunteer in present:
            if volunteer.number not in joined:
                swarm.join(volunteer, now)
                joined.add(volunteer.number)
            else:
                swarm.check(volunteer, now)
        if now >= next_sample:
            with_reference = now >= next_reference
            samples.append(swarm.sample(now, present, with_reference))
            next_sample += SAMPLE_PERIOD
            next_reference += REFERENCE_PERIOD if with_reference else 0.0
        now += STEP
    shares = [s["share_of_bound"] for s in samples]
    tokens = [s["tokens_per_second"] for s in samples]
    participation = [s["participation"] for s in samples]
    references = [s["share_of_reference"] for s in samples if "share_of_reference" in s]
    instant = [s["share_of_instant_reference"] for s in samples if "share_of_instant_reference" in s]
    # samples long enough after a serving peer's departure that its hole could have been filled (a check, a move,
    # the state download): what placement reaches, apart from the holes departures leave
    quiet = [
        s["share_of_reference"]
        for s in samples
        if "share_of_reference" in s and s["since_departure"] > JOIN_SECONDS + 2 * manifest.balancing.check_period
    ]
    return {
        "stages": manifest.num_stages,
        "tokens_per_second_mean": round(sum(tokens) / len(tokens), 1),
        "tokens_per_second_min": round(min(tokens), 1),
        "share_of_bound_mean": round(sum(shares) / len(shares), 3),
        "share_of_bound_min": round(min(shares), 3),
        "share_of_bound_p5": round(sorted(shares)[len(shares) // 20], 3),
        "share_of_reference_mean": round(sum(references) / len(references), 3),
        "share_of_reference_min": round(min(references), 3),
        "share_of_reference_p10": round(sorted(references)[len(references) // 10], 3),
        "share_of_reference_quiet_mean": round(sum(quiet) / len(quiet), 3) if quiet else None,
        "share_of_reference_quiet_min": round(min(quiet), 3) if quiet else None,
        "quiet_samples": f"{len(quiet)} of {len(references)}",
        "share_of_instant_reference_mean": round(sum(instant) / len(instant), 3),
        "share_of_instant_reference_min": round(min(instant), 3),
        "participation_mean": round(sum(participation) / len(participation), 3),
        "moves": swarm.moves,
        "states_lost": swarm.states_lost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=100, help="volunteers present on average")
    parser.add_argument("--hours", type=float, default=6.0)
    parser.add_argument("--session-hours", type=float, default=2.0, help="mean stay of a volunteer")
    parser.add_argument("--shapes", default="1b,7b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="fixed-24GB,fixed-8GB,spans", help="the swarms to run")
    parser.add_argument("--min-gain", type=float, default=None, help="balancing.min_gain (default: the preset's)")
    parser.add_argument(
        "--min-holders", type=int, default=None, help="balancing.min_holders: spare holders (default: the preset's)"
    )
    args = parser.parse_args()
    result: dict = {"settings": vars(args), "gpus_at_least_8gb": sum(g[3] for g in GPUS if g[1] >= 8) / 100}
    began = time.monotonic()
    for name in args.shapes.split(","):
        shape = shapes()[name]
        people = volunteers(args.peers, args.hours, args.session_hours, random.Random(args.seed))
        model = shape["model"]
        balancing = {} if args.min_gain is None else {"min_gain": args.min_gain}
        balancing |= {} if args.min_holders is None else {"min_holders": args.min_holders}
        one_block = new_manifest(
            name,
            shape["preset"],
            stages=(model or {}).get("depth", 22),
            model=model,
            training=shape["training"],
            balancing=balancing,
        )
        sized_24gb = new_manifest(
            name,
            shape["preset"],
            stages=shape["fixed_24gb"],
            model=model,
            training=shape["training"],
            balancing=balancing,
        )
        swarms = {"fixed-24GB": (sized_24gb, False), "fixed-8GB": (one_block, False), "spans": (one_block, True)}
        modes = args.modes.split(",")
        result[name] = {
            mode: run(manifest, spans, people, args.hours, args.seed)
            for mode, (manifest, spans) in swarms.items()
            if mode in modes
        }
        # who can take part at all: a span of at least one block somewhere
        fits = {
            gpu: bool(any(span_lengths(one_block, int((memory * 1e9 - DESKTOP_BYTES) * 0.9))))
            for gpu, memory, _, _ in GPUS
        }
        result[name]["gpus_that_fit_a_block"] = sorted(g for g, ok in fits.items() if ok)
        result[name]["gpus_that_do_not"] = sorted(g for g, ok in fits.items() if not ok)
        for mode in modes:
            r = result[name][mode]
            print(
                f"{name} {mode:10s}: {r['stages']:2d} stages, {r['tokens_per_second_mean']:9.0f} tokens/s "
                f"(min {r['tokens_per_second_min']:.0f}), share of bound mean {r['share_of_bound_mean']:.3f} "
                f"min {r['share_of_bound_min']:.3f}; of reference mean {r['share_of_reference_mean']:.3f} "
                f"min {r['share_of_reference_min']:.3f} (instant: mean {r['share_of_instant_reference_mean']:.3f} "
                f"min {r['share_of_instant_reference_min']:.3f}); participation {r['participation_mean']:.2f}, "
                f"{r['moves']} moves, {r['states_lost']} stage states lost",
                file=sys.stderr,
            )
    result["seconds"] = round(time.monotonic() - began, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
