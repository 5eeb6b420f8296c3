"""The wire layer (swarm/wire/): compression of activations and gradients and its validation on arrival, the RPCs'
names on the wire, the error codes and their one map from exceptions, hop timings, and the one request path of a
served stage (swarm/server/request_path.py) that turns what stopped a request into its error reply."""

from __future__ import annotations

import asyncio
import inspect

import msgpack
import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.dht.records import PeerState
from swarm.errors import (
    BadRequestError,
    RemoteStageError,
    TooLateError,
    WrongStageError,
)
from swarm.manifests.validation import manifest_from_dict
from swarm.server.admission import Admission
from swarm.server.compute import StageCompute
from swarm.server.reachability import ReachabilityService
from swarm.server.request_path import RequestPath
from swarm.server.service import StageService
from swarm.server.worker import StageWorker
from swarm.wire.codes import EXCEPTION_CODES, ErrorCode, code_of
from swarm.wire.hops import HopTiming, decode_hops, encode_hops
from swarm.wire.messages import decode_reply, make_error_reply, make_reply
from swarm.wire.rpc import ReachabilityRPC, StageRPC
from swarm.wire.tensors import decode_tensor, encode_tensor, wire_compression

LIMIT = 10**7


@pytest.mark.parametrize(
    "compression, bytes_per_element, tolerance",
    [("float32", 4, 0), ("float16", 2, 1e-3), ("bfloat16", 2, 1e-2), ("8bit", 1, 0.05)],
)
def test_activations_travel_compressed_and_come_back_close(compression, bytes_per_element, tolerance):
    torch.manual_seed(0)
    activations = torch.randn(4, 32, 64)
    proto = encode_tensor(activations, compression)
    assert len(proto.buffer) <= bytes_per_element * activations.numel() + 2048
    decoded = decode_tensor(proto, LIMIT, "activations")
    assert decoded.dtype == torch.float32 and decoded.shape == activations.shape
    relative = float((decoded - activations).norm() / activations.norm())
    assert relative <= tolerance


def test_small_tensors_are_not_quantized():
    loss = torch.tensor([2.5])
    proto = encode_tensor(loss, "8bit")
    assert float(decode_tensor(proto, LIMIT, "loss")[0]) == 2.5


def test_malformed_8bit_tensors_are_refused():
    proto = encode_tensor(torch.randn(2048), "8bit")
    truncated = type(proto)()
    truncated.CopyFrom(proto)
    truncated.buffer = proto.buffer[:-1]
    with pytest.raises(BadRequestError, match="bytes"):
        decode_tensor(truncated, LIMIT, "x")
    huge_codebook = type(proto)()
    huge_codebook.CopyFrom(proto)
    huge_codebook.buffer = (10**9).to_bytes(8, "little") + proto.buffer[8:]
    with pytest.raises(BadRequestError, match="codebook"):
        decode_tensor(huge_codebook, LIMIT, "x")


def test_uncompressed_activations_travel_in_the_compute_dtype():
    def wire(precision, compression):
        raw = tiny_manifest_dict(training={"precision": precision, "activation_compression": compression})
        return wire_compression(manifest_from_dict(raw))

    assert wire("float32", "float32") == "float32"
    assert wire("bfloat16", "float32") == "bfloat16"
    assert wire("float16", "float32") == "bfloat16"  # unscaled gradients need bfloat16's range
    assert wire("bfloat16", "8bit") == "8bit"  # compressed further: as asked


# ------------------------------------------------------------------------------------------- the RPCs


STAGE_RPCS = [
    "rpc_backward",
    "rpc_backward_stream",
    "rpc_download_state",
    "rpc_forward",
    "rpc_forward_stream",
    "rpc_manifest",
    "rpc_probe",
    "rpc_tokenizer",
    "rpc_train",
    "rpc_train_stream",
]


def rpc_methods(cls: type) -> list[str]:
    return sorted(name for name, _ in inspect.getmembers(cls, inspect.isfunction) if name.startswith("rpc_"))


def handlers(cls: type) -> list[tuple]:
    """What hivemind registers for a servicer class: (handle name, request type, reply type, streams)."""
    cls._collect_rpc_handlers()
    return sorted(
        (cls._get_handle_name(cls.NAMESPACE, h.method_name), h.request_type, h.response_type, h.stream_input)
        + (h.stream_output,)
        for h in cls._rpc_handlers
    )


def test_the_handlers_keep_their_names_on_the_wire():
    # protocol 5's names: a peer with other names could not reach, nor be reached by, the swarm's other peers
    assert rpc_methods(StageRPC) == STAGE_RPCS
    assert [StageRPC.handle_name(m) for m in STAGE_RPCS] == [f"swarm::StageService.{m}" for m in STAGE_RPCS]
    assert ReachabilityRPC.handle_name("rpc_check") == "swarm.reachability::ReachabilityService.rpc_check"
    streams = {m: ("_stream" in m or m == "rpc_download_state") for m in STAGE_RPCS}
    assert [(h[0], h[3], h[4]) for h in handlers(StageRPC)] == [
        (f"swarm::StageService.{m}", streams[m], streams[m]) for m in STAGE_RPCS
    ]


@pytest.mark.parametrize(("declared", "server"), [(StageRPC, StageService), (ReachabilityRPC, ReachabilityService)])
def test_the_server_implements_every_declared_rpc_with_the_declared_handlers(declared, server):
    assert handlers(server) == handlers(declared)  # the stubs a client makes from wire/ reach the server's
    # each class collected its own list (an inherited one would hide a handler the server declares on its own)
    assert server.__dict__["_rpc_handlers"] is not declared.__dict__["_rpc_handlers"]
    for name in rpc_methods(declared):
        assert getattr(server, name) is not getattr(declared, name), f"{server.__name__} does not implement {name}"


