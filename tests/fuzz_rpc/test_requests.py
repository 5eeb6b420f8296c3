"""Unary handlers: garbage, truncated and corrupted bytes, bad metadata, bad train requests, bad tensors,
random requests."""

from __future__ import annotations

import random

import pytest

from fuzzing import FIRST, LAST

from .clients import check_manifest_reply, check_reachability_reply, unparsed_or_reply
from .fuzzed_swarm import Swarm
from .hostile import (
    alternating,
    backward_cases,
    header_cases,
    metadata_fields,
    metadata_garbage,
    random_request,
    stage_one_tensor_cases,
    stage_zero_tensor_cases,
    with_value,
)
from .messages import (
    BACKWARD,
    BATCH,
    CHECK,
    DELETE,
    FORWARD,
    LENGTH,
    MANIFEST_RPC,
    PROBE,
    STAGE_UNARY,
    TRAIN,
    VOCAB,
    WIDTH,
    hidden,
    make_request,
    metadata,
    might_change_weights,
    tokens,
    train_request,
    valid_forward,
)

integration = pytest.mark.integration


@integration
def test_garbage_truncated_and_corrupted_bytes_at_every_unary_handler(swarm: Swarm):
    rng = random.Random(1)
    clients = swarm.clients
    valid = {stage: valid_forward(stage).SerializeToString() for stage in (FIRST, LAST)}
    for _ in range(8):
        for stage in (FIRST, LAST):
            for name in STAGE_UNARY:
                length = rng.choice([0, 1, 2, 3, 8, 64, 512, 4096, 65536, 1 << 20])
                clients.unary(stage, name, rng.randbytes(length), f"{name.split('.')[-1]}: random bytes")
            check_manifest_reply(unparsed_or_reply(clients, stage, MANIFEST_RPC, rng.randbytes(rng.randrange(256))))
            check_reachability_reply(unparsed_or_reply(clients, stage, CHECK, rng.randbytes(rng.randrange(256))))
    for stage in (FIRST, LAST):
        data = valid[stage]
        for _ in range(12):  # cut anywhere: in a tag, a length, the metadata, a tensor's buffer
            cut = data[: rng.randrange(len(data))]
            for name in (FORWARD, BACKWARD):
                clients.unary(stage, name, cut, f"{name.split('.')[-1]}: truncated protobuf")
        for _ in range(10):
            corrupted = bytearray(data)
            for _ in range(rng.choice([1, 1, 2, 8, 64])):
                corrupted[rng.randrange(len(corrupted))] = rng.randrange(256)
            corrupted = bytes(corrupted)
            for name in (FORWARD, BACKWARD):
                if not might_change_weights(corrupted, name, stage):  # a flipped `train` could make it train
                    clients.unary(stage, name, corrupted, f"{name.split('.')[-1]}: corrupted protobuf")
    swarm.alive()


@integration
def test_bad_metadata(swarm: Swarm):
    rng = random.Random(2)
    clients = swarm.clients
    for label, raw in metadata_garbage():
        clients.unary(
            LAST,
            FORWARD,
            make_request([hidden(), tokens()], raw).SerializeToString(),
            f"rpc_forward: metadata {label}",
            {"bad_request"},
        )
        clients.unary(
            FIRST,
            BACKWARD,
            make_request([hidden()], raw).SerializeToString(),
            f"rpc_backward: metadata {label}",
            {"bad_request"},
        )
        clients.unary(
            LAST, PROBE, make_request([], raw).SerializeToString(), f"rpc_probe: metadata {label}", {"bad_request"}
        )
    for stage in (FIRST, LAST):
        tensors = [tokens()] if stage == FIRST else [hidden(), tokens()]
        for label, meta, valid in metadata_fields(stage, rng)[:: 1 if stage == LAST else 2]:
            data = make_request(tensors, meta).SerializeToString()
            expected = {"ok", "bad_request"} if valid is None else {"ok"} if valid else {"bad_request"}
            clients.unary(stage, FORWARD, data, f"rpc_forward: metadata {label}", expected)
    for label, meta, valid in metadata_fields(FIRST, rng)[::4]:  # backward of a microbatch never seen
        data = make_request([hidden()], meta).SerializeToString()
        expected = (
            {"unknown_microbatch", "bad_request"}
            if valid is None
            else {"unknown_microbatch"}
            if valid
            else {"bad_request"}
        )
        clients.unary(FIRST, BACKWARD, data, f"rpc_backward: metadata {label}", expected)
    swarm.alive()


