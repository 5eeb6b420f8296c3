"""The control handlers: state downloads, probes, the manifest, the tokenizer and reachability checks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.proto import runtime_pb2

from fuzzing import CASES, FIRST, LAST, MANIFEST
from swarm.wire import messages

from .clients import (
    STREAM_WAIT,
    check_manifest_reply,
    check_reachability_reply,
    open_stream,
    stage_outcome,
    unparsed_or_reply,
)
from .fuzzed_swarm import Swarm
from .hostile import metadata_garbage
from .messages import (
    CHECK,
    CHECKPOINT,
    DOWNLOAD_STATE,
    MANIFEST_RPC,
    PROBE,
    TOKENIZER_RPC,
    frame,
    packb,
    raw_tensor,
    state_request,
)

integration = pytest.mark.integration


@integration
def test_bad_state_downloads_probes_and_manifest_requests(swarm: Swarm):
    clients = swarm.clients
    for stage in (FIRST, LAST):
        for label, raw in metadata_garbage()[:12]:
            chunks = [frame(runtime_pb2.ExpertRequest(metadata=raw).SerializeToString())]
            clients.stream(stage, DOWNLOAD_STATE, chunks, f"rpc_download_state: metadata {label}", {"bad_request"})
        for value in (None, 1 - stage, -1, 2, "0", 0.0, True, [stage], 2**64 - 1):
            chunks = [state_request(stage=value)]
            expected = {"ok", "bad_request"} if value == stage else {"bad_request"}  # 0.0 == 0, True == 1
            clients.stream(stage, DOWNLOAD_STATE, chunks, f"rpc_download_state: stage {value!r}", expected)
        clients.stream(stage, DOWNLOAD_STATE, [state_request(stage=stage)], "rpc_download_state: valid", {"ok"})
        # a checkpoint of any stage, from any peer (it keeps them for stages it no longer serves too)
        for label, raw in metadata_garbage()[:8]:
            chunks = [frame(runtime_pb2.ExpertRequest(metadata=raw).SerializeToString())]
            clients.stream(stage, CHECKPOINT, chunks, f"rpc_checkpoint: metadata {label}", {"bad_request"})
        for value in (None, -1, 2, "0", 0.0, True, [stage], 2**64 - 1):
            chunks = [state_request(stage=value)]
            clients.stream(stage, CHECKPOINT, chunks, f"rpc_checkpoint: stage {value!r}", {"bad_request"})
        for value in (0, 1):  # none kept yet (wrong_stage), or one saved meanwhile
            chunks = [state_request(stage=value)]
            clients.stream(stage, CHECKPOINT, chunks, f"rpc_checkpoint: stage {value}", {"ok", "wrong_stage"})
        for _, raw in metadata_garbage()[:6]:
            data = runtime_pb2.ExpertRequest(metadata=raw).SerializeToString()
            check_manifest_reply(unparsed_or_reply(clients, stage, MANIFEST_RPC, data))
        # a probe answers with up to PROBE_BYTES of zeros, whatever payload comes with it
        for value in (-1, 2**63 - 1, 2**64 - 1, "10", 1.5, None, [], {}, 10**9):
            data = messages.make_control_request(MANIFEST, reply_bytes=value).SerializeToString()
            clients.unary(stage, PROBE, data, f"rpc_probe: reply_bytes {value!r}", {"bad_request"})
        for value in (0, 1, 4096, True):
            data = messages.make_control_request(MANIFEST, reply_bytes=value).SerializeToString()
            clients.unary(stage, PROBE, data, f"rpc_probe: reply_bytes {value!r}", {"ok"})
        # the tokenizer: hostile offsets and garbage are refused (this swarm's vocabulary is bytes: no file at all)
        for value in (-1, 2**64 - 1, "0", 1.5, None, [], 0):
            data = messages.make_control_request(MANIFEST, offset=value).SerializeToString()
            clients.unary(stage, TOKENIZER_RPC, data, f"rpc_tokenizer: offset {value!r}", {"bad_request"})
        for label, raw in metadata_garbage()[:6]:
            data = runtime_pb2.ExpertRequest(metadata=raw).SerializeToString()
            clients.unary(stage, TOKENIZER_RPC, data, f"rpc_tokenizer: metadata {label}", {"bad_request"})
        payload = messages.make_control_request(MANIFEST)
        payload.tensors.extend([raw_tensor("evil", [2**32 - 1], bytes(3 * 2**20))] + [runtime_pb2.Tensor()] * 1000)
        clients.unary(stage, PROBE, payload.SerializeToString(), "rpc_probe: a 3 MB garbage payload", {"ok"})
    # download_state's request is one message in a stream: a second one, or none, is refused
    for label, chunks in (("two requests", [state_request(stage=0)] * 2), ("no request", [])):
        result = clients.run(
            open_stream(
                clients.identity(FIRST), clients.targets[FIRST], DOWNLOAD_STATE, chunks, "message", STREAM_WAIT
            ),
            STREAM_WAIT + 5,
        )
        assert [stage_outcome(reply) for reply in result.replies] == ["bad_request"], (label, result)
        CASES["rpc_download_state"] += 1
    swarm.alive()


@integration
def test_hostile_reachability_checks(swarm: Swarm):
    """rpc_check dials only the asker, at addresses on the IP it connects from: whatever it is told, it answers a
    verdict, and dials nobody else."""
    clients = swarm.clients
    p2p = clients.identity(FIRST)  # checks are not held against anyone
    own = [str(a) for a in clients.run(p2p.get_visible_maddrs())]
    claims: list[tuple[str, Any]] = [
        ("no maddrs", {}),
        ("maddrs not a list", {"maddrs": "/ip4/127.0.0.1/tcp/1"}),
        ("maddrs a dictionary", {"maddrs": {"a": 1}}),
        ("non-strings", {"maddrs": [1, None, b"x", [], {}]}),
        ("10000 addresses", {"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 10_000}),
        ("a 100 kB address", {"maddrs": ["/ip4/127.0.0.1/tcp/1/" + "x" * 100_000]}),
        (
            "invalid multiaddrs",
            {"maddrs": ["", "/", "/ip4/999.0.0.1/tcp/1", "/garbage", "\x00", "/ip4/127.0.0.1/tcp/99999"]},
        ),
        ("relay circuits", {"maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmRelay/p2p-circuit"]}),
        ("other hosts", {"maddrs": ["/ip4/10.0.0.1/tcp/1", "/ip6/::1/tcp/1", "/dns4/example.org/tcp/1"]}),
        ("another peer's id", {"maddrs": [f"/ip4/127.0.0.1/tcp/1/p2p/{swarm.ids[LAST]}"]}),
        ("a closed port", {"maddrs": ["/ip4/127.0.0.1/tcp/1"]}),
    ]
    for label, meta in claims:
        data = runtime_pb2.ExpertRequest(metadata=packb(meta)).SerializeToString()
        raw = clients.run(p2p._client.call_unary_handler(clients.targets[FIRST], CHECK, data), 30)
        verdict = check_reachability_reply(runtime_pb2.ExpertResponse.FromString(raw))
        assert verdict is not None and verdict["reachable"] is not True, (label, verdict)
    for _, raw_meta in metadata_garbage()[:12]:
        data = runtime_pb2.ExpertRequest(metadata=raw_meta).SerializeToString()
        check_reachability_reply(unparsed_or_reply(clients, FIRST, CHECK, data))
    # its own addresses, several checks at once: each is dialed back or told the helper is busy (a verdict of
    # False or None is possible too on a loaded machine: the probe daemon or the dial may be slow)
    data = runtime_pb2.ExpertRequest(metadata=packb({"maddrs": own})).SerializeToString()

    async def at_once() -> list[bytes]:
        return await asyncio.gather(
            *[p2p._client.call_unary_handler(clients.targets[LAST], CHECK, data) for _ in range(5)]
        )

    verdicts = [
        check_reachability_reply(runtime_pb2.ExpertResponse.FromString(raw)) for raw in clients.run(at_once(), 30)
    ]
    assert all(v is not None and (v["reachable"] is not None or v["error"]) for v in verdicts), verdicts
    swarm.alive()
