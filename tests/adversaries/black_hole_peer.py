"""A swarm-peer that announces whatever throughput --throughput says (give it a huge one) and answers no stage call:
every forward, backward or forwarded microbatch sent to it waits until the caller gives up. Everything else
(announcements, averaging, probes) is an ordinary peer's.

Run as `python -m tests.adversaries.black_hole_peer SWARM-PEER-FLAGS...`.
"""

from __future__ import annotations

import asyncio
import sys

from peers.swarm_peer import main
from swarm.server import service


async def _never_answer(self, kind, request, caller):
    await asyncio.sleep(3600)


service.StageService._handle_remote = _never_answer

if __name__ == "__main__":
    sys.exit(main())
