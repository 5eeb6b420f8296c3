"""Balancing simulation: an internet swarm whose peers come and go, each choosing its stage with swarm.balancing.

    python -m benchmarks.balance_sim --peers 1000 --stages 8 --hours 24 --seed 0

The defaults are the runtime's: checks every 10 s on average (balancing.check_period), min_gain 0.1, records of
a peer that vanished linger 15 s (3 announce periods of 5 s), records read up to 5 s late (one announce period).

Event-driven, in simulated time; no processes, no network, only the pure functions of swarm.balancing. Peers
with log-normal speeds (median 1 sample/s, --sigma 1) arrive as a Poisson process that keeps about --peers
present (the first --peers join over the first 10 minutes: the warm-up); each stays an exponential session
(mean --session-hours), then leaves without warning. Every peer decides from records --view-delay seconds old,
and a departed peer's record lingers until it expires. A new peer takes choose_stage and spends a while joining
(state download; it counts in its stage's total but cannot move); every online peer asks should_move every
0.5-1.5 x --check-period seconds and, after a move, joins its new stage the same way.

Every simulated minute: efficiency = the present peers' bottleneck (joining peers included, as in
balancing.efficiency) over optimal_assignment's bottleneck of the same speeds (the heuristic at this size), and
the same bottleneck over upper_bound. Also "serving" efficiency: only online peers count (a joining peer
serves nothing yet). A short summary goes to stderr, then one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

from swarm.balancing.moves import (
    Move,
    PeerLoad,
    bottleneck,
    choose_stage,
    stage_totals,
    worthwhile_moves,
)
from swarm.balancing.optimum import optimal_assignment, upper_bound

WARMUP = 600.0  # seconds over which the first peers join
SAMPLE_PERIOD = 60.0  # one efficiency sample per simulated minute


@dataclass
class Peer:
    peer_id: str
    speed: float
    stage: int
    online: bool = False
    present: bool = True
    epoch: int = 0  # bumped by each move, so a stale "online" event of an earlier join is ignored

    def record(self) -> PeerLoad:
        return PeerLoad(self.peer_id, self.stage, self.speed, online=self.online)


class Swarm:
    """The true state, the announced records, and the records as peers see them (view_delay seconds late)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.peers: dict[str, Peer] = {}  # present peers
        self.records: dict[str, PeerLoad] = {}  # announced, departed peers' included until they expire
        self.changes: deque[tuple[float, str, PeerLoad | None]] = deque()  # not yet visible to peers
        self.view: dict[str, PeerLoad] = {}  # the records as of now - view_delay
        self.view_version = 0
        self.plan_version = -1
        self.plan: dict[str, Move] = {}
        self.plans_computed = 0
        self.events: list[tuple[float, int, str, str, int]] = []  # (time, seq, kind, peer id, epoch)
        self.seq = 0
        self.count = 0
        self.joins = self.leaves = self.moves = 0
        self.samples: list[dict[str, float]] = []
        self.departures: list[tuple[float, float]] = []  # (time, speed), to explain dips

    def schedule(self, at: float, kind: str, peer_id: str = "", epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, peer_id, epoch))

    def announce(self, now: float, peer_id: str, record: PeerLoad | None) -> None:
        if record is None:
            del self.records[peer_id]
        else:
            self.records[peer_id] = record
        self.changes.append((now, peer_id, record))

    def catch_up_view(self, now: float) -> None:
        while self.changes and self.changes[0][0] <= now - self.args.view_delay:
            _, peer_id, record = self.changes.popleft()
            if record is None:
                self.view.pop(peer_id, None)
            else:
                self.view[peer_id] = record
            self.view_version += 1

    def planned_moves(self) -> dict[str, Move]:
        # every peer reading the same records computes the same plan: compute it once per view
        if self.plan_version != self.view_version:
            moves = worthwhile_moves(list(self.view.values()), self.args.stages, self.args.min_gain)
            self.plan = {move.peer_id: move for move in moves}
            self.plan_version = self.view_version
            self.plans_computed += 1
        return self.plan

    def check_delay(self) -> float:
        return self.rng.uniform(0.5, 1.5) * self.args.check_period

    # --- events ---

    def arrive(self, now: float) -> None:
        self.count += 1
        peer_id = f"peer{self.count:06d}"
        stage = choose_stage(list(self.view.values()), self.args.stages, self.rng)
        peer = Peer(peer_id, self.rng.lognormvariate(0.0, self.args.sigma), stage)
        self.peers[peer_id] = peer
        self.joins += 1
        self.announce(now, peer_id, peer.record())
        self.schedule(now + self.args.join_seconds, "online", peer_id, peer.epoch)
        self.schedule(now + self.rng.expovariate(1.0 / (self.args.session_hours * 3600)), "leave", peer_id)
        self.schedule(now + self.args.join_seconds + self.check_delay(), "check", peer_id)

    def come_online(self, now: float, peer_id: str, epoch: int) -> None:
        peer = self.peers.get(peer_id)
        if peer is not None and peer.epoch == epoch:
            peer.online = True
            self.announce(now, peer_id, peer.record())

    def leave(self, now: float, peer_id: str) -> None:
        self.departures.append((now, self.peers.pop(peer_id).speed))
        self.leaves += 1
        if self.rng.random() < self.args.graceful_fraction:  # Ctrl-C: it announces itself offline at once
            self.schedule(now, "expire", peer_id)
        else:  # without warning (crash, lost link): its record stays until it expires
            self.schedule(now + self.args.record_expiry, "expire", peer_id)

    def check(self, now: float, peer_id: str) -> None:
        peer = self.peers.get(peer_id)
        if peer is None:
            return
        self.schedule(now + self.check_delay(), "check", peer_id)
        if not peer.online:
            return  # still downloading the state of its stage
        move = self.planned_moves().get(peer_id)
        if move is None or move.source != peer.stage:
            return
        peer.stage, peer.online, peer.epoch = move.target, False, peer.epoch + 1
        self.moves += 1
        self.announce(now, peer_id, peer.record())
        self.schedule(now + self.args.move_seconds, "online", peer_id, peer.epoch)

    def sample(self, now: float) -> None:
        present = [peer.record() for peer in self.peers.values()]
        speeds = [p.throughput for p in present]
        stages = self.args.stages
        current = bottleneck(stage_totals(present, stages))
        serving = bottleneck(stage_totals([p for p in present if p.online], stages))
        best = optimal_assignment(speeds, stages)[1]
        bound = upper_bound(speeds, stages)
        self.samples.append(
            {
                "time": now,
                "present": len(present),
                # as balancing.efficiency: capped at 1, where the heuristic optimum falls below the current
                "efficiency": 1.0 if best <= 0 else min(1.0, current / best),
                "vs_upper_bound": 1.0 if bound <= 0 else current / bound,
                "serving": 1.0 if best <= 0 else min(1.0, serving / best),
                "moves": self.moves,
                "mean_stage_total": sum(speeds) / stages,
            }
        )

    def run(self) -> None:
        args = self.args
        end = args.hours * 3600
        for _ in range(args.peers):
            self.schedule(self.rng.uniform(0, WARMUP), "arrive")
        self.schedule(self.rng.expovariate(self.arrival_rate()), "poisson")
        self.schedule(SAMPLE_PERIOD, "sample")
        while self.events and self.events[0][0] <= end:
            now, _, kind, peer_id, epoch = heapq.heappop(self.events)
            self.catch_up_view(now)
            if kind == "arrive":
                self.arrive(now)
            elif kind == "poisson":
                self.arrive(now)
                self.schedule(now + self.rng.expovariate(self.arrival_rate()), "poisson")
            elif kind == "online":
                self.come_online(now, peer_id, epoch)
            elif kind == "leave":
                self.leave(now, peer_id)
            elif kind == "expire":
                self.announce(now, peer_id, None)
            elif kind == "check":
                self.check(now, peer_id)
            elif kind == "sample":
                self.sample(now)
                self.schedule(now + SAMPLE_PERIOD, "sample")

    def arrival_rate(self) -> float:
        # arrivals per second that keep args.peers present on average (sessions of mean session_hours)
        return self.args.peers / (self.args.session_hours * 3600)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def after_fast_departure(swarm: Swarm, sample: dict[str, float]) -> bool:
    """Whether a peer holding >= 5% of a mean stage's total left in the 2 minutes before the sample."""
    times = [t for t, _ in swarm.departures]
    first = bisect.bisect_right(times, sample["time"] - 120)
    last = bisect.bisect_right(times, sample["time"])
    return any(speed >= 0.05 * sample["mean_stage_total"] for _, speed in swarm.departures[first:last])


