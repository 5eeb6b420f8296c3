"""Start-up benchmark: how long a peer takes from its process start to serving, when it joins a swarm for the
first time and when it is restarted (SIGKILL, then the same identity, port and cache), and where the time goes.

    python -m benchmarks.startup [--restarts 3]

A swarm of the tiny test model on loopback: a first peer serves stage 0 and trains; a second joins stage 1 with
--identity (new: no cached throughput); it is then SIGKILLed and restarted `--restarts` times. For every start,
the seconds from the process start to each line it prints on the way (the first time each kind of line appears:
reachability verdict, DHT up, serving) are kept, and the total to "serving".
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import start_milestones
from swarm.local import processes
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.local.processes import free_ports

START_TIMEOUT = 120.0


def timed_start(args: list[str], log: Path, cache: Path) -> tuple[processes.PeerProcess, dict[str, float]]:
    begin = time.monotonic()
    peer = processes.start_peer(args, log, cache_dir=cache)
    seen: dict[str, float] = {}
    while "serving" not in seen:
        if time.monotonic() - begin > START_TIMEOUT or peer.poll() is not None:
            raise RuntimeError(f"the peer did not serve within {START_TIMEOUT:.0f}s: {peer.tail()}")
        start_milestones(peer.output(), seen, time.monotonic() - begin)
        time.sleep(0.05)
    return peer, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swarm-startup-"))
    cache = work / "cache"
    raw = fast_test_swarm_dict()
    (work / "first.json").write_text(json.dumps(raw))
    started: list[processes.PeerProcess] = []
    try:
        first, _ = timed_start(processes.loopback_args(work / "first.json", 0), work / "first.log", cache)
        started.append(first)
        raw["initial_peers"] = [first.maddr()]
        (work / "swarm.json").write_text(json.dumps(raw))
        port = free_ports(1)[0]
        flags = [*processes.loopback_args(work / "swarm.json", 1, trainer=False, port=port)]
        flags += ["--identity", str(work / "second.key"), "--checkpoint-dir", str(work / "checkpoints")]
        starts = []
        for attempt in range(args.restarts + 1):
            peer, seen = timed_start(flags, work / f"second{attempt}.log", cache)
            started.append(peer)
            starts.append({"kind": "new" if attempt == 0 else "restart", **seen})
            print(json.dumps(starts[-1]), file=sys.stderr, flush=True)
            time.sleep(3.0)  # let it serve and announce a while
            peer.kill()
            time.sleep(1.0)
        restarts = [s["serving"] for s in starts if s["kind"] == "restart"]
        print(
            json.dumps(
                {
                    "new_peer_to_serving_s": starts[0]["serving"],
                    "restart_to_serving_s": restarts,
                    "restart_to_serving_mean_s": round(sum(restarts) / max(len(restarts), 1), 2),
                    "starts": starts,
                }
            )
        )
    finally:
        processes.stop_peers(started, grace=10.0)


if __name__ == "__main__":
    main()
