"""Departures from a spans swarm whose blocks have one holder each: is trained state lost, how long does training
stall, and what does it cost the model?

    python -m benchmarks.departures [--samples 4000] [--min-holders 1] [--seed 0] [--runs clean,departures]
    python -m benchmarks.departures --stages 8 --blocks 3,5,2,1,4 --replace   # blocks with one holder

A spans swarm of --stages one-block stages (4) of the tests' small model on loopback (parameter averaging every 512
samples, checkpoints and backups every 5 s), movable peers whose --max-memory caps hold --blocks blocks each (3, 2,
1, 1, 2, 2 and 1: enough that the peers left after three departures still hold every block), each with a
checkpoint folder of its own, and a trainer-only peer. Where peers hold few more blocks than there are stages
(8 stages, peers of 3, 5, 2, 1 and 4 blocks, as in a swarm of volunteers with different GPUs), many blocks have a
single holder; there --replace starts a new peer of the same memory at each departure (a volunteer who leaves is
followed by another who comes), without which the swarm could not hold every block after three departures. Two runs: "departures",
in which, once the trainer has done a quarter, a half and three quarters of --samples:
  1. the peer with the most blocks leaves cleanly (a Ctrl-C to its process group, as a terminal sends it);
  2. a peer that serves stage 0 leaves cleanly (its only holder, if it has one);
  3. a peer that is the only holder of a block vanishes (all its processes SIGSTOPped: no goodbye, no handover);
it goes on past --samples until 30 s after the last departure; then "clean", which trains as many samples.
With `--min-holders 1` placement balances throughput only (blocks keep a single holder); with the default 2 the
swarm gives blocks spare holders where memory allows (swarm/balancing/spans.py).

Per departure (each counted until the next one, at most 60 s; departures are at least 30 s apart): the trained
state lost (for each `state_taken` event of the other peers taken while no other peer served the stage, the
optimizer steps the state was behind the stage's last announced one; a stage that had trained and started afresh
counts too), the longest stretch without training progress, and the leaving peer's own report of its handover. At the end of each run: the held-out loss of the final model (every online
peer's parameters, each combination of one holder per stage, averaged). Prints ONE JSON line; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hivemind import DHT

from benchmarks.common import (
    download_parameters,
    eval_batches,
    online_by_stage,
    stop_on_sigterm,
    swarm_heldout_losses,
)
from swarm.capacity.budget import MARGIN
from swarm.capacity.costs import MemorySettings, span_cost
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.local.processes import PeerProcess, loopback_args, start_peer, stop_peers
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict

STAGES = 4
BLOCKS = [3, 2, 1, 1, 2, 2, 1]  # what each peer's memory holds: 12 blocks, 4 or more left after the departures
WINDOW = 60.0  # seconds after a departure in which its effects are counted (until the next one)
SPACING = 30.0  # seconds between two departures, at least
POLL = 0.2


def manifest_dict(min_holders: int, stages: int = STAGES) -> dict[str, Any]:
    return fast_test_swarm_dict(
        model={"depth": stages},
        stages={"count": stages},
        balancing={"spans": True, "min_holders": min_holders, "check_period": 10.0},
        averaging={"mode": "parameters", "every_samples": 512, "matchmaking_time": 2.0},
    )


def memory_cap(manifest: Manifest, blocks: int) -> str:
    """A --max-memory under which a CPU peer holds `blocks` stages from any start, and not one more."""
    cpu, stages = MemorySettings(cuda=False), manifest.num_stages
    needed = max(span_cost(manifest, s, min(s + blocks, stages), cpu).device_bytes for s in range(stages))
    return str(int(needed / (1 - MARGIN)) + 1024)


def log(text: str) -> None:
    print(f"[departures] {text}", file=sys.stderr, flush=True)


class Run:
    """One run's swarm: its peers, the trainer's progress over time, and the departures made."""

    def __init__(self, folder: Path, raw: dict[str, Any], seed: int, blocks: list[int], replace: bool = False):
        self.folder, self.raw, self.seed, self.blocks, self.replace = folder, raw, seed, list(blocks), replace
        self.manifest = manifest_from_dict(raw)
        self.stages = self.manifest.num_stages
        self.peers: list[PeerProcess] = []
        self.trainer: PeerProcess | None = None
        self.progress: list[tuple[float, int]] = []  # (time.monotonic(), trainer samples)
        self.departures: list[dict[str, Any]] = []
        self.stopped: list[PeerProcess] = []

    def start(self) -> None:
        for number, blocks in enumerate(self.blocks):
            peer = self.add_peer(number, blocks)
            if number == 0:
                self.raw = {**self.raw, "initial_peers": [peer.maddr(120)]}
            peer.wait_for_json(lambda line: line.get("state") == "online", 180, "serving")
        joined = self.folder / "joined.json"
        args = loopback_args(joined) + ["--trainer-only", "--status-every", "1", "--seed", str(self.seed)]
        self.trainer = start_peer(args, self.folder / "trainer.log", cache_dir=self.folder / "cache")

    def add_peer(self, number: int, blocks: int) -> PeerProcess:
        """Peer `number`, whose memory holds `blocks` blocks (the first one writes manifest.json, the others join)."""
        flags = ("--no-trainer", "--status-every", "1", "--checkpoint-every", "5")
        path = self.folder / ("manifest.json" if number == 0 else "joined.json")
        path.write_text(json.dumps(self.raw))
        args = loopback_args(path) + ["--max-memory", memory_cap(self.manifest, blocks), *flags]
        args += ["--checkpoint-dir", str(self.folder / f"checkpoints-{number}")]
        peer = start_peer(args, self.folder / f"peer-{number}.log", cache_dir=self.folder / "cache")
        self.peers.append(peer)
        return peer

    def samples(self) -> int:
        lines = self.trainer.status_lines() if self.trainer is not None else []
        return (lines[-1].get("trainer_samples") or 0) if lines else 0

    def watch_until(self, samples: int, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.samples()) < samples:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer reached {now} of {samples} samples in {timeout:.0f} s")
            self.progress.append((time.monotonic(), now))
            time.sleep(POLL)
        self.progress.append((time.monotonic(), self.samples()))

    def watch_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.progress.append((time.monotonic(), self.samples()))
            time.sleep(POLL)

    def spans(self) -> dict[int, tuple[int, int]]:
        """The span each live peer serves, as its last status line says (a line a second)."""
        found = {}
        for number, peer in enumerate(self.peers):
            lines = peer.status_lines()
            if peer in self.stopped or peer.process.poll() is not None or not lines:
                continue
            if lines[-1].get("state") == "online" and lines[-1].get("span"):
                found[number] = tuple(lines[-1]["span"])
        return found

    def depart(self, kind: str) -> None:
        spans = self.spans()
        holders = {stage: [n for n, (a, b) in spans.items() if a <= stage < b] for stage in range(self.stages)}
        if kind == "most_blocks":
            target = max(spans, key=lambda n: spans[n][1] - spans[n][0])
        elif kind == "stage_0":
            target = holders[0][0]
        else:  # a sole holder of some block, else the widest
            sole = [n for n in spans if any(holders[s] == [n] for s in range(*spans[n]))]
            target = sole[0] if sole else max(spans, key=lambda n: spans[n][1] - spans[n][0])
        peer = self.peers[target]
        span = spans[target]
        sole_blocks = [s for s in range(*span) if holders[s] == [target]]
        log(f"{kind}: peer {target} (span {list(span)}, sole holder of {sole_blocks}) leaves")
        record = {"kind": kind, "peer": target, "span": list(span), "sole_blocks": sole_blocks}
        record.update(at=time.time(), monotonic=time.monotonic(), samples=self.samples())
        if kind == "vanish":
            peer.signal_all(signal.SIGSTOP)
        else:
            peer.signal_group(signal.SIGINT)
        self.stopped.append(peer)
        self.departures.append(record)
        if self.replace:  # another volunteer, of the same memory, comes
            self.add_peer(len(self.peers), self.blocks[target])
            self.blocks.append(self.blocks[target])
            record["replaced_by"] = len(self.peers) - 1

    def finish_departures(self) -> None:
        """What each departure cost, once the run is over."""
        for index, record in enumerate(self.departures):
            following = self.departures[index + 1] if index + 1 < len(self.departures) else None
            end = min(record["monotonic"] + WINDOW, following["monotonic"] if following else float("inf"))
            until = min(record["at"] + WINDOW, following["at"] if following else float("inf"))
            points = [(t, s) for t, s in self.progress if record["monotonic"] <= t <= end]
            record["stall_s"] = round(longest_stall(points, record["monotonic"]), 1)
            taken = [
                event
                for number, peer in enumerate(self.peers)
                if number != record["peer"]
                for event in peer.events("state_taken")
                if record["at"] <= event["at"] <= until
            ]
            fields = ("stage", "source", "steps_behind", "optimizer_steps", "online_peers", "reason")
            record["states_taken"] = [{k: e.get(k) for k in fields} for e in taken]
            recovered = [e for e in taken if e.get("online_peers") == 0]  # nobody served the stage: a recovery
            # per stage: several peers may recover the same stage from the same checkpoint (one loss, not several)
            behind: dict[int, int] = {}
            for e in recovered:
                behind[e["stage"]] = max(behind.get(e["stage"], 0), e["steps_behind"])
            record["steps_rolled_back"] = sum(behind.values())
            record["stages_restarted_afresh"] = sorted(
                {e["stage"] for e in recovered if e["source"] in ("fresh", "pretrained") and e["steps_behind"] > 0}
            )
            leaver = self.peers[record["peer"]]
            handed = leaver.events("handed_over")
            record["handover"] = {k: handed[-1][k] for k in ("taken", "left_behind", "seconds")} if handed else None
            del record["monotonic"]

    async def heldout(self, batches, timeout: float = 120.0) -> float | None:
        """The final model's held-out loss; None if no stage's parameters could be had from every stage in time."""
        live = [peer.maddr() for peer in self.peers if peer not in self.stopped and peer.process.poll() is None]
        dht = DHT(initial_peers=live, start=True, client_mode=True)
        deadline = time.monotonic() + timeout
        try:
            p2p = await dht.replicate_p2p()
            while time.monotonic() < deadline:  # a DHT read can miss records: read again until every stage has one
                online = await online_by_stage(dht, self.manifest)
                states = await download_parameters(p2p, self.manifest, online, on_error=lambda *e: None)
                if all(states):
                    losses = swarm_heldout_losses(self.manifest, states, batches)
                    return sum(losses) / len(losses)
                log(f"no parameters yet of stages {[s for s, found in enumerate(states) if not found]}; again")
                await asyncio.sleep(2.0)
            return None
        finally:
            dht.shutdown()

    def stop(self) -> None:
        for peer in self.stopped:
            peer.signal_all(signal.SIGCONT)
        stop_peers([p for p in [*self.peers, self.trainer] if p is not None], grace=20)


def longest_stall(points: list[tuple[float, int]], since: float) -> float:
    """The longest time between two increases of the sample count, from `since` on."""
    longest, last_change, last_count = 0.0, since, None
    for t, count in points:
        if last_count is not None and count > last_count:
            longest, last_change = max(longest, t - last_change), t
        last_count = count
    if points:
        longest = max(longest, points[-1][0] - last_change)
    return longest


def run(name: str, args: argparse.Namespace, batches, samples: int) -> dict[str, Any]:
    """One run, to `samples` trainer samples (the departures run: and on until its last departure's window is over),
    then the trainer is stopped and the final model's held-out loss measured."""
    folder = Path(tempfile.mkdtemp(prefix=f"swarm-departures-{name}-"))
    swarm = Run(folder, manifest_dict(args.min_holders, args.stages), args.seed, args.blocks, args.replace)
    began = time.monotonic()
    try:
        swarm.start()
        if name == "departures":
            for fraction, kind in ((0.25, "most_blocks"), (0.5, "stage_0"), (0.75, "vanish")):
                swarm.watch_until(int(samples * fraction))
                if swarm.departures:  # the last one's effects are over before the next
                    swarm.watch_for(SPACING)
                swarm.depart(kind)
            swarm.watch_for(SPACING)  # the last departure's effects are measured too
        swarm.watch_until(samples)
        stop_peers([swarm.trainer], grace=20)  # the model stays as it is while it is measured
        trained = swarm.samples()
        swarm.finish_departures()
        for record in swarm.departures:
            log(json.dumps(record))
        loss = asyncio.run(swarm.heldout(batches))
        log(f"{name}: held-out loss {loss} after {trained} samples")
        figures = {"heldout_loss": None if loss is None else round(loss, 4), "samples": trained}
        return {**figures, "seconds": round(time.monotonic() - began, 1), **_departures(swarm)}
    finally:
        swarm.stop()


def _departures(swarm: Run) -> dict[str, Any]:
    if not swarm.departures:
        return {}
    return {
        "departures": swarm.departures,
        "steps_rolled_back": {d["kind"]: d["steps_rolled_back"] for d in swarm.departures},
        "stall_s": {d["kind"]: d["stall_s"] for d in swarm.departures},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4000, help="samples the trainer trains in each run")
    parser.add_argument("--min-holders", type=int, default=2, help="balancing.min_holders (1: no spare holders)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default="clean,departures")
    parser.add_argument("--stages", type=int, default=STAGES, help="one-block stages of the model")
    parser.add_argument(
        "--blocks", type=lambda text: [int(n) for n in text.split(",")], default=BLOCKS, help="blocks each peer holds"
    )
    parser.add_argument("--replace", action="store_true", help="a new peer of the same memory comes at each departure")
    args = parser.parse_args(argv)
    if args.stages < 2 or not args.blocks or min(args.blocks) < 1 or max(args.blocks) > args.stages:
        parser.error("--stages must be at least 2, and each of --blocks between 1 and --stages")
    stop_on_sigterm()
    batches = eval_batches(manifest_from_dict(manifest_dict(args.min_holders, args.stages)), 16)
    results: dict[str, Any] = {}
    samples = args.samples
    # the departures run first: the clean one then trains as many samples as it did (it goes on past --samples
    # until its last departure's effects are over), so that their held-out losses compare like for like
    for name in sorted(args.runs.split(","), key=lambda name: name != "departures"):
        results[name] = run(name, args, batches, samples)
        samples = max(samples, results[name]["samples"])
    summary: dict[str, Any] = {"settings": vars(args), **results}
    if all(results.get(run, {}).get("heldout_loss") for run in ("clean", "departures")):
        summary["heldout_ratio"] = round(results["departures"]["heldout_loss"] / results["clean"]["heldout_loss"], 4)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
