"""Checked-work benchmark: what the trainers' checks cost, whether they ever accuse an honest peer, and how fast they
catch a dishonest one.

    python -m benchmarks.checks [--seconds 90] [--check-fraction 0.05]

A swarm of the tiny test model on loopback: each of its two stages served by three peers, and a trainer-only peer
that trains through them (so it can be restarted with other flags while the stage peers stay). Phases:

1. the trainer without checks (`--check-fraction 0`), `--seconds`: its samples per second;
2. with checks (`--check-fraction`), `--seconds`, all peers honest: samples per second (the checks' cost),
   checks made, disagreements, and honest peers convicted (false positives);
3. a dishonest stage-0 peer joins (tests/adversaries/dishonest_peer.py: shuffled activations): seconds from its
   start until the trainer convicts it, and the checks and disagreements meanwhile;
4. then a stage-1 peer that sends back wrong gradients joins (tests/adversaries/wrong_gradients_peer.py: true
   losses, shuffled gradients): the same figures.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from swarm.local import processes
from swarm.local.fast_swarm import fast_test_swarm_dict

DETECTION_TIMEOUT = 300.0


def trainer_phase(flags: list[str], log: Path, cache: Path, seconds: float, started: list) -> dict:
    trainer = processes.start_peer([*flags, "--status-every", "1"], log, cache_dir=cache)
    started.append(trainer)
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > 0, timeout=120, what="training")
    time.sleep(5)  # past the first microbatches' start-up
    begin = trainer.status_lines()[-1]
    time.sleep(seconds)
    end = trainer.status_lines()[-1]
    processes.stop_peers([trainer], grace=10.0)
    return {
        "samples_per_second": round((end["trainer_samples"] - begin["trainer_samples"]) / seconds, 2),
        "checks": end["trainer_checks"] - begin["trainer_checks"],
        "disagreements": end["trainer_check_disagreements"] - begin["trainer_check_disagreements"],
        "convicted": end["trainer_convicted"],
        "loss": end["trainer_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--check-fraction", type=float, default=0.05)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swarm-checks-"))
    cache = work / "cache"
    raw = fast_test_swarm_dict()
    (work / "first.json").write_text(json.dumps(raw))
    started: list[processes.PeerProcess] = []
    try:
        first = processes.start_peer(
            [*processes.loopback_args(work / "first.json", 0, trainer=False)], work / "stage0-a.log", cache_dir=cache
        )
        started.append(first)
        raw["initial_peers"] = [first.maddr()]
        path = work / "swarm.json"
        path.write_text(json.dumps(raw))
        for name, stage in (("stage0-b", 0), ("stage0-c", 0), ("stage1-a", 1), ("stage1-b", 1), ("stage1-c", 1)):
            peer = processes.start_peer(
                processes.loopback_args(path, stage, trainer=False), work / f"{name}.log", cache
            )
            started.append(peer)
        honest_ids = [p.peer_id() for p in started]
        for peer in started:
            peer.wait_for(r"serving stage \d", timeout=120)
        trainer_flags = [*processes.loopback_args(path), "--trainer-only"]
        unchecked = trainer_phase(
            [*trainer_flags, "--check-fraction", "0"], work / "t0.log", cache, args.seconds, started
        )
        print(json.dumps({"unchecked": unchecked}), file=sys.stderr, flush=True)
        checking = [*trainer_flags, "--check-fraction", str(args.check_fraction)]
        checked = trainer_phase(checking, work / "t1.log", cache, args.seconds, started)
        print(json.dumps({"checked": checked}), file=sys.stderr, flush=True)

        trainer = processes.start_peer([*checking, "--status-every", "1"], work / "t2.log", cache_dir=cache)
        started.append(trainer)
        trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > 0, timeout=120, what="training")
        detection = {}
        for kind, stage, module in (
            ("outputs", 0, "tests.adversaries.dishonest_peer"),
            ("gradients", 1, "tests.adversaries.wrong_gradients_peer"),
        ):
            before = trainer.status_lines()[-1]
            joined = time.monotonic()
            liar = processes.start_peer(
                processes.loopback_args(path, stage, trainer=False), work / f"liar-{kind}.log", cache, module=module
            )
            started.append(liar)
            liar_id = liar.peer_id()
            liar.wait_for(r"serving stage \d", timeout=120)
            serving = time.monotonic()
            line = trainer.wait_for_json(
                lambda line: liar_id in line.get("trainer_convicted", []),  # noqa: B023 (awaited here)
                timeout=DETECTION_TIMEOUT,
                what="conviction",
            )
            convicted = time.monotonic()
            detection[kind] = {
                "seconds_from_start": round(convicted - joined, 1),
                "seconds_from_serving": round(convicted - serving, 1),
                "checks": line["trainer_checks"] - before["trainer_checks"],
                "disagreements": line["trainer_check_disagreements"] - before["trainer_check_disagreements"],
                "honest_convicted": [p for p in line["trainer_convicted"] if p in honest_ids],
            }
        cost = 1 - checked["samples_per_second"] / max(unchecked["samples_per_second"], 1e-9)
        print(
            json.dumps(
                {
                    "check_fraction": args.check_fraction,
                    "unchecked": unchecked,
                    "checked": checked,
                    "throughput_cost": round(cost, 3),
                    "false_convictions": [p for p in checked["convicted"] if p in honest_ids],
                    "detection": detection,
                }
            )
        )
    finally:
        processes.stop_peers(started, grace=10.0)


if __name__ == "__main__":
    main()
