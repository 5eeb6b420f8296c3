"""A swarm-peer whose clock is off: time.time() runs $SKEWED_CLOCK_SECONDS ahead (negative: behind), as on a machine without
NTP. Everything that reads the wall clock in Python sees it: hivemind's DHT times (its records' expirations and its
pings' answers) and this peer's signed records, in this process and in the DHT process it forks. Its p2p daemon
(Go) keeps the real clock, as it would: it does not read record times.

Run as `SKEWED_CLOCK_SECONDS=3600 python -m tests.adversaries.skewed_clock_peer SWARM-PEER-FLAGS...`.
"""

from __future__ import annotations

import os
import sys
import time

skew = float(os.environ["SKEWED_CLOCK_SECONDS"])
real_time = time.time
time.time = lambda: real_time() + skew

from peers.swarm_peer import main  # noqa: E402  (after the clock is off: modules that copy time.time see it)

if __name__ == "__main__":
    sys.exit(main())
