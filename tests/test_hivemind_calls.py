"""hivemind's unary calls when callers give up on them as their replies arrive (swarm/dht/hivemind_calls.py)."""

from __future__ import annotations

import asyncio
import random

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

import swarm  # noqa: F401 (installs the fix, as any use of the library does)

ROUNDS, CALLS = 40, 30  # without the fix the reader died within the first two rounds in every try


async def _cancel_calls_as_replies_arrive() -> tuple[bool, bool]:
    """(the reader of the caller's daemon connection is alive, a later call got its reply)."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in await server.get_visible_maddrs()]
    )
    rng = random.Random(0)

    async def reply_soon(request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        await asyncio.sleep(rng.uniform(0, 0.003))
        return runtime_pb2.ExpertResponse()

    def call() -> asyncio.Future:
        return asyncio.ensure_future(
            client.call_protobuf_handler(
                server.peer_id, "echo", runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse
            )
        )

    try:
        await server.add_protobuf_handler("echo", reply_soon, runtime_pb2.ExpertRequest)
        reader = client._client.control._read_task
        loop = asyncio.get_running_loop()
        for _ in range(ROUNDS):
            calls = [call() for _ in range(CALLS)]
            for task in calls:  # cancelled from timers: some land between a reply's arrival and its caller's turn
                loop.call_later(rng.uniform(0.001, 0.01), task.cancel)
            await asyncio.gather(*calls, return_exceptions=True)
            if reader.done():
                break
        try:
            await asyncio.wait_for(call(), 10)
            answered = True
        except TimeoutError:
            answered = False
        return not reader.done(), answered
    finally:
        await client.shutdown()
        await server.shutdown()


def test_calls_cancelled_as_their_replies_arrive_leave_later_calls_working():
    """With hivemind's plain dict of pending calls, the reader dies of InvalidStateError and the last call hangs."""
    reader_alive, answered = asyncio.run(_cancel_calls_as_replies_arrive())
    assert reader_alive, "the task reading replies from the daemon died"
    assert answered, "a call after the cancelled ones got no reply"