def summarize(swarm: Swarm, wall: float) -> dict[str, object]:
    args = swarm.args
    after = [s for s in swarm.samples if s["time"] > WARMUP]
    dips = [s for s in after if s["efficiency"] < 0.9]
    efficiency = [s["efficiency"] for s in after]
    serving = [s["serving"] for s in after]
    peer_hours = sum(s["present"] for s in swarm.samples) * SAMPLE_PERIOD / 3600
    return {
        "peers": args.peers,
        "stages": args.stages,
        "hours": args.hours,
        "seed": args.seed,
        "check_period": args.check_period,
        "min_gain": args.min_gain,
        "session_hours": args.session_hours,
        "view_delay": args.view_delay,
        "sigma": args.sigma,
        "min_efficiency_after_warmup": round(min(efficiency), 4),
        "p1_efficiency_after_warmup": round(percentile(efficiency, 1), 4),
        "p50_efficiency_after_warmup": round(percentile(efficiency, 50), 4),
        "mean_efficiency_after_warmup": round(sum(efficiency) / len(efficiency), 4),
        "minutes_below_0.9": len(dips),
        "of_which_within_2_min_of_a_fast_peer_leaving": sum(after_fast_departure(swarm, s) for s in dips),
        # the base rate: how often any minute is that close to such a departure
        "share_of_all_minutes_within_2_min_of_one": round(
            sum(after_fast_departure(swarm, s) for s in after) / len(after), 3
        ),
        "min_efficiency_vs_upper_bound": round(min(s["vs_upper_bound"] for s in after), 4),
        "min_serving_efficiency_after_warmup": round(min(serving), 4),
        "p1_serving_efficiency_after_warmup": round(percentile(serving, 1), 4),
        "moves_total": swarm.moves,
        "moves_per_peer_hour": round(swarm.moves / peer_hours, 4),
        "joins": swarm.joins,
        "leaves": swarm.leaves,
        "plans_computed": swarm.plans_computed,
        "seconds": round(wall, 1),
    }


