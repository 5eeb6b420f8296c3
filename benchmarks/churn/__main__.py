"""Churn benchmark: does a swarm keep training, and keep its progress, while its peers die, restart and stall?

    python -m benchmarks.churn [--samples 24000] [--faults 6] [--seed 0] [--stages 3] [--replicas 2]
                               [--trainers 2] [--quick] [--runs clean,faults] [--keep-logs]

A local swarm on loopback: `--stages` x `--replicas` stage peers (`swarm-peer --stage S --no-trainer --identity
FILE --host-maddrs /ip4/127.0.0.1/tcp/PORT --checkpoint-dir DIR --checkpoint-every 10 --threads 1 --json`), each
in its own process group, and `--trainers` Trainers in this process, which timestamp every microbatch they
finish. Every peer's identity and port are chosen before it starts, so that the manifest's initial peers list
every peer's full address: a restarted peer (the first, bootstrap, one too) rejoins through the others, with its
old id and address. The model is a tiny GPT, one layer per stage, with parameter averaging and 5 s timeouts.

Two runs with the same seeds and the same number of samples: "clean" (no faults) and "faults", where events are
injected when the trainers reach random points of the run (seeded, as are the kinds, targets and delays): a kill
of the bootstrap peer (SIGKILL of the peer's whole group: the peer, its DHT process and its p2pd daemon, as if
the machine died; then a restart after a random delay with the same identity, port, stage and checkpoint
folder); a stall (SIGSTOP of a peer's group for some seconds, then SIGCONT); a double kill (both replicas of one
stage, at overlapping times: the stage must come back from a checkpoint); then kills and stalls of random peers.
An event waits until its targets have served again for a checkpoint interval after earlier ones; otherwise
events overlap as they fall.

Prints ONE JSON line (progress goes to stderr): the faults injected (by kind; bootstrap kills counted apart), and
per run its wall time, samples, the longest time without a finished microbatch (across all trainers), the
microbatches lost (Trainer.failed_microbatches), the held-out loss of the final model (every live peer's state
downloaded; the mean over all combinations of one replica per stage), then their relative difference. For the
run with faults also: every event with its times, and for each restart where the peer took its stage's state
from (the state_taken event it prints with --json, swarm/events.py), how long until trainers sent it work again, and whether it was behind; the stage outages (no
running peer at all); the trainers' bans of peers; the reads of the stages' announcements (through the trainers'
DHT node, once a second) that missed a peer which was serving; and per stage whether progress was lost.

A restart loses progress if it started afresh (its event says so) after the stage had trained, or if the state it
loaded is behind the best one it could have had (in the peers' own order: averaging round, then optimizer steps)
by more optimizer steps than one peer of the stage made within a checkpoint interval plus two announce periods
(measured in the run: the "allowance"). The best state is the most advanced replica's that was serving when the
peer chose (its announcement read before then), else, with no replica up, the peer's own last announcement
before the kill, which its checkpoint may trail by up to the allowance. The largest drop is reported per stage.
With --keep-logs the run's folder keeps every peer's log per start, trainers.log (the trainers' INFO log: bans and
their reasons; the trainers' routers count the bans) and announcements.jsonl (every announcement read).

Goals (stated here, not tuned for; the JSON says whether each was met):
  - no stall longer than the configured timeouts (the larger of forward and backward) plus 5 seconds, not
    counting the time during which some stage had no running peer at all (the double kill, until a peer of
    that stage serves again);
  - the final held-out loss within 5% of the fault-free run's;
  - no stage's progress lost while one of its peers lives or a checkpoint of it exists.
"""

