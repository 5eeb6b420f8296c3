"""One libp2p call over an emulated home link: how long a request of N bytes takes, alone and several at once.

    python -m benchmarks.link_calls [--link 20mbit/25ms]

Two hivemind P2P nodes, each behind its own emulated link (swarm/local/emulated_links.py), so a path crosses two links
(one-way delay: both ends' delays; bandwidth: the smaller). The second node calls a protobuf handler of the first
with requests of several sizes, one at a time, then four at once. Prints one JSON line: per size the measured
milliseconds and the ideal (round trip + size over the link's rate), and their ratio, so that the cost of libp2p's
per-stream flow control over a long path shows (a stream may have only so many bytes in flight before the
receiver's window update comes back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.local.emulated_links import EmulatedLinks, LinkSpec

SIZES = [100, 65536, 262144, 1048576]  # a unary call carries at most 4 MiB
CONCURRENT = 4


async def measure(spec: LinkSpec) -> dict:
    limits = [bits / 8 for bits in (spec.up_bits, spec.down_bits) if bits is not None]
    rate = min(limits) if limits else None  # bytes/s of a request's path: the client's up, the server's down
    round_trip = 4 * spec.delay  # there and back, across both ends' links
    with EmulatedLinks(lifetime=600) as links:
        flags = {name: links.peer_flags(name, spec) for name in ("server", "client")}
        server = await P2P.create(host_maddrs=[flags["server"][1]], announce_maddrs=[flags["server"][3]])
        client = await P2P.create(
            host_maddrs=[flags["client"][1]],
            announce_maddrs=[flags["client"][3]],
            initial_peers=[f"{flags['server'][3]}/p2p/{server.peer_id}"],
        )

        async def handler(request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
            return runtime_pb2.ExpertResponse(metadata=b"ok")

        await server.add_protobuf_handler("echo", handler, runtime_pb2.ExpertRequest)

        async def call(size: int) -> None:
            request = runtime_pb2.ExpertRequest(metadata=b"x" * size)
            await client.call_protobuf_handler(server.peer_id, "echo", request, runtime_pb2.ExpertResponse)

        await call(100)  # opens the connection
        result: dict = {"link": spec.describe(), "round_trip_ms": round(round_trip * 1000)}
        for size in SIZES:
            begin = time.monotonic()
            await call(size)
            took = time.monotonic() - begin
            ideal = round_trip + (size / rate if rate else 0.0)
            result[f"one_{size}_ms"] = round(took * 1000, 1)
            result[f"one_{size}_ideal_ms"] = round(ideal * 1000, 1)
            result[f"one_{size}_over_ideal"] = round(took / ideal, 2)
        size = 1048576
        begin = time.monotonic()
        await asyncio.gather(*[call(size // CONCURRENT) for _ in range(CONCURRENT)])
        took = time.monotonic() - begin
        ideal = round_trip + (size / rate if rate else 0.0)
        result[f"{CONCURRENT}_at_once_{size}_ms"] = round(took * 1000, 1)
        result[f"{CONCURRENT}_at_once_{size}_over_ideal"] = round(took / ideal, 2)
        await client.shutdown()
        await server.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="20mbit/25ms", help="each node's link (default 20mbit/25ms)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(LinkSpec.parse(args.link)))))


if __name__ == "__main__":
    main()
