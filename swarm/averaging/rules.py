"""Averaging within a stage, its pure parts: whether a round is due, DiLoCo's outer step, how far a result moves
the parameters, the bytes a round moves, how long a round may take, and the codecs and DHT prefix of rounds. The
averager that runs rounds over hivemind is swarm/averaging/averager.py's; when a stage averages,
swarm/server/rounds.py's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)

from swarm.averaging import quantization
from swarm.manifests.manifest import Manifest
from swarm.wire.messages import unpack

logger = logging.getLogger(__name__)

# A round that would move the stage's parameters by more than this fraction of their norm is dropped: honest
# replicas drift apart by a few local steps between rounds (see docs/RELIABILITY.md for measured values), while a
# contribution of NaN, Inf or absurd values from a faulty or malicious peer moves them far more.
MAX_ROUND_CHANGE = 1.0
MIN_8BIT_ELEMENTS = 1024  # smaller tensors (norms, biases) average in float16: an 8-bit codebook costs 1 KiB
PART_SIZE_BYTES = 2**19  # hivemind's default: tensors travel in parts of up to this many (compressed) bytes
_8BIT_PART_OVERHEAD = 8 + 4 * 256  # each 8-bit part carries its own codebook
RECENT_ROUNDS = 5  # rounds whose durations set the next timeouts
MAX_BACKOFF_DOUBLINGS = 2  # after rounds that found no group, wait up to 4x longer for one
ALLREDUCE_SLACK = 4.0  # an all-reduce may take this many times the longest recent one
ASSUMED_AVERAGING_MBITS = 5.0  # before a round was measured: the slowest uplink a stage's peers are assumed to have
POLL_SECONDS = 0.05  # how often a round's progress is looked at (to time its matchmaking and all-reduce)
ROUND_SLACK = 30.0  # seconds a round may run past its matchmaking and all-reduce timeouts before it is given up


# ------------------------------------------------------------------------------------------- pure logic


@dataclass(frozen=True)
class RoundProgress:
    """What another peer of the stage announced about the current round."""

    round: int
    samples: int  # samples it processed since the round began
    rate: float  # samples per second it added between its last two announcements (ProgressSeen)
    age: float  # seconds since it announced this
    peer_id: str = ""


@dataclass(frozen=True)
class ProgressSeen:
    """The last announcement of a peer's round progress that this peer read, and the rate it implies."""

    round: int
    samples: int
    announced_at: float
    rate: float = 0.0  # samples per second between its last two announcements of the same round; 0 if unknown


def progress_seen(seen: ProgressSeen | None, round_: int, samples: int, announced_at: float) -> ProgressSeen:
    """What a peer's latest announcement says of its pace. The rate is the samples it added between two
    announcements of the same round, not its announced delivered throughput: that is an average over half a
    minute, and a peer whose trainers left would go on counting (and trigger rounds nobody trained for) for a
    minute after. Until two announcements of a round are seen the rate is 0: a round is due a little later, never
    too early."""
    if seen is not None and announced_at <= seen.announced_at:  # the same record again, or an older replica
        return seen
    if seen is None or seen.round != round_ or samples < seen.samples:
        return ProgressSeen(round_, samples, announced_at)
    return ProgressSeen(round_, samples, announced_at, (samples - seen.samples) / (announced_at - seen.announced_at))


def swarm_samples_in_round(
    my_round: int, my_samples: int, others: Iterable[RoundProgress], horizon: float = math.inf
) -> float:
    """Samples the stage has processed across the swarm since round `my_round` began: ours exactly, the others'
    as announced plus what they served since (rate x age, for at most `horizon` seconds: a live peer announces
    again within its announce period, so one that is later may be gone, and a gone peer's pace must not make a
    round due), so that all peers see a round due at about the same time. Peers that announce another round
    number are not counted: their counts belong to another round."""
    return my_samples + sum(o.samples + o.rate * min(max(o.age, 0.0), horizon) for o in others if o.round == my_round)


def current_round(my_round: int, others: Iterable[RoundProgress]) -> int:
    """The stage's round number: a peer that missed rounds (it was busy, or its round failed) catches up."""
    return max([my_round, *(o.round for o in others)])


def outer_step(
    anchor: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    pseudo_gradient: Sequence[torch.Tensor],
    learning_rate: float,
    momentum_factor: float,
) -> None:
    """DiLoCo's outer optimizer, in place: SGD with Nesterov momentum (torch.optim.SGD's update, dampening 0)."""
    for theta, buf, grad in zip(anchor, momentum, pseudo_gradient):
        buf.mul_(momentum_factor).add_(grad)
        theta.sub_(grad.add(buf, alpha=momentum_factor), alpha=learning_rate)