# This file runs the benchmark; its parts: peers.py (settings, the stage peers as processes), swarm.py (a run's
# swarm, the announcements read, the faults planned and injected), training.py (the trainers, the final model's
# loss) and report.py (progress lost, the summary and its goals).

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.churn.peers import Settings, benchmark_manifest, settings_from_args, stop_all
from benchmarks.churn.report import peer_warnings, progress_lost, summarize
from benchmarks.churn.swarm import Swarm, plan_faults
from benchmarks.churn.training import capture_trainer_log, drive, release_trainer_log, stalls
from benchmarks.common import eval_batches, stop_on_sigterm
from peers import runtime
from swarm.client.trainer import Trainer
from swarm.dht import node
from swarm.local import processes
from swarm.manifests.manifest import Manifest

EVAL_BATCHES = 16


def run(name: str, workdir: Path, settings: Settings, manifest: Manifest, batches, with_faults: bool) -> dict:
    """One run (`name`: clean or faults) in its own folder of `workdir`: start the swarm, train (injecting the
    planned faults if `with_faults`), stop every peer; the run's figures."""
    folder = workdir / name
    folder.mkdir(parents=True)
    swarm = Swarm(folder, settings, manifest)
    events = plan_faults(swarm.peers, settings, random.Random(settings.seed)) if with_faults else []
    dht = None
    trainer_log = capture_trainer_log(folder / "trainers.log")
    try:
        swarm.say(f"{name}: starting {len(swarm.peers)} peers ({settings.stages} stages x {settings.replicas})")
        logging.getLogger(Trainer.__module__).info(f"the run began {time.monotonic() - swarm.began:.1f}s ago")
        swarm.start()
        swarm.say(f"{name}: every peer serves")
        dht = node.start_dht([p.maddr for p in swarm.peers], node.LOOPBACK)
        outcome = asyncio.run(drive(swarm, dht, events, batches))
    finally:
        stop_all(swarm.peers)
        if dht is not None:
            dht.shutdown()
        release_trainer_log(trainer_log)
    wall = time.monotonic() - swarm.began
    trainers = outcome["trainers"]
    finished = [t for trainer in trainers for t in trainer.finished]
    outages = swarm.outages()
    longest, at, longest_served = stalls(finished, outages)
    result = {
        "wall_s": round(wall, 1),
        "train_began_at_s": swarm.t(outcome["began"]),  # every time in a run counts from the run's start
        "train_s": round(outcome["train_seconds"], 1),
        "samples": sum(t.samples for t in trainers),
        "microbatches": sum(t.microbatches for t in trainers),
        "microbatches_lost": sum(t.failed_microbatches for t in trainers),
        "longest_stall_s": round(longest, 2),
        "longest_stall_at_s": swarm.t(at),
        "heldout_loss": round(outcome["heldout_loss"], 4),
        "heldout_loss_spread": round(outcome["heldout_loss_spread"], 4),
        "final_replicas": outcome["final_replicas"],  # peers per stage whose state was evaluated at the end
    }
    with open(folder / "announcements.jsonl", "w") as f:  # what the poller read, for a look at the DHT afterwards
        for when, ann in swarm.history:
            peer = next(p.name for p in swarm.peers if p.peer_id == ann.peer_id)
            record = {"t": swarm.t(when), "peer": peer, "expiration": ann.expiration, **ann.to_record()}
            f.write(json.dumps({k: v for k, v in record.items() if k != "maddrs"}) + "\n")
    result["trainer_bans"] = sum(t.router.bans for t in trainers)  # their reasons: trainers.log in the run's folder
    result["dht_reads"] = {
        "total": swarm.reads,
        "failed": swarm.failed_reads,
        "missing_a_serving_peer": len(swarm.misses),
    }
    if with_faults:
        result["longest_stall_outside_outages_s"] = round(longest_served, 2)
        result["stage_outages_s"] = [round(b - a, 1) for a, b in outages]
        result["progress_lost"] = progress_lost(swarm, events)
        events.sort(key=lambda e: math.inf if e.fired_at is None else e.fired_at)
        result["events"] = [
            {
                "kind": e.kind,
                **({"bootstrap": True} if e.bootstrap else {}),
                "at_share": round(e.at_share, 2),
                "fired_at_s": None if e.fired_at is None else swarm.t(e.fired_at),
                "targets": [{k: v for k, v in r.items() if k != "before"} for r in e.records],
            }
            for e in events
        ]
        result["peer_exits"] = {p.name: len(p.crashes) for p in swarm.peers if p.crashes}
        if swarm.misses:
            swarm.say(f"reads of the announcements that missed a serving peer (time, peer): {swarm.misses[:30]}")
        warnings = peer_warnings(swarm)
        result["peer_log_warnings"] = sum(warnings.values())
        for message, count in list(warnings.items())[:15]:
            print(f"  {count:5d} x {message}", file=sys.stderr)
    swarm.say(f"{name}: {json.dumps({k: v for k, v in result.items() if k not in ('events', 'progress_lost')})}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.churn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=None, help="samples per run (default 24000; quick: 4800)")
    parser.add_argument("--faults", type=int, default=None, help="fault events in the faults run (default 6; quick: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults' times, kinds and targets")
    parser.add_argument("--stages", type=int, default=None, help="stages (default 3; quick: 2)")
    parser.add_argument("--replicas", type=int, default=2, help="peers per stage (default 2)")
    parser.add_argument("--trainers", type=int, default=2, help="trainers in this process (default 2)")
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 2 stages, 4800 samples, a bootstrap kill and a stall"
    )
    parser.add_argument(
        "--after-faults",
        type=float,
        default=None,
        metavar="SECONDS",
        help="train past --samples until every fault has ended (restarted peers serve), then SECONDS more: a run "
        "as short as its faults allow (the samples then differ between runs)",
    )
    parser.add_argument(
        "--fork-peers",
        action="store_true",
        help="fork the peers from a process that imported them once (swarm/local/forkserver.py): starts and "
        "restarts without their 5 s of imports. For the tests, which check behaviours; the figures a volunteer "
        "would see are without it",
    )
    parser.add_argument("--runs", default="clean,faults", help="which runs, of clean,faults (default both)")
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the logs and print their folder (kept anyway if a goal is missed)",
    )
    args = parser.parse_args(argv)
    runs = set(args.runs.split(","))
    if not runs or not runs <= {"clean", "faults"}:
        parser.error("--runs must be clean, faults or clean,faults")
    if (args.stages is not None and args.stages < 1) or args.replicas < 1 or args.trainers < 1:
        parser.error("--stages, --replicas and --trainers must be at least 1")
    if args.samples is not None and args.samples < args.trainers:
        parser.error("--samples must be at least --trainers")
    if args.after_faults is not None and args.after_faults < 0:
        parser.error("--after-faults must not be negative")
    if args.faults is not None and args.faults < 0:
        parser.error("--faults must not be negative")
    args.runs = [r for r in ("clean", "faults") if r in runs]
    return args


def benchmark(args: argparse.Namespace, folder: Path | None = None) -> dict:
    """Both runs (in `folder`, default a new temporary one); the summary. Every process started is gone when it
    returns or raises. The logs are kept (and their folder printed) with --keep-logs, after an error, or when a
    goal was missed."""
    settings = settings_from_args(args)
    manifest = benchmark_manifest(settings.stages)
    batches = eval_batches(manifest, EVAL_BATCHES)
    workdir = Path(tempfile.mkdtemp(prefix="swarm-churn-", dir=folder))
    try:
        runs = {name: run(name, workdir, settings, manifest, batches, name == "faults") for name in args.runs}
    except BaseException:
        print(f"peer logs: {workdir}", file=sys.stderr)
        raise
    summary = summarize(settings, manifest, runs, workdir)
    if args.keep_logs or not all(summary["goals_met"].values()):
        print(f"peer logs: {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
        del summary["logs"]
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # a benchmark stopped with SIGTERM still stops its peers
    runtime.setup_logging("WARNING")
    torch.set_num_threads(1)  # the peers need the cores more than the trainers
    if args.fork_peers:
        processes.fork_peers_from_a_preloaded_process()
    print(json.dumps(benchmark(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
