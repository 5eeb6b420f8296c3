"""Benchmark: throughput-aware stage choice and rebalancing against a static and the optimal assignment.

A local swarm of peers of unequal speeds (emulated with --simulated-speed) over 4 stages, every peer also
training, run three ways:
  (a) the peers choose and change stages themselves, started slowest first, which makes the first choices bad;
  (b) static: peer k serves stage k mod 4;
  (c) the optimal assignment (swarm/balancing/optimum.py's optimal_assignment of the speeds), pinned.
Then, in (a), all peers of the most crowded stage but one are killed, and the time until the swarm's
throughput is back within 10% of its new optimum is measured.

Peer speeds are emulated with --simulated-speed: a speed-1 peer serves `--unit` samples/s. The model has 4
layers per stage, so that the embeddings (first stage) and the head (last stage) change a stage's cost by only
a few percent, and a peer's speed is about the same at every stage, as the speeds list assumes. The real
compute is at most ~15% of a peer's emulated time, so 8 peers (and their trainers) fit on 2 cores.

Prints one JSON line: samples/s of each run, a/c, b/c, stage moves, recovery seconds. Progress goes to stderr.

    python -m benchmarks.balance                      # speeds 1,1,1,1,2,2,4,4; takes about 8 minutes
    python -m benchmarks.balance --speeds 1,2,3,4,5,6 --unit 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from swarm.architectures.model import build_stage
from swarm.balancing.optimum import optimal_assignment
from swarm.dht import node
from swarm.local.processes import PeerProcess, start_local_peer, stop_peers
from swarm.manifests.validation import manifest_from_dict
from swarm.throughput import cached_compute_throughput

STAGES = 4
POLL = 2.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def manifest_dict(name: str, initial_peers: list[str], check_period: float, min_gain: float) -> dict:
    return {
        "name": name,
        "model": {"vocab_size": 256, "width": 96, "depth": 4 * STAGES, "heads": 2, "context_length": 64, "seed": 0},
        "stages": {"count": STAGES},
        "training": {
            "microbatch_size": 8,
            "microbatches_per_step": 2,
            "learning_rate": 0.002,
            "max_in_flight": 4,
            "timeouts": {"forward": 20, "backward": 30, "microbatch": 120},
        },
        "network": {"announce_period": 2.0},
        "balancing": {"check_period": check_period, "min_gain": min_gain},
        "initial_peers": initial_peers,
    }


class Run:
    """One swarm of peer processes, and what their JSON status lines say."""

    def __init__(self, name: str, raw: dict, logs: Path):
        self.name, self.logs = name, logs
        self.manifest_path = logs / f"{name}.json"
        self.manifest_path.write_text(json.dumps(raw))
        self.peers: list[PeerProcess] = []
        self.speeds: list[float] = []
        self.alive: list[bool] = []
        self.history: list[tuple[float, dict[int, int]]] = []  # (time, trainer samples per live peer)

    def start(self, speed: float, simulated_speed: float, stage: int | None) -> None:
        k = len(self.peers)
        extra = ["--simulated-speed", f"{simulated_speed:.6f}", "--status-every", "1"]
        self.peers.append(start_local_peer(self.manifest_path, stage, self.log_path(k), extra=extra))
        self.speeds.append(speed)
        self.alive.append(True)

    def log_path(self, k: int) -> Path:
        return self.logs / f"{self.name}-peer{k}.log"

    def status(self, k: int) -> dict:
        """The peer's latest JSON status line (not an event)."""
        lines = self.peers[k].status_lines()
        return lines[-1] if lines else {}

    def check_alive(self) -> None:
        for k, peer in enumerate(self.peers):
            if self.alive[k] and (code := peer.poll()) is not None:
                raise RuntimeError(f"{self.name}: peer {k} exited with {code}:\n{peer.tail()}")

    def serving(self) -> dict[int, int]:
        """Stage of each live peer that serves one."""
        return {k: s["stage"] for k in self.live() if "stage" in (s := self.status(k))}

    def live(self) -> list[int]:
        return [k for k, alive in enumerate(self.alive) if alive]

    def moves(self) -> int:
        return sum(self.status(k).get("moves", 0) for k in range(len(self.peers)))

    def poll(self) -> None:
        self.check_alive()
        self.history.append((time.monotonic(), {k: self.status(k).get("trainer_samples", 0) for k in self.live()}))

    def rate(self, seconds: float) -> float:
        """Samples per second trained by the live peers over the last `seconds`."""
        now, latest = self.history[-1]
        earlier = [(t, samples) for t, samples in self.history if t <= now - seconds]
        if not earlier:
            return 0.0
        then, before = earlier[-1]
        return sum(latest[k] - before[k] for k in latest if k in before) / (now - then)

    def stage_units(self) -> list[float]:
        totals = [0.0] * STAGES
        for k, stage in self.serving().items():
            totals[stage] += self.speeds[k]
        return totals

    def kill(self, k: int) -> None:
        """SIGKILL the peer's whole group (the peer, its DHT process, its p2pd daemon), as if its machine died."""
        self.peers[k].kill()
        self.alive[k] = False

    def stop(self) -> None:
        stop_peers(self.peers)


