"""Abuse: bad gradients for cached activations, floods, and a client that keeps sending bad requests."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from fuzzing import CASES, FIRST, FORWARD_TIMEOUT, LAST, MANIFEST
from swarm.trust.bans import BAD_REQUESTS_BEFORE_BAN
from swarm.wire.messages import make_control_request
from swarm.wire.tensors import encode_tensor

from .clients import (
    STREAM_WAIT,
    StreamResult,
    call,
    is_parse_refusal,
    open_stream,
    stage_outcome,
    stream_outcome,
)
from .fuzzed_swarm import RSS_GROWTH_LIMIT, Swarm, group_rss
from .hostile import with_value
from .messages import (
    BACKWARD,
    BATCH,
    DOWNLOAD_STATE,
    FORWARD,
    FORWARD_STREAM,
    LENGTH,
    PROBE,
    hidden,
    make_request,
    metadata,
    parts,
    state_request,
    tokens,
    valid_forward,
)

integration = pytest.mark.integration


@integration
def test_bad_backward_of_a_cached_forward_changes_nothing(swarm: Swarm):
    """Stage 0 keeps the activations of training forwards: bad gradients for them are refused, not applied. The
    two forwards hold the step's two gradient slots (the step gate): a third training forward is answered busy
    after half its budget, not queued behind gradients that may never come."""
    clients = swarm.clients
    p2p = clients.fresh()  # its own identity: the activations it leaves cached are keyed by it
    ids = ["cached-0", "cached-1"]  # 14 bad requests: fewer than a ban takes

    def send(name: str, request: runtime_pb2.ExpertRequest) -> str:
        raw = clients.run(p2p._client.call_unary_handler(clients.targets[FIRST], name, request.SerializeToString()))
        return stage_outcome(runtime_pb2.ExpertResponse.FromString(raw))

    for microbatch_id in ids:
        assert send(FORWARD, valid_forward(FIRST, train=True, microbatch_id=microbatch_id)) == "ok"
    started = time.monotonic()
    assert send(FORWARD, valid_forward(FIRST, train=True, microbatch_id="one-too-many")) == "busy"
    assert FORWARD_TIMEOUT / 2 - 0.5 < time.monotonic() - started < FORWARD_TIMEOUT
    grad = hidden()
    bad_grads = [
        ("a NaN gradient", [with_value(grad, float("nan"))]),
        ("an Inf gradient", [with_value(grad, float("-inf"))]),
        ("a gradient of 3e38 everywhere", [with_value(grad, 3e38, True)]),
        ("a gradient of another shape", [hidden(BATCH, LENGTH - 1)]),
        ("a gradient of the whole microbatch size", [hidden(8)]),
        ("an int64 gradient", [tokens()]),
        ("a float16-compressed NaN", [encode_tensor(with_value(grad, float("nan")), "float16")]),
    ]
    for microbatch_id in ids:
        for label, tensors in bad_grads:
            request = make_request(tensors, metadata(stage=FIRST, microbatch_id=microbatch_id))
            assert send(BACKWARD, request) == "bad_request", label
            CASES["rpc_backward: bad gradient of a cached forward"] += 1
    clients.retire(p2p)  # nobody else can send backward for its cached forwards
    swarm.alive()


@integration
def test_floods_get_busy_or_served_promptly(swarm: Swarm):
    clients = swarm.clients
    senders = [clients.fresh() for _ in range(4)]
    requests = {stage: valid_forward(stage).SerializeToString() for stage in (FIRST, LAST)}
    rss = {stage: group_rss(peer.pgid) for stage, peer in swarm.peers.items()}

    async def timed(coroutine: Coroutine) -> tuple[float, Any]:
        started = time.monotonic()
        try:
            return time.monotonic() - started, await coroutine
        except Exception as e:
            return time.monotonic() - started, e

    async def flood() -> list[tuple[str, float, Any]]:
        calls: list[tuple[str, Coroutine]] = []
        for i in range(400):  # a quarter of them from one sender: more than its share of slots
            stage = LAST if i % 4 else FIRST
            sender = senders[0] if i < 100 else senders[i % 4]
            calls.append(
                ("forward", sender._client.call_unary_handler(clients.targets[stage], FORWARD, requests[stage]))
            )
        for i in range(100):
            garbage = random.Random(i).randbytes(100)
            calls.append(
                ("garbage", senders[i % 4]._client.call_unary_handler(clients.targets[i % 2], FORWARD, garbage))
            )
        for i in range(60):
            chunks = parts(valid_forward(LAST))
            stream = open_stream(senders[i % 4], clients.targets[LAST], FORWARD_STREAM, chunks, "message", STREAM_WAIT)
            calls.append(("stream", stream))
        results = await asyncio.gather(*[timed(call) for _, call in calls])
        return [(kind, seconds, result) for (kind, _), (seconds, result) in zip(calls, results)]

    started = time.monotonic()
    results = clients.run(flood(), 60)
    took = time.monotonic() - started
    outcomes: collections.Counter[str] = collections.Counter()
    for kind, seconds, result in results:
        if kind == "garbage":
            assert isinstance(result, Exception) and is_parse_refusal(result), result
            outcome = "unparsed"
        elif kind == "stream":
            assert isinstance(result, StreamResult), result
            outcome = stream_outcome(result, "flood")
        else:
            assert isinstance(result, bytes), result
            outcome = stage_outcome(runtime_pb2.ExpertResponse.FromString(result))
        allowed = (
            {"unparsed"} if kind == "garbage" else {"ok", "busy", "closed"} if kind == "stream" else {"ok", "busy"}
        )
        assert outcome in allowed, (kind, outcome)  # closed: a busy reply lost (test_a_stream_refused_midway_...)
        assert seconds < 20, (kind, seconds)
        outcomes[f"{kind} {outcome}"] += 1
        CASES[f"flood: {kind}"] += 1
    print(f"\nflood of {len(results)} requests in {took:.1f} s: {dict(outcomes)}")
    assert outcomes["forward ok"] >= 1, outcomes  # how many: a slower peer (a loaded machine) takes fewer at once
    assert outcomes["forward busy"] >= 1, "one sender had more requests in flight than its share; none was refused"
    for stage in (FIRST, LAST):  # busy replies are not held against anyone
        swarm.served(stage, senders[0])
        chunks = parts(valid_forward(stage))
        assert clients.stream(stage, FORWARD_STREAM, chunks, "flood: stream", {"ok"}, p2p=senders[1]) == "ok"
        growth = group_rss(swarm.peers[stage].pgid) - rss[stage]
        print(f"stage {stage}: memory grew by {growth / 2**20:.1f} MiB over the flood")
        assert growth < RSS_GROWTH_LIMIT / 2, f"stage {stage}: memory grew by {growth / 2**20:.0f} MiB over the flood"
    for sender in senders:
        clients.retire(sender)
    swarm.alive()


@integration
def test_a_client_that_keeps_sending_bad_requests_is_banned(swarm: Swarm):
    clients = swarm.clients
    offender, bystander = clients.fresh(), clients.identity(LAST)
    bad = make_request([hidden(), tokens()], metadata(swarm_id="0" * 16))
    outcomes = [call(clients, offender, LAST, FORWARD, bad) for _ in range(BAD_REQUESTS_BEFORE_BAN)]
    assert outcomes == ["bad_request"] * BAD_REQUESTS_BEFORE_BAN, outcomes
    # banned now, at every handler, even for valid requests
    assert call(clients, offender, LAST, FORWARD, bad) == "banned"
    assert call(clients, offender, LAST, FORWARD, valid_forward(LAST)) == "banned"
    assert call(clients, offender, LAST, BACKWARD, make_request([hidden()])) == "banned"
    assert call(clients, offender, LAST, PROBE, make_control_request(MANIFEST)) == "banned"
    for name, chunks in ((FORWARD_STREAM, parts(valid_forward(LAST))), (DOWNLOAD_STATE, [state_request(stage=LAST)])):
        # A banned sender's stream is answered at once and closed unread. A stream that has sent nothing yet gets
        # that reply whole; one that sent its request may have it reset by the unread parts, and the reply lost
        # (test_a_stream_refused_midway_...): it must never be served, whether the reply arrives or not.
        assert clients.stream(LAST, name, [], "ban", {"banned"}, ending="none", p2p=offender) == "banned"
        for _ in range(3):
            clients.stream(LAST, name, chunks, "ban", {"banned", "closed"}, p2p=offender)
    raw = clients.run(
        offender._client.call_unary_handler(clients.targets[LAST], FORWARD, valid_forward(LAST).SerializeToString())
    )
    assert "bans you" in MSGPackSerializer.loads(runtime_pb2.ExpertResponse.FromString(raw).metadata)["error"]
    # others are served; a ban is one peer's: the other still serves the offender
    assert call(clients, bystander, LAST, FORWARD, valid_forward(LAST)) == "ok"
    assert call(clients, offender, FIRST, FORWARD, valid_forward(FIRST)) == "ok"
    CASES["ban"] += BAD_REQUESTS_BEFORE_BAN + 13
    clients.retire(offender)
    swarm.alive()