@integration
def test_bad_train_requests(swarm: Swarm):
    """rpc_train (a microbatch forwarded from stage to stage): bad routes, budgets, tensors; a valid one that does
    not train is served; one for another stage is refused. (The two peers are swarms of their own: stage 0 finds
    no stage 1 to pass a microbatch on to, and says so at once when its budget leaves no time to look.)"""
    clients = swarm.clients
    last_peer = str(clients.targets[LAST])
    assert clients.unary(LAST, TRAIN, train_request(LAST), "rpc_train stage 1: valid, no training") == "ok"
    unknown = "12D3KooW" + "A" * 44  # nobody announces it: the hop does not dial a peer just because a route says so
    for route in ([], [last_peer], [unknown]):
        label = f"rpc_train stage 0: valid, route {route}"
        data = train_request(FIRST, route=route, budget=2.0)
        clients.unary(FIRST, TRAIN, data, label, {"downstream_failed"})
    bad_fields = {
        "route": [None, "peer", 5, [5], [""], ["x" * 200], [last_peer, last_peer], {"0": last_peer}],
        "budget": [DELETE, None, 0, -1, "10", True, float("nan"), float("inf"), 1e9, [10]],
    }
    for key, values in bad_fields.items():
        for value in values:
            for stage in (FIRST, LAST):
                if key == "route" and stage == LAST and value in ([], None):
                    continue
                label = f"rpc_train stage {stage}: {key} {repr(value)[:30]}"
                clients.unary(stage, TRAIN, train_request(stage, **{key: value}), label, {"bad_request"})
    tensor_cases = [
        ("no targets", FIRST, [tokens()]),
        ("no tensors", LAST, []),
        ("three tensors", LAST, [hidden(), tokens(), tokens()]),
        ("hidden states to stage 0", FIRST, [hidden(), tokens()]),
        ("tokens to stage 1", LAST, [tokens(), tokens()]),
        ("targets of another shape", LAST, [hidden(), tokens(length=LENGTH + 1)]),
        ("token ids out of range", FIRST, [tokens() + VOCAB, tokens()]),
        ("NaN hidden states", LAST, [with_value(hidden(), float("nan")), tokens()]),
        ("a batch too large", FIRST, [tokens(batch=1000), tokens(batch=1000)]),
    ]
    for label, stage, tensors in tensor_cases:
        clients.unary(stage, TRAIN, train_request(stage, tensors), f"rpc_train: {label}", {"bad_request"})
    # meant for the other stage: the peer has moved (or the caller's view is old); nothing is applied
    tensors = [hidden(), tokens()]
    clients.unary(FIRST, TRAIN, train_request(LAST, tensors), "rpc_train: for stage 1, at stage 0", {"wrong_stage"})
    swarm.alive()


@integration
def test_bad_tensors(swarm: Swarm):
    clients = swarm.clients
    y = tokens()
    for label, proto in header_cases():
        data = make_request([proto, y]).SerializeToString()
        expected = {"ok"} if label in ("dtype 'float32' compression 0", "requires_grad set") else {"bad_request"}
        clients.unary(LAST, FORWARD, data, f"rpc_forward: {label}", expected)
    for label, tensors in stage_one_tensor_cases():
        clients.unary(
            LAST, FORWARD, make_request(tensors).SerializeToString(), f"rpc_forward: {label}", {"bad_request"}
        )
    # every value finite, their sum 0: accepted (not training, the peer just computes a useless loss)
    data = make_request([alternating(3e38, (BATCH, LENGTH, WIDTH)), y]).SerializeToString()
    clients.unary(LAST, FORWARD, data, "rpc_forward: ±3e38 inputs", {"ok", "bad_request"})
    for label, tensors in stage_zero_tensor_cases():
        data = make_request(tensors, metadata(stage=FIRST)).SerializeToString()
        clients.unary(FIRST, FORWARD, data, f"rpc_forward: {label}", {"bad_request"})
    for stage, other in ((FIRST, LAST), (LAST, FIRST)):
        tensors = [tokens()] if other == FIRST else [hidden(), tokens()]
        data = make_request(tensors, metadata(stage=other)).SerializeToString()
        clients.unary(stage, FORWARD, data, "rpc_forward: another stage", {"wrong_stage"})
        data = make_request([hidden()], metadata(stage=other)).SerializeToString()
        clients.unary(stage, BACKWARD, data, "rpc_backward: another stage", {"wrong_stage", "bad_request"})
    for label, stage, tensors, expected in backward_cases():
        data = make_request(
            tensors, metadata(stage=stage, microbatch_id=f"never-seen-{label}"[:64])
        ).SerializeToString()
        clients.unary(stage, BACKWARD, data, f"rpc_backward: {label}", {expected})
    swarm.alive()


@integration
def test_random_requests(swarm: Swarm):
    rng = random.Random(3)
    clients = swarm.clients
    fields = {stage: metadata_fields(stage, random.Random(stage)) for stage in (FIRST, LAST)}
    sent = 0
    while sent < 150:
        stage, name = rng.choice(
            [(FIRST, FORWARD), (LAST, FORWARD), (FIRST, BACKWARD), (LAST, BACKWARD), (rng.choice([FIRST, LAST]), PROBE)]
        )
        data = random_request(rng, stage, fields[stage])
        if might_change_weights(data, name, stage) or len(data) > 3 * 2**20:
            continue
        clients.unary(stage, name, data, f"{name.split('.')[-1]}: random request")
        sent += 1
    swarm.alive()
