"""Request streams: broken, never ended, refused midway."""

from __future__ import annotations

import asyncio
import random

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from fuzzing import CASES, FIRST, FORWARD_TIMEOUT, LAST

from .clients import STREAM_WAIT, StreamResult, open_stream, send_then_read, stage_outcome, stream_outcome
from .fuzzed_swarm import BACKGROUND, Swarm, start_stalled_download
from .hostile import RAW_STREAMS, stream_cases
from .messages import BACKWARD_STREAM, FORWARD_STREAM, chunk_part, frame, parts, valid_forward

integration = pytest.mark.integration


@integration
def test_broken_request_streams(swarm: Swarm):
    rng = random.Random(5)
    clients = swarm.clients
    for stage, name in ((LAST, FORWARD_STREAM), (FIRST, BACKWARD_STREAM), (FIRST, FORWARD_STREAM)):
        method = name.split(".")[-1]
        for label, chunks, expected in stream_cases(stage):
            if name == BACKWARD_STREAM and expected == {"ok"}:
                expected = {"unknown_microbatch", "bad_request"}  # a forward as backward: never applied
            clients.stream(stage, name, chunks, f"{method}: {label}", expected)
        for label, chunks in RAW_STREAMS:
            clients.stream(stage, name, chunks, f"{method}: {label}", {"closed", "bad_request"}, ending="eof")
        for _ in range(8):
            garbage = [rng.randbytes(rng.choice([1, 9, 100, 5000]))]
            clients.stream(stage, name, garbage, f"{method}: random bytes", {"closed", "bad_request"}, ending="eof")
    swarm.alive()


@integration
def test_streams_that_never_end_are_answered_within_the_forward_timeout(swarm: Swarm):
    clients = swarm.clients
    valid = valid_forward(LAST)
    head = frame(runtime_pb2.ExpertRequest(metadata=valid.metadata).SerializeToString())
    endless = P2P.MESSAGE_MARKER + (2**40).to_bytes(8, "big") + bytes(1000)
    cases = [
        ("nothing at all", LAST, FORWARD_STREAM, []),
        ("metadata, then nothing", LAST, FORWARD_STREAM, [head]),
        ("a request without its end", LAST, FORWARD_STREAM, parts(valid)),
        ("half a tensor", LAST, FORWARD_STREAM, parts(valid)[:2]),
        ("a frame that never ends", LAST, FORWARD_STREAM, [endless]),
        ("metadata, then nothing", FIRST, BACKWARD_STREAM, [head]),
        ("a frame that never ends", FIRST, BACKWARD_STREAM, [endless]),
    ]
    p2p = clients.identity(LAST, room=len(cases))
    clients.strikes[LAST] += len(cases)  # (the two to stage 0 as well, to be safe)

    async def all_at_once() -> list[StreamResult]:
        return await asyncio.gather(
            *[
                open_stream(p2p, clients.targets[stage], name, chunks, "none", STREAM_WAIT)
                for _, stage, name, chunks in cases
            ]
        )

    for (label, _, name, _), result in zip(cases, clients.run(all_at_once(), STREAM_WAIT + 5)):
        kind = f"{name.split('.')[-1]}: {label}"
        if label == "a frame that never ends":  # it declares 2**40 bytes: the stream is closed at its header
            assert stream_outcome(result, kind) == "closed", kind
        else:
            assert stream_outcome(result, kind) == "bad_request", kind
            assert "in time" in MSGPackSerializer.loads(result.replies[0].metadata)["error"], kind
        assert result.seconds < FORWARD_TIMEOUT + 5, (kind, result.seconds)
        CASES[kind.split(":")[0]] += 1
    swarm.alive()


@integration
def test_a_state_request_that_never_ends_is_answered_or_closed(swarm: Swarm):
    future = BACKGROUND.pop("stalled download", None) or start_stalled_download(swarm.clients)
    CASES["rpc_download_state"] += 1
    result = future.result(STREAM_WAIT + 5)  # raises AssertionError if neither a reply nor a close came
    assert result.replies or result.rpc_errors is not None


@integration
def test_a_stream_refused_midway_still_gets_its_reply(swarm: Swarm):
    """A stream refused before its end (an empty chunk here; busy and banned alike) still gets its reply: the peer
    reads the rest of the request (up to a valid request's size) before it answers, since closing a stream with
    parts unread resets it and loses the reply. (A request larger than any valid one may lose it.)"""
    clients = swarm.clients
    head = frame(runtime_pb2.ExpertRequest(metadata=valid_forward(LAST).metadata).SerializeToString())
    chunks = [head, chunk_part(bytes(2**12), "float32", [2**10]), chunk_part(b"")] + [chunk_part(bytes(2**12))] * 8
    sender = clients.identity(LAST, room=8)
    outcomes = []
    for _ in range(8):
        replies = clients.run(send_then_read(sender, clients.targets[LAST], FORWARD_STREAM, chunks), STREAM_WAIT)
        outcomes.append(stage_outcome(replies[0]) if replies else "closed")
        clients.strikes[LAST] += 1
        CASES["rpc_forward_stream: refused midway"] += 1
    swarm.alive()
    assert outcomes == ["bad_request"] * len(outcomes), outcomes