def wait_serving(run: Run, count: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while len(run.serving()) < count:
        run.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run.name}: only {len(run.serving())} of {count} peers serve after {timeout:.0f}s")
        time.sleep(1.0)


def measure(run: Run, seconds: float) -> float:
    end = time.monotonic() + seconds
    run.poll()
    while time.monotonic() < end:
        time.sleep(POLL)
        run.poll()
    return run.rate(seconds)


def pinned_run(name, raw, logs, speeds, simulated, stages, warmup, window) -> float:
    run = Run(name, raw, logs)
    try:
        for speed, sim, stage in zip(speeds, simulated, stages):
            run.start(speed, sim, stage)
            time.sleep(1.0)
        wait_serving(run, len(speeds))
        log(f"{name}: all peers serve {run.stage_units()} speed units per stage; warming up {warmup:.0f}s")
        measure(run, warmup)
        rate = measure(run, window)
        log(f"{name}: {rate:.1f} samples/s")
        return rate
    finally:
        run.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speeds", default="1,1,1,1,2,2,4,4", help="relative speeds of the peers")
    parser.add_argument("--unit", type=float, default=6.0, help="samples/s of a speed-1 peer (default: 6)")
    parser.add_argument("--check-period", type=float, default=10.0, help="mean seconds between balance checks")
    parser.add_argument("--min-gain", type=float, default=0.1)
    parser.add_argument("--stagger", type=float, default=4.0, help="seconds between peer starts in run (a)")
    parser.add_argument("--settle", type=float, default=150.0, help="longest wait for (a) to settle (seconds)")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--window", type=float, default=30.0, help="seconds over which throughput is measured")
    parser.add_argument("--recovery-timeout", type=float, default=180.0)
    args = parser.parse_args()
    speeds = sorted(float(s) for s in args.speeds.split(","))  # slowest first: the first choices are bad
    if len(speeds) < STAGES + 1:
        parser.error(f"--speeds: at least {STAGES + 1} peers are needed")

    logs = Path(tempfile.mkdtemp(prefix="swarm-balance-"))
    os.environ["SWARM_CACHE_DIR"] = str(logs / "cache")  # the peers read the reference measured here
    torch.set_num_threads(1)  # as the peers run
    check = manifest_from_dict(manifest_dict("reference", [], args.check_period, args.min_gain))
    reference = min(
        cached_compute_throughput(build_stage(check, s), check, s, torch.device("cpu"))[0] for s in range(STAGES)
    )
    simulated = [args.unit * speed / reference for speed in speeds]
    if max(simulated) > 0.5:
        parser.error(f"--unit {args.unit} is too fast for this machine (a stage runs {reference:.0f} samples/s)")
    optimal_stages, optimal_units = optimal_assignment(speeds, STAGES)
    log(f"reference {reference:.0f} samples/s per stage; speeds {speeds}; optimum {optimal_units} units; logs {logs}")

    sockets_before = node.daemon_sockets()
    dht = node.start_dht([], node.LOOPBACK)
    bootstrap = [str(a) for a in dht.get_visible_maddrs()]
    result: dict = {"speeds": speeds, "stages": STAGES, "unit_samples_per_second": args.unit}
    try:
        # (c) and (b) first: (c) tells what "within 10% of the new optimum" is in samples/s
        raw = manifest_dict("balance-c", bootstrap, args.check_period, args.min_gain)
        c_rate = pinned_run("optimal", raw, logs, speeds, simulated, optimal_stages, args.warmup, args.window)
        raw = manifest_dict("balance-b", bootstrap, args.check_period, args.min_gain)
        static = [k % STAGES for k in range(len(speeds))]
        b_rate = pinned_run("static", raw, logs, speeds, simulated, static, args.warmup, args.window)
        result.update(c_samples_per_second=round(c_rate, 2), b_samples_per_second=round(b_rate, 2))
        result.update(optimal_units=optimal_units, static_units=min(_units(speeds, static)))
        result.update(adaptive(args, logs, bootstrap, speeds, simulated, optimal_units, c_rate))
        result["a_over_c"] = round(result["a_samples_per_second"] / c_rate, 3)
        result["b_over_c"] = round(b_rate / c_rate, 3)
    finally:
        dht.shutdown()
        node.remove_stale_sockets(node.daemon_sockets() - sockets_before)  # killed peers' daemons leave them
    result["logs"] = str(logs)
    print(json.dumps(result))
    return 0