def round_payload_bytes(numels: Sequence[int], compression: str, group_size: int) -> int:
    """Bytes one peer sends (and about as many it receives) in a butterfly all-reduce of tensors with `numels`
    elements among `group_size` peers: it sends its share of every other peer's part, then the averaged part it
    reduced back to each of them: 2 (n-1)/n of the compressed tensors."""
    if group_size < 2:
        return 0
    total = 0.0
    for numel in numels:
        if compression == "float32":
            total += 4 * numel
        elif compression == "float16" or numel < MIN_8BIT_ELEMENTS:
            total += 2 * numel
        elif compression == "4bit":  # half a byte per element plus a codebook per part
            parts = math.ceil(numel / (2 * PART_SIZE_BYTES))
            total += numel / 2 + parts * quantization.HEADER_BYTES
        else:  # 8-bit: one byte per element plus a codebook per part
            parts = math.ceil(numel / PART_SIZE_BYTES)
            total += numel + parts * _8BIT_PART_OVERHEAD
    return int(2 * (group_size - 1) / group_size * total)


@dataclass
class RoundTiming:
    """How long a stage's rounds may take, adapted to what this peer's rounds took: fixed guesses fail on slow
    links ("could not find a group" is what hivemind's users report most) or on large stages (an all-reduce of
    tens of megabytes over a home uplink takes minutes). The configured values are floors.

    - finding a group: at least twice the configured matchmaking time, and twice the longest of the recent rounds'
      matchmaking; doubled after each round in a row that found no group (up to MAX_BACKOFF times), back after a
      success;
    - the all-reduce: at least the configured timeout, ALLREDUCE_SLACK times the longest recent all-reduce, and
      before any round, the time this peer's share of the round takes at ASSUMED_AVERAGING_MBITS."""

    matchmaking_time: float
    timeout: float
    payload_bytes: int  # what this peer sends in a round of two (swarm/averaging/rules.py, round_payload_bytes)
    matchmaking_seconds: list[float] = field(default_factory=list)  # recent rounds, newest last
    allreduce_seconds: list[float] = field(default_factory=list)
    failures_in_a_row: int = 0

    def find_timeout(self) -> float:
        recent = max(self.matchmaking_seconds, default=0.0)
        return max(2 * self.matchmaking_time, 2 * recent) * 2 ** min(self.failures_in_a_row, MAX_BACKOFF_DOUBLINGS)

    def allreduce_timeout(self) -> float:
        if self.allreduce_seconds:
            return max(self.timeout, ALLREDUCE_SLACK * max(self.allreduce_seconds))
        assumed = ALLREDUCE_SLACK * self.payload_bytes / (ASSUMED_AVERAGING_MBITS * 1e6 / 8)
        return max(self.timeout, assumed)

    def succeeded(self, matchmaking: float, allreduce: float) -> None:
        self.matchmaking_seconds = [*self.matchmaking_seconds, matchmaking][-RECENT_ROUNDS:]
        self.allreduce_seconds = [*self.allreduce_seconds, allreduce][-RECENT_ROUNDS:]
        self.failures_in_a_row = 0

    def failed(self, found_group: bool) -> None:
        """A round failed: without a group, the next one waits longer for it; a group that failed to all-reduce
        (a peer left or was too slow) does not change the timeouts."""
        if not found_group:
            self.failures_in_a_row += 1


def gathered_proof(gather: bytes) -> Any:
    """The membership proof in a join request's gathered data (hivemind packs it as [bandwidth, mode, user data];
    ours is {"proof": ...}); None if there is none or the data is malformed."""
    try:
        user = unpack(unpack(gather)[2])
        return user.get("proof") if isinstance(user, dict) else None
    except Exception:
        return None


def round_change(
    start: Sequence[torch.Tensor], result: Sequence[torch.Tensor], diloco: bool, anchor: Sequence[torch.Tensor]
) -> float:
    """How far a round's result would move the parameters, relative to their norm: in parameters mode the
    distance from the parameters at the round's start to the average; in diloco mode the norm of the average
    pseudo-gradient against the anchor's. NaN or Inf if the result holds any. Only the first len(start)
    tensors (the parameters, not optimizer statistics) are compared."""
    if diloco:
        moved = sum(float(r.double().square().sum()) for r in result[: len(anchor)])
        norm = sum(float(a.double().square().sum()) for a in anchor)
    else:
        moved = sum(float((r.double() - s.double()).square().sum()) for r, s in zip(result, start))
        norm = sum(float(s.double().square().sum()) for s in start)
    return math.sqrt(moved) / max(math.sqrt(norm), 1e-12)


def averaging_compression(name: str) -> CompressionBase:
    if name == "float32":
        return NoCompression()
    if name == "float16":
        return Float16Compression()
    quantized = quantization.Uniform4BitQuantization() if name == "4bit" else Uniform8BitQuantization()
    return SizeAdaptiveCompression(MIN_8BIT_ELEMENTS, less=Float16Compression(), greater_equal=quantized)


def averaging_prefix(manifest: Manifest, stage: int) -> str:
    """The DHT prefix of a stage's rounds: only peers of the same swarm, stage and mode ever meet (and in a
    private swarm only those who know its secret can tell where they meet)."""
    prefix = f"{manifest.swarm_id}_stage{stage}_{manifest.averaging.mode}"
    return f"{prefix}_{manifest.secret.tag}" if manifest.secret is not None else prefix