def print_human(swarm: Swarm, result: dict[str, object]) -> None:
    out = sys.stderr
    print(
        f"{result['peers']} peers over {result['stages']} stages for {result['hours']} h (seed {result['seed']}): "
        f"{result['joins']} joins, {result['leaves']} leaves, {result['moves_total']} moves "
        f"({result['moves_per_peer_hour']} per peer-hour)",
        file=out,
    )
    print(
        f"efficiency after warm-up: min {result['min_efficiency_after_warmup']}, "
        f"p1 {result['p1_efficiency_after_warmup']}, p50 {result['p50_efficiency_after_warmup']}, "
        f"mean {result['mean_efficiency_after_warmup']}; {result['minutes_below_0.9']} minutes below 0.9 "
        f"({result['of_which_within_2_min_of_a_fast_peer_leaving']} within 2 minutes of the departure of a peer "
        f"holding >= 5% of a stage, against {result['share_of_all_minutes_within_2_min_of_one']:.0%} of all "
        "minutes); "
        f"vs upper bound min {result['min_efficiency_vs_upper_bound']}; "
        f"serving (online peers only) min {result['min_serving_efficiency_after_warmup']}",
        file=out,
    )
    window = 3600 * max(1, round(swarm.args.hours / 8))
    print(f"{'hours':>9} {'present':>7} {'min eff':>7} {'p50 eff':>7} {'moves':>6}", file=out)
    start, last_moves = 0.0, 0
    while start < swarm.args.hours * 3600:
        inside = [s for s in swarm.samples if start < s["time"] <= start + window]
        if inside:
            effs = [s["efficiency"] for s in inside]
            moves = int(inside[-1]["moves"])
            print(
                f"{start / 3600:4.0f}-{(start + window) / 3600:<4.0f} {inside[-1]['present']:7.0f} "
                f"{min(effs):7.3f} {percentile(effs, 50):7.3f} {moves - last_moves:6d}",
                file=out,
            )
            last_moves = moves
        start += window
    print(f"{result['plans_computed']} plans computed, {result['seconds']} s of wall time", file=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=1000, help="peers present on average")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-period", type=float, default=10.0, help="mean seconds between should_move checks")
    parser.add_argument("--min-gain", type=float, default=0.1, help="should_move's min_gain")
    parser.add_argument("--session-hours", type=float, default=2.0, help="mean time a peer stays")
    parser.add_argument("--view-delay", type=float, default=5.0, help="seconds of staleness of the records peers read")
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of the log-normal speeds (median 1)")
    parser.add_argument("--record-expiry", type=float, default=15.0, help="seconds a departed peer's record lingers")
    parser.add_argument(
        "--graceful-fraction",
        type=float,
        default=0.0,
        help="share of departures that announce themselves offline (Ctrl-C) instead of vanishing (default 0)",
    )
    parser.add_argument("--join-seconds", type=float, default=30.0, help="joining time of a new peer")
    parser.add_argument("--move-seconds", type=float, default=20.0, help="joining time after a move")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.hours * 3600 <= WARMUP + SAMPLE_PERIOD:
        parser.error("--hours must cover more than the 10-minute warm-up")

    began = time.perf_counter()
    swarm = Swarm(args)
    swarm.run()
    result = summarize(swarm, time.perf_counter() - began)
    if not args.json_only:
        print_human(swarm, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
