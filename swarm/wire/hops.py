"""The rules of a hop, which its caller and its callee both follow: deadlines and budgets, which error codes blame
the peer that sent them, how a reply is checked, and the hop timings a train reply carries back.

A forwarded microbatch (swarm/server/forwarding.py) gets a budget at each hop: the seconds that hop has to reply.
Its caller waits that budget plus `grace` before it gives up and moves on; the callee applies its gradient only
before its deadline (arrival + budget). So a gradient applied in time is never applied again elsewhere, without
any clock shared between the two. A hop hands the next one `onward_budget` of what it has left, and calls no
further hop with less than MIN_BUDGET. A trainer (swarm/client/) starts the chain by the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.proto import runtime_pb2

from swarm.errors import RemoteStageError
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import decode_reply, unpack
from swarm.wire.tensors import PRINT_SIZE, all_finite
from swarm.wire.validation import MAX_PEER_ID

MIN_BUDGET = 0.5  # seconds: a hop with less left does not call the next one
# codes of a next hop's reply that are no fault of that peer: it is not banned for them
BLAMELESS = (
    ErrorCode.BUSY,
    ErrorCode.WRONG_STAGE,
    ErrorCode.DOWNSTREAM_FAILED,
    ErrorCode.TOO_LATE,
    ErrorCode.OVERFLOW,
)
# the relay pipeline's (the trainer calls each stage itself): a stage that is busy, moved, or whose gradient
# overflowed did nothing wrong
RELAY_BLAMELESS = (ErrorCode.BUSY, ErrorCode.WRONG_STAGE, ErrorCode.OVERFLOW)
MAX_HOP_SECONDS = 1e6  # a hop timing above this is malformed


def grace(budget: float) -> float:
    """How long a caller waits past a hop's budget before it moves on: the reply's way back, and clock-free slack
    between 'the callee's deadline passed' and 'the caller gave up' (so a gradient applied in time is never
    applied again elsewhere)."""
    return 1.0 + 0.05 * budget


def onward_budget(remaining: float, reserve: float, stages_after: int, per_stage: float) -> float:
    """The budget for the next hop: what is left after this hop's reserve and the grace, capped so that a hop that
    hangs leaves time to try another peer."""
    left = remaining - reserve
    return min(left - grace(left), per_stage * stages_after)


def check_reply(
    reply: runtime_pb2.ExpertResponse, expect: list[tuple[int, ...]], max_elements: int
) -> list[torch.Tensor]:
    """The tensors of a stage's reply, which must be finite float32 tensors of exactly the `expect`ed shapes;
    raises RemoteStageError otherwise (or for an error reply)."""
    outputs = decode_reply(reply, max_elements)
    shapes = [tuple(t.shape) for t in outputs]
    if shapes != [tuple(e) for e in expect] or any(t.dtype != torch.float32 for t in outputs):
        raise RemoteStageError(
            f"malformed reply: expected float32 tensors of shapes {expect}, got {shapes}", ErrorCode.INTERNAL
        )
    if not all(all_finite(t) for t in outputs):
        raise RemoteStageError("the reply contains NaN or Inf", ErrorCode.INTERNAL)
    return outputs


# ---------------------------------------------------------------------------------------- hop timings


@dataclass
class HopTiming:
    """One hop of a forwarded microbatch, as its reply reports it: seconds of compute at the peer, and seconds
    from the request's arrival to the reply (compute, queueing and everything after it on the route)."""

    peer_id: str
    compute: float
    total: float
    gradient_print: tuple[float, ...] = ()  # of the gradient the next hop sent back (none on the last hop)


def encode_hops(here: HopTiming, later: Sequence[HopTiming]) -> list[list]:
    """The `hops` metadata of a train reply: this hop (its times rounded to microseconds, its gradient print only
    if it has one), then the hops after it as their replies reported them."""
    entry: list = [here.peer_id, round(here.compute, 6), round(max(here.total, here.compute), 6)]
    hops = [entry + [list(here.gradient_print)]] if here.gradient_print else [entry]
    return hops + [[h.peer_id, h.compute, h.total, list(h.gradient_print)] for h in later]


def decode_hops(reply: runtime_pb2.ExpertResponse, most: int) -> list[HopTiming]:
    """The timings a train reply carries (this hop's first); [] when they are missing or malformed (they only
    guide routing: a peer that lies about them misleads only its callers' estimates of itself)."""
    try:
        hops = unpack(reply.metadata).get("hops", [])
        if not isinstance(hops, list) or len(hops) > most:
            return []
        timings = []
        for hop in hops:
            if not isinstance(hop, list) or len(hop) not in (3, 4):
                return []
            peer_id, compute, total = hop[:3]
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (compute, total))
            if not (isinstance(peer_id, str) and 0 < len(peer_id) <= MAX_PEER_ID and numbers):
                return []
            if not (0 <= compute <= total <= MAX_HOP_SECONDS):
                return []
            fingerprint = _gradient_print(hop[3]) if len(hop) == 4 else ()
            timings.append(HopTiming(peer_id, float(compute), float(total), fingerprint))
        return timings
    except Exception:
        return []


def _gradient_print(value: object) -> tuple[float, ...]:
    """A hop's gradient fingerprint, or () when it is missing or malformed (then nothing is compared)."""
    if not isinstance(value, list) or len(value) > PRINT_SIZE:
        return ()
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return ()
    return tuple(float(v) for v in value)
