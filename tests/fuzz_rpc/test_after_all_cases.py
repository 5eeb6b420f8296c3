"""After every case: the peers serve and are unchanged; then the two cases that may leave a peer's memory
high or a peer dead."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from fuzzing import CASES, FIRST, FORWARD_TIMEOUT, LAST, MANIFEST
from swarm.wire import messages, validation

from .clients import stage_outcome
from .fuzzed_swarm import RSS_GROWTH_LIMIT, Swarm, group_rss, memory_report
from .hostile import nested_tuples
from .messages import BATCH, FORWARD, FORWARD_STREAM, LENGTH, WIDTH, hidden, make_request, tokens

integration = pytest.mark.integration


@integration
def test_after_all_cases_the_peers_serve_and_are_unchanged(swarm: Swarm):
    """Runs after the other process tests (file order): a fresh identity is served, the parameters are exactly
    as before, the memory stayed bounded."""
    p2p = swarm.clients.fresh()
    for stage, peer in swarm.peers.items():
        reply = swarm.served(stage, p2p)
        outputs = messages.decode_reply(reply, validation.max_request_elements(MANIFEST))
        assert [tuple(t.shape) for t in outputs] == ([(BATCH, LENGTH, WIDTH)] if stage == FIRST else [()])
        state = swarm.state(stage, p2p)
        assert [name for name, _ in state] == [name for name, _ in swarm.states[stage]]
        for (name, after), (_, before) in zip(state, swarm.states[stage]):
            assert torch.equal(after, before), f"stage {stage}: {name} changed"
        growth = group_rss(peer.pgid) - swarm.rss[stage]
        report = memory_report(peer.pgid)
        print(f"stage {stage}: memory grew by {growth / 2**20:.1f} MiB over all cases; now (MiB): {report}")
        assert growth < RSS_GROWTH_LIMIT, f"stage {stage}: memory grew by {growth / 2**20:.0f} MiB over all cases"
    swarm.clients.retire(p2p)
    swarm.alive()


# The last two leave a peer's memory high or the peer dead: they come after the check above.


@integration
def test_a_frame_that_declares_a_huge_size_is_not_buffered(swarm: Swarm):
    """A stream message's header declares its length; the peer must not buffer far more than any request."""
    clients = swarm.clients
    p2p = clients.identity(FIRST)
    pgid = swarm.peers[FIRST].pgid
    before = group_rss(pgid)

    async def send() -> tuple[int, bool, int]:
        """(bytes sent, whether the peer closed the stream, the peer's memory then)."""
        _, _, writer = await p2p.call_binary_stream_handler(clients.targets[FIRST], FORWARD_STREAM)
        sent, refused, deadline = 0, False, time.monotonic() + FORWARD_TIMEOUT - 0.5
        try:
            writer.write(P2P.MESSAGE_MARKER + (2**40).to_bytes(8, "big"))
            while sent < 192 * 2**20 and time.monotonic() < deadline:
                writer.write(bytes(2**20))
                await writer.drain()
                sent += 2**20
            await asyncio.sleep(0.3)  # let the peer take in what is on its way
        except ConnectionError:  # the peer closed the stream: it refused the frame
            refused = True
        rss = group_rss(pgid)
        writer.close()
        return sent, refused, rss

    sent, refused, rss = clients.run(send(), 30)
    CASES["rpc_forward_stream: a huge frame"] += 1
    growth = rss - before
    swarm.alive()
    # a peer that buffered the frame grows by what was sent, however much a loaded machine managed to send
    assert refused or sent >= 16 * 2**20, f"only {sent / 2**20:.0f} MiB could be sent: too little to tell"
    limit = 64 * 2**20 if refused else min(sent / 2, 64 * 2**20)
    assert growth < limit, (
        f"{sent / 2**20:.0f} MiB sent in one frame: the peer's memory grew by {growth / 2**20:.0f} MiB"
    )


@integration
def test_deeply_nested_msgpack_metadata_gets_an_error_reply(swarm: Swarm):
    clients, peer = swarm.clients, swarm.peers[LAST]
    data = make_request([hidden(), tokens()], nested_tuples(1000)).SerializeToString()
    CASES["rpc_forward: metadata of tuples nested 1000 deep"] += 1
    sockets = peer.socket_files()  # a crashed peer cannot remove its socket files
    try:
        raw = clients.run(clients.identity(LAST)._client.call_unary_handler(clients.targets[LAST], FORWARD, data), 3)
    except Exception:  # no reply (AssertionError: none in time)
        raw = None
    time.sleep(0.5)
    if peer.process.poll() is not None:
        peer.kill(sockets)  # its DHT process and p2pd daemon too
    swarm.alive()
    assert raw is not None and stage_outcome(runtime_pb2.ExpertResponse.FromString(raw)) == "bad_request"
