"""A flood of reachability checks at one peer, from one libp2p identity: CONCURRENCY checks in flight at all times
for SECONDS, each claiming this node's own addresses (so that a check would dial it back). It prints "under way"
once the first answer came back (the flood has reached the peer), then one JSON line of what the answers were.

Run as `python -m tests.adversaries.reachability_flood TARGET-MADDR SECONDS CONCURRENCY`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.wire.messages import pack, unpack
from swarm.wire.rpc import ReachabilityRPC


async def flood(target: str, seconds: float, concurrency: int) -> dict:
    node = await P2P.create(initial_peers=[target], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    answers: Counter[str] = Counter()
    try:
        stub = ReachabilityRPC.stub(node, target.rsplit("/p2p/", 1)[1])
        own = [str(a) for a in await node.get_visible_maddrs()]
        request = runtime_pb2.ExpertRequest(metadata=pack({"maddrs": own}))
        deadline = time.monotonic() + seconds

        async def one_after_another() -> None:
            while time.monotonic() < deadline:
                try:
                    reply = unpack((await asyncio.wait_for(stub.rpc_check(request, timeout=10), 10)).metadata)
                    key = {True: "reachable", False: "unreachable", None: "refused"}[reply.get("reachable")]
                except Exception as e:  # counted: a flooded peer may fail a call, but must not go down
                    key = f"failed: {type(e).__name__}"
                answers[key] += 1
                if sum(answers.values()) == 1:
                    print("under way", flush=True)

        await asyncio.gather(*[one_after_another() for _ in range(concurrency)])
    finally:
        await node.shutdown()
    return dict(answers)


if __name__ == "__main__":
    maddr, duration, parallel = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(asyncio.run(flood(maddr, duration, parallel))), flush=True)