def _units(speeds: list[float], stages: list[int]) -> list[float]:
    totals = [0.0] * STAGES
    for speed, stage in zip(speeds, stages):
        totals[stage] += speed
    return totals


def adaptive(args, logs: Path, bootstrap: list[str], speeds, simulated, optimal_units: float, c_rate: float) -> dict:
    """Run (a): start slowest first without --stage, let it settle, measure, then kill and time the recovery."""
    result: dict = {}
    run = Run("adaptive", manifest_dict("balance-a", bootstrap, args.check_period, args.min_gain), logs)
    try:
        for speed, sim in zip(speeds, simulated):
            run.start(speed, sim, None)
            time.sleep(args.stagger)
        wait_serving(run, len(speeds))
        first = run.stage_units()
        log(f"adaptive: first choices give {first} speed units per stage")
        started = time.monotonic()
        while min(run.stage_units()) < optimal_units and time.monotonic() - started < args.settle:
            run.poll()
            time.sleep(POLL)
        settled = time.monotonic() - started
        log(f"adaptive: {run.stage_units()} after {settled:.0f}s more, {run.moves()} moves; measuring")
        measure(run, args.warmup)
        a_rate = measure(run, args.window)
        moves_before = run.moves()
        log(f"adaptive: {a_rate:.1f} samples/s")
        result.update(
            first_choice_units=first,
            settled_units=run.stage_units(),
            settle_seconds=round(settled, 1),
            a_samples_per_second=round(a_rate, 2),
            stage_moves=moves_before,
        )

        # kill all peers of the most crowded stage but its slowest
        serving = run.serving()
        crowded = max(range(STAGES), key=lambda s: sum(1 for st in serving.values() if st == s))
        victims = sorted((k for k, s in serving.items() if s == crowded), key=lambda k: run.speeds[k])[1:]
        survivors = [run.speeds[k] for k in run.live() if k not in victims]
        new_optimum = optimal_assignment(survivors, STAGES)[1]
        target = c_rate * new_optimum / optimal_units  # samples/s of the new optimum, as (c) ran
        for k in victims:
            run.kill(k)
        killed = time.monotonic()
        log(f"adaptive: killed {len(victims)} peers of stage {crowded}; new optimum {new_optimum} units")
        run.history.clear()
        recovered = None
        while time.monotonic() - killed < args.recovery_timeout:
            time.sleep(POLL)
            run.poll()
            if run.rate(10.0) >= 0.9 * target:
                recovered = time.monotonic() - killed
                break
        log(f"adaptive: recovered to {run.rate(10.0):.1f} samples/s (target {target:.1f}) after {recovered}s")
        result.update(
            killed_peers=len(victims),
            new_optimal_units=new_optimum,
            recovery_target_samples_per_second=round(target, 2),
            recovery_seconds=None if recovered is None else round(recovered, 1),
            units_after_recovery=run.stage_units(),
            moves_after_kill=run.moves() - moves_before,
        )
    finally:
        run.stop()
    return result


if __name__ == "__main__":
    sys.exit(main())