# -------------------------------------------------------------------------------------------- codes


def test_error_codes_keep_their_strings_and_unknown_ones_read_as_internal():
    assert [code.value for code in ErrorCode] == [
        "bad_request",
        "busy",
        "banned",
        "unknown_microbatch",
        "wrong_stage",
        "internal",
        "downstream_failed",
        "duplicate",
        "too_late",
        "overflow",
    ]
    assert ErrorCode.of_reply("too_late") is ErrorCode.TOO_LATE
    for garbage in ("newer_code", None, 3, ["busy"], {"a": 1}, b"busy"):
        assert ErrorCode.of_reply(garbage) is ErrorCode.INTERNAL


def test_each_exception_reaches_the_caller_as_one_code_and_anything_else_as_internal():
    """What the map must do, not a copy of it: distinct exceptions give distinct codes (BUSY excepted: a stopped
    stage answers as a busy one), a subclass answers with its parent's code, every code but BANNED and INTERNAL
    (answered before or outside any request's work) is some exception's, and the caller reads back the code that
    the serving peer meant."""
    codes = [code for cls, code in EXCEPTION_CODES.items() if code is not ErrorCode.BUSY]
    assert len(set(codes)) == len(codes)
    assert set(ErrorCode) - set(EXCEPTION_CODES.values()) == {ErrorCode.BANNED, ErrorCode.INTERNAL}
    for cls, code in EXCEPTION_CODES.items():
        assert code_of(type("Derived", (cls,), {})("x")) is code, cls  # most derived first, then its bases
        with pytest.raises(RemoteStageError) as caught:
            decode_reply(make_error_reply(str(cls("why")), code_of(cls("why"))), LIMIT)
        assert caught.value.code is code, cls
    assert code_of(RuntimeError("a bug")) is ErrorCode.INTERNAL
    assert code_of(RemoteStageError("another peer's", ErrorCode.BUSY)) is ErrorCode.INTERNAL


def test_an_error_reply_carries_its_code_as_a_plain_string_and_the_caller_gets_it_back():
    reply = make_error_reply("x" * 5000, ErrorCode.WRONG_STAGE)
    assert msgpack.unpackb(reply.metadata) == {"error": "x" * 2000, "code": "wrong_stage"}
    with pytest.raises(RemoteStageError) as caught:
        decode_reply(reply, LIMIT)
    assert caught.value.code is ErrorCode.WRONG_STAGE and caught.value.code == "wrong_stage"


# --------------------------------------------------------------------------------------------- hops


def test_hop_timings_go_back_as_plain_lists_and_read_the_same():
    later = [HopTiming("peer-b", 0.25, 0.5, (1.0, -2.0)), HopTiming("peer-c", 0.125, 0.125)]
    here = HopTiming("peer-a", 0.1234567, 0.05, (0.5,) * 16)  # a total below the compute is raised to it
    hops = encode_hops(here, later)
    assert hops == [
        ["peer-a", 0.123457, 0.123457, [0.5] * 16],
        ["peer-b", 0.25, 0.5, [1.0, -2.0]],
        ["peer-c", 0.125, 0.125, []],
    ]
    assert encode_hops(HopTiming("peer-a", 1.0, 2.0), []) == [["peer-a", 1.0, 2.0]]  # no print: three fields
    decoded = decode_hops(make_reply([], hops=hops), most=3)
    assert decoded == [HopTiming("peer-a", 0.123457, 0.123457, (0.5,) * 16), *later]
    assert decode_hops(make_reply([], hops=hops), most=2) == []  # more hops than stages: malformed, ignored


# ------------------------------------------------------------------------------------ the request path


def test_the_request_path_answers_each_failure_with_its_code_and_frees_the_slot():
    manifest = manifest_from_dict(tiny_manifest_dict())
    worker = StageWorker(StageCompute(manifest, 1, build_stage(manifest, 1), torch.device("cpu")))
    admission = Admission(manifest, "me")
    state = PeerState.ONLINE
    path = RequestPath(admission, worker, lambda: state)

    def failing(error: Exception):
        def work(compute: StageCompute):
            assert admission.pending == 1  # the caller's slot is held while its work runs
            raise error

        return work

    async def main() -> None:
        nonlocal state
        assert await path.run("forward", "peer", lambda compute: compute.stage) == 1
        for error, code in [
            (WrongStageError("moved"), "wrong_stage"),
            (TooLateError("late"), "too_late"),
            (BadRequestError("nonsense"), "bad_request"),
            (ZeroDivisionError("a bug"), "internal"),
        ]:
            reply = await path.run("train", "peer", failing(error))
            meta = msgpack.unpackb(reply.metadata)
            assert meta["code"] == code and admission.pending == 0
            assert str(error) in meta["error"]
        assert admission.bad_requests == 1  # only the bad request counts against its sender
        assert path.errors == {code: 1 for code in ("wrong_stage", "too_late", "bad_request", "internal")}
        state = PeerState.OFFLINE
        refusal = msgpack.unpackb(path.refusal("peer").metadata)
        assert refusal["code"] == "busy"

    try:
        asyncio.run(main())
    finally:
        asyncio.run(worker.finish(timeout=5.0))
