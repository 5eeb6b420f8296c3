"""Churn benchmark: does a swarm keep training, and keep its progress, while its peers die, restart and stall?

    python benchmarks/churn.py [--samples 24000] [--faults 6] [--seed 0] [--stages 3] [--replicas 2]
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

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import math
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from hivemind.p2p import P2P, PeerID

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    download_parameters,
    eval_batches,
    free_ports,
    online_by_stage,
    start_milestones,
    stop_on_sigterm,
    swarm_heldout_losses,
    tiny_manifest_dict,
    wait_online,
)
from peers import processes, runtime  # noqa: E402
from peers.processes import PeerProcess  # noqa: E402
from swarm.client.trainer import Trainer  # noqa: E402
from swarm.dataset.shards import TextData  # noqa: E402
from swarm.dht import joining  # noqa: E402
from swarm.dht.records import Announcement, PeerState, announcement_lifetime, fetch_announcements  # noqa: E402
from swarm.manifests.manifest import Manifest, manifest_from_dict  # noqa: E402
from swarm.routing import Router  # noqa: E402

CHECKPOINT_EVERY = 10.0  # seconds between a peer's checkpoints
STATUS_EVERY = 2.0  # seconds between a peer's status lines
STALL_MARGIN = 5.0  # the stall goal: the larger timeout plus this
LOSS_TOLERANCE = 0.05  # the loss goal: within 5% of the clean run
START_TIMEOUT = 240.0  # for a peer to serve (6 peers loading torch at once on 2 busy cores are slow)
EVENTS_TIMEOUT = 300.0  # after training, for the remaining faults to finish (restarted peers to serve)
POLL_PERIOD = 1.0  # seconds between two reads of the stages' announcements
PROGRESS_PERIOD = 10.0
EVAL_BATCHES = 16
SETTLE = CHECKPOINT_EVERY  # seconds a peer serves (and checkpoints) before a fault may hit it again
STOP_GRACE = 20.0  # seconds for a peer to stop cleanly at the end

# the tests' tiny swarm (5 s timeouts) with averaging on
AVERAGING = {"mode": "parameters", "every_samples": 512, "matchmaking_time": 2.0, "timeout": 15.0}


@dataclasses.dataclass
class Settings:
    """What a run does: the swarm's size, the samples, and how many faults, how long and when."""

    stages: int
    replicas: int
    trainers: int
    samples: int
    faults: int
    seed: int
    peer_duration: float  # --duration of every peer: an orphan (this process killed) stops by itself
    restart_delay: tuple[float, float]  # seconds between a kill and the restart
    stop_seconds: tuple[float, float]  # how long a stall lasts
    window: tuple[float, float]  # faults fire when the trainers reach these shares of the samples


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.quick:
        return Settings(
            stages=args.stages or 2,
            replicas=args.replicas,
            trainers=args.trainers,
            samples=args.samples or 4800,
            faults=2 if args.faults is None else args.faults,
            seed=args.seed,
            peer_duration=600.0,
            restart_delay=(1.0, 3.0),
            stop_seconds=(4.0, 6.0),
            window=(0.1, 0.3),  # early: the trainers still train when the killed peer is back
        )
    return Settings(
        stages=args.stages or 3,
        replicas=args.replicas,
        trainers=args.trainers,
        samples=args.samples or 24000,
        faults=6 if args.faults is None else args.faults,
        seed=args.seed,
        peer_duration=3600.0,
        restart_delay=(3.0, 10.0),
        stop_seconds=(4.0, 12.0),
        window=(0.1, 0.75),
    )


def benchmark_manifest(stages: int) -> Manifest:
    """The tiny swarm with one layer per stage, and averaging on."""
    raw = tiny_manifest_dict(name="churn-benchmark", model={"depth": stages}, stages={"count": stages})
    return manifest_from_dict({**raw, "averaging": AVERAGING})


# -------------------------------------------------------------------------------------------- processes


@dataclasses.dataclass
class Peer:
    """One stage peer: fixed identity, port, stage and folder; a new process (and log) on every start."""

    name: str
    stage: int
    folder: Path
    port: int
    peer_id: str
    process: PeerProcess | None = None  # the current start's
    runs: list[PeerProcess] = dataclasses.field(default_factory=list)  # every start's, in order
    starts: int = 0
    down: bool = False  # killed or stopped by a fault, not yet serving again
    stopped: bool = False  # SIGSTOPped now
    down_since: float = 0.0
    up_since: float = 0.0  # when it last began (or went on) serving
    downtimes: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (from, to), monotonic
    crashes: list[str] = dataclasses.field(default_factory=list)  # exits nobody asked for: the log's end

    @property
    def maddr(self) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.port}/p2p/{self.peer_id}"

    @property
    def log(self) -> Path:
        return self.folder / f"start{self.starts}.log"


def make_peers(folder: Path, settings: Settings) -> list[Peer]:
    """Identities and ports for every peer, chosen before any starts; peer 0 (stage 0) is the bootstrap peer."""
    ports = free_ports(settings.stages * settings.replicas)
    peers = []
    for k, (replica, stage) in enumerate(itertools.product(range(settings.replicas), range(settings.stages))):
        peer_folder = folder / f"s{stage}r{replica}"
        peer_folder.mkdir(parents=True)
        identity = peer_folder / "identity.key"
        P2P.generate_identity(str(identity))
        peer_id = str(PeerID.from_identity(identity.read_bytes()))
        peers.append(Peer(f"s{stage}r{replica}", stage, peer_folder, ports[k], peer_id))
    return peers


def start_peer(peer: Peer, manifest_path: Path, cache: Path, settings: Settings) -> None:
    peer.starts += 1
    args = processes.loopback_args(manifest_path, peer.stage, trainer=False, port=peer.port)
    args += ["--identity", str(peer.folder / "identity.key")]
    args += ["--checkpoint-dir", str(peer.folder / "checkpoints"), "--checkpoint-every", str(CHECKPOINT_EVERY)]
    args += ["--status-every", str(STATUS_EVERY), "--duration", str(settings.peer_duration)]
    # its own group: the peer, its DHT process and p2pd die together
    peer.process = processes.start_peer(args, peer.log, cache_dir=cache)
    peer.runs.append(peer.process)


def log_text(peer: Peer, start: int | None = None) -> str:
    """The output of the peer's start number `start` (default: the current one)."""
    start = start or peer.starts
    return peer.runs[start - 1].output() if 0 < start <= len(peer.runs) else ""


def serving(peer: Peer) -> bool:
    """Whether the peer's current process says it serves its stage; RuntimeError if it exited."""
    if re.search(r"^serving stage \d+", log_text(peer), re.M):
        return True
    if peer.process is not None and (code := peer.process.poll()) is not None:
        raise RuntimeError(f"peer {peer.name} exited ({code}) before serving; its log ends:\n{peer.process.tail()}")
    return False


def signal_group(peer: Peer, sig: int) -> None:
    if peer.process is not None:
        peer.process.signal_group(sig)


def kill_peer(peer: Peer) -> None:
    """SIGKILL the peer's whole group at once (as if its machine died) and clean up after it."""
    if peer.process is not None:
        processes.kill_peer(peer.process)
    peer.stopped = False


def stop_all(peers: list[Peer]) -> None:
    """SIGTERM every peer at once (a clean shutdown), then kill what is left of each group."""
    processes.stop_peers([peer.process for peer in peers if peer.process is not None], STOP_GRACE)


# ------------------------------------------------------------------------------------------------ faults


@dataclasses.dataclass
class Event:
    kind: str  # kill, stop or double_kill
    targets: list[Peer]
    at_share: float  # fires when the trainers have this share of the samples
    delays: list[float]  # kill: restart delay; double_kill: [gap, restart delay 1, restart delay 2]; stop: seconds
    bootstrap: bool = False
    fired_at: float | None = None
    records: list[dict] = dataclasses.field(default_factory=list)  # what happened, per target


def plan_faults(peers: list[Peer], settings: Settings, rng: random.Random) -> list[Event]:
    """The faults, drawn from `rng`: a kill of the bootstrap peer, a stall, a double kill, then random ones."""
    by_stage = [[p for p in peers if p.stage == s] for s in range(settings.stages)]
    uniform = rng.uniform
    events = []
    for k in range(settings.faults):
        if k == 0:
            events.append(Event("kill", [peers[0]], 0, [uniform(*settings.restart_delay)], bootstrap=True))
        elif k == 1:
            events.append(Event("stop", [rng.choice(peers)], 0, [uniform(*settings.stop_seconds)]))
        elif k == 2 and settings.replicas >= 2:
            pair = rng.sample(by_stage[rng.randrange(settings.stages)], 2)
            gap = uniform(1.0, 3.0)  # the first restart comes after the second kill: both are down at once
            delays = [gap, gap + uniform(*settings.restart_delay), uniform(*settings.restart_delay)]
            events.append(Event("double_kill", pair, 0, delays))
        elif rng.random() < 0.5:
            target = rng.choice(peers)
            events.append(Event("kill", [target], 0, [uniform(*settings.restart_delay)], bootstrap=target is peers[0]))
        else:
            events.append(Event("stop", [rng.choice(peers)], 0, [uniform(*settings.stop_seconds)]))
    shares = sorted(uniform(*settings.window) for _ in events)
    rng.shuffle(events)
    for event, share in zip(events, shares):
        event.at_share = share
    return events


class Swarm:
    """One run's peers, manifest files and the announcements seen, with the fault actions."""

    def __init__(self, folder: Path, settings: Settings, manifest: Manifest):
        self.folder, self.settings = folder, settings
        self.cache = folder.parent / "cache"  # measured throughputs: shared by both runs (the same model)
        self.peers = make_peers(folder / "peers", settings)
        self.manifest = manifest.with_initial_peers([p.maddr for p in self.peers])
        self.manifest_path = folder / "manifest.json"
        self.manifest_path.write_text(self.manifest.to_json())
        # the very first peer has nobody to join through; every later start (its own restarts too) lists all
        self.first_manifest_path = folder / "manifest-first.json"
        self.first_manifest_path.write_text(manifest.with_initial_peers([]).to_json())
        self.history: list[tuple[float, Announcement]] = []  # (monotonic time read, online announcement)
        self.reads = self.failed_reads = 0  # reads of a stage's announcements
        self.misses: list[tuple[float, str]] = []  # (time, peer): a read without a peer that serves
        self.began = time.monotonic()
        self.wall_offset = time.time() - self.began  # monotonic + this = unix time (to place the peers' events)

    def t(self, when: float | None = None) -> float:
        return round((time.monotonic() if when is None else when) - self.began, 1)

    def say(self, text: str) -> None:
        print(f"[{self.t():7.1f}s] {text}", file=sys.stderr, flush=True)

    def start(self) -> None:
        """Start every peer (the bootstrap one first) and wait until each serves its stage."""
        first = self.peers[0]
        start_peer(first, self.first_manifest_path, self.cache, self.settings)
        deadline = time.monotonic() + START_TIMEOUT
        first.process.peer_id(START_TIMEOUT)  # its DHT is up (raises if it exited or took too long)
        for peer in self.peers[1:]:
            start_peer(peer, self.manifest_path, self.cache, self.settings)
        while not all(serving(p) for p in self.peers):
            if time.monotonic() > deadline:
                late = [p.name for p in self.peers if not serving(p)]
                raise RuntimeError(f"peers {late} did not serve within {START_TIMEOUT:.0f}s")
            time.sleep(0.5)
        for peer in self.peers:
            peer.up_since = time.monotonic()

    def latest(self, peer: Peer, before: float | None = None) -> Announcement | None:
        """The peer's last online announcement read (before a time, if given)."""
        for when, ann in reversed(self.history):
            if ann.peer_id == peer.peer_id and (before is None or when <= before):
                return ann
        return None

    async def poll(self, dht) -> None:
        """Read the stages' announcements every POLL_PERIOD, as the trainers do (the same DHT node); count the
        reads that miss a peer serving for a while (what the trainers then cannot route to); notice peers that
        exit by themselves."""
        settled = 2 * announcement_lifetime(self.manifest.network.announce_period)
        ours = {p.peer_id for p in self.peers}
        while True:
            for stage in range(self.settings.stages):
                self.reads += 1
                try:
                    anns = await fetch_announcements(dht, self.manifest.swarm_id, stage)
                except Exception as e:  # the DHT is slow under load: the next look may work
                    self.say(f"reading the announcements of stage {stage} failed: {e!r}")
                    self.failed_reads += 1
                    continue
                now = time.monotonic()
                self.history += [(now, a) for a in anns if a.state == PeerState.ONLINE and a.peer_id in ours]
                online = {a.peer_id for a in anns if a.state == PeerState.ONLINE}
                for peer in self.peers:
                    if peer.stage == stage and not peer.down and now - peer.up_since > settled:
                        if peer.peer_id not in online:
                            self.misses.append((self.t(now), peer.name))
            for peer in self.peers:
                if peer.process is not None and not peer.down and (code := peer.process.poll()) is not None:
                    tail = peer.process.tail(2000)
                    peer.crashes.append(tail)
                    peer.down, peer.down_since = True, time.monotonic()
                    self.say(f"peer {peer.name} exited by itself ({code}); its log ends:\n{tail}")
            await asyncio.sleep(POLL_PERIOD)

    async def kill(self, peer: Peer) -> dict:
        """SIGKILL the peer's group; the record of the kill (completed by `restart`)."""
        peer.down, peer.down_since = True, time.monotonic()
        before = self.latest(peer)
        await asyncio.to_thread(kill_peer, peer)
        self.say(f"killed {peer.name} (stage {peer.stage})")
        return {
            "peer": peer.name,
            "stage": peer.stage,
            "killed_at_s": self.t(peer.down_since),
            "before": None if before is None else (before.averaging_round, before.optimizer_steps),
        }

    async def restart(self, peer: Peer, record: dict) -> None:
        """Start the peer again (same identity, port, stage, checkpoints) and wait until it serves."""
        await asyncio.to_thread(start_peer, peer, self.manifest_path, self.cache, self.settings)
        record["restarted_at_s"] = self.t()
        began, deadline = time.monotonic(), time.monotonic() + START_TIMEOUT
        record["milestones_s"] = milestones = {}  # where the restart's time went (benchmarks/common.py)
        try:
            while not serving(peer):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"did not serve within {START_TIMEOUT:.0f}s of its restart")
                start_milestones(log_text(peer), milestones, time.monotonic() - began)
                await asyncio.sleep(0.2)
            start_milestones(log_text(peer), milestones, time.monotonic() - began)
        except RuntimeError as e:
            record["serving_again_at_s"] = None
            record["error"] = str(e)[:300]
            self.say(f"restarted {peer.name}, which failed: {e}")
            return
        now = time.monotonic()
        peer.down, peer.up_since = False, now
        peer.downtimes.append((peer.down_since, now))
        record["serving_again_at_s"] = self.t(now)
        record["start"] = peer.starts
        self.say(
            f"{peer.name} serves stage {peer.stage} again ({record['killed_at_s']}s -> {record['serving_again_at_s']}s)"
        )

    async def stall(self, peer: Peer, seconds: float) -> dict:
        peer.down, peer.down_since, peer.stopped = True, time.monotonic(), True
        signal_group(peer, signal.SIGSTOP)
        self.say(f"stopped {peer.name} (stage {peer.stage}) for {seconds:.1f}s")
        await asyncio.sleep(seconds)
        signal_group(peer, signal.SIGCONT)
        now = time.monotonic()
        peer.down, peer.stopped, peer.up_since = False, False, now
        peer.downtimes.append((peer.down_since, now))
        self.say(f"continued {peer.name}")
        return {
            "peer": peer.name,
            "stage": peer.stage,
            "stopped_at_s": self.t(peer.down_since),
            "seconds": round(seconds, 1),
        }

    async def run_event(self, event: Event, progress) -> None:
        """Wait for the event's point of the run (and for its targets to have served for a while), then inject it."""

        def ready(peer: Peer) -> bool:
            return not peer.down and time.monotonic() - peer.up_since >= SETTLE

        while progress() < event.at_share or not all(ready(p) for p in event.targets):
            await asyncio.sleep(0.2)
        event.fired_at = time.monotonic()
        if event.kind == "stop":
            event.records.append(await self.stall(event.targets[0], event.delays[0]))
        elif event.kind == "kill":
            record = await self.kill(event.targets[0])
            event.records.append(record)
            await asyncio.sleep(event.delays[0])
            await self.restart(event.targets[0], record)
        else:  # double kill: a, then b while a is down; a restarts after b's kill, then b
            a, b = event.targets
            gap, delay_a, delay_b = event.delays
            first = await self.kill(a)
            await asyncio.sleep(max(0.0, gap - (time.monotonic() - a.down_since)))  # the gap between the signals
            second = await self.kill(b)
            event.records += [first, second]
            begin = time.monotonic()

            async def restart_later(peer: Peer, record: dict, delay: float) -> None:
                await asyncio.sleep(max(0.0, delay - (time.monotonic() - begin)))
                await self.restart(peer, record)

            await asyncio.gather(restart_later(a, first, delay_a - gap), restart_later(b, second, delay_b))

    def outages(self) -> list[tuple[float, float]]:
        """Intervals (monotonic) during which some stage had no running peer: all its replicas killed or stopped."""
        found = []
        for stage in range(self.settings.stages):
            replicas = [p for p in self.peers if p.stage == stage]
            edges = sorted({t for p in replicas for span in p.downtimes for t in span})
            for a, b in itertools.pairwise(edges):
                middle = (a + b) / 2
                if all(any(x <= middle <= y for x, y in p.downtimes) for p in replicas):
                    found.append((a, b))
        return merge(found)


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


# ---------------------------------------------------------------------------------------------- training


class CountingRouter(Router):
    """A trainer's router that counts the bans it gives peers (each failed call bans the peer for a while)."""

    def __init__(self) -> None:
        super().__init__()
        self.bans = 0

    def failed(self, peer_id: str, now: float) -> float:
        self.bans += 1
        return super().failed(peer_id, now)


class TimedTrainer(Trainer):
    """A Trainer that notes when each of its microbatches finished (time.monotonic()) and counts its bans."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished: list[float] = []
        self.router = CountingRouter()

    def _collect(self, task: asyncio.Task) -> None:
        done = self.microbatches
        super()._collect(task)
        if self.microbatches > done:
            self.finished.append(time.monotonic())


def stalls(finished: list[float], outages: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(longest gap between two finished microbatches, when it began, longest gap not counting outages)."""
    longest, at, longest_served = 0.0, 0.0, 0.0
    for a, b in itertools.pairwise(sorted(finished)):
        if b - a > longest:
            longest, at = b - a, a
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in outages)
        longest_served = max(longest_served, b - a - covered)
    return longest, at, longest_served


async def drive(swarm: Swarm, dht, events: list[Event], batches) -> dict:
    """Train to the samples (injecting `events`), wait for the faults to end, then evaluate the final model."""
    settings, manifest = swarm.settings, swarm.manifest
    p2p = await dht.replicate_p2p()
    poller = asyncio.create_task(swarm.poll(dht))
    try:
        if not await wait_online(dht, manifest, settings.replicas, START_TIMEOUT):
            raise RuntimeError("the peers did not all announce online")
        trainers = [
            TimedTrainer(manifest, dht, p2p, f"{dht.peer_id}-trainer{k}", seed=k) for k in range(settings.trainers)
        ]
        target = settings.samples

        def progress() -> float:
            return sum(t.samples for t in trainers) / target

        shards = [
            TextData.load(manifest.data.source, manifest.data.heldout_fraction, k, manifest.data.shards).train
            for k in range(settings.trainers)
        ]
        stop = asyncio.Event()
        began = time.monotonic()
        swarm.say(f"training {target} samples with {settings.trainers} trainers; {len(events)} faults planned")
        injector = [asyncio.create_task(swarm.run_event(e, progress)) for e in events]
        reporter = asyncio.create_task(report_progress(swarm, trainers, target))
        share = target // settings.trainers
        await asyncio.gather(*[t.train(shard, stop, max_samples=share) for t, shard in zip(trainers, shards)])
        train_seconds = time.monotonic() - began
        reporter.cancel()
        swarm.say(f"trained {sum(t.samples for t in trainers)} samples in {train_seconds:.0f}s")
        pending = [task for task in injector if not task.done()]
        if pending:  # a fault that had not fired is called off; a restart under way is waited for
            for task, event in zip(injector, events):
                if event.fired_at is None:
                    task.cancel()
            done, late = await asyncio.wait(pending, timeout=EVENTS_TIMEOUT)
            for task in late:
                task.cancel()
        for task in injector:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        # the final states, from every peer that serves (after one more announcement of each)
        if not await wait_online(dht, manifest, settings.replicas, START_TIMEOUT):
            swarm.say("not every peer is online at the end; evaluating those that are")
        await asyncio.sleep(manifest.network.announce_period * 1.5)

        def failed(stage: int, peer_id: str, error: Exception) -> None:
            swarm.say(f"downloading the state of stage {stage} from {peer_id[-8:]} failed: {error!r}")

        states = await download_parameters(p2p, manifest, await online_by_stage(dht, manifest), 120, failed)
        for stage, replicas in enumerate(states):
            if not replicas:
                raise RuntimeError(f"no peer of stage {stage} gave its state at the end")
        losses = swarm_heldout_losses(manifest, states, batches)
        return {
            "trainers": trainers,
            "train_seconds": train_seconds,
            "began": began,
            "heldout_loss": float(np.mean(losses)),
            "heldout_loss_spread": float(np.max(losses) - np.min(losses)),
            "final_replicas": [len(replicas) for replicas in states],
        }
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await p2p.shutdown()


async def report_progress(swarm: Swarm, trainers: list[TimedTrainer], target: int) -> None:
    while True:
        await asyncio.sleep(PROGRESS_PERIOD)
        down = [p.name + (" (stopped)" if p.stopped else "") for p in swarm.peers if p.down]
        failed = sum(t.failed_microbatches for t in trainers)
        swarm.say(
            f"{sum(t.samples for t in trainers)}/{target} samples, {failed} microbatches lost"
            + (f"; down: {', '.join(down)}" if down else "")
        )


# ------------------------------------------------------------------------------------------------ a run


SOURCES = {"peer": "peer", "checkpoint": "checkpoint", "fresh": "afresh"}  # a state_taken event's, as reported


def restart_source(run: PeerProcess) -> tuple[str | None, int | None, float | None, float]:
    """How a start took its stage's state, from its first state_taken event (swarm/events.py): (peer, checkpoint
    or afresh; the optimizer steps loaded; the Unix time it had the state; seconds the download from a peer took
    before then). All None (and 0) if it printed no such event."""
    taken = run.events("state_taken")
    if not taken:
        return None, None, None, 0.0
    event = taken[0]
    source = SOURCES.get(event["source"], event["source"])
    download = float(event.get("seconds", 0.0)) if source == "peer" else 0.0
    return source, int(event["optimizer_steps"]), float(event["at"]), download


def allowance(swarm: Swarm, stage: int) -> int:
    """The optimizer steps that one peer of the stage made at most within a checkpoint interval plus two announce
    periods: how far its checkpoint may trail its last announcement before a kill."""
    window = CHECKPOINT_EVERY + 2 * swarm.manifest.network.announce_period
    steps = 0
    for peer in (p for p in swarm.peers if p.stage == stage):
        series = [(t, a) for t, a in swarm.history if a.peer_id == peer.peer_id]
        cuts = [x for x, _ in peer.downtimes]  # a restart sets the counters to another state's: no window across
        for i, (t0, a0) in enumerate(series):
            for t1, a1 in series[i + 1 :]:
                if t1 - t0 > window:
                    break
                if not any(t0 <= c <= t1 for c in cuts):
                    steps = max(steps, a1.optimizer_steps - a0.optimizer_steps)
    return steps


def progress_lost(swarm: Swarm, events: list[Event]) -> dict:
    """Per stage: every restart's source and loaded state against the best it could have had (see the docstring):
    the most advanced replica serving when it chose (as last read before then), else its own last announcement."""
    result = {}
    trained = {p.stage: 0 for p in swarm.peers}
    for _, ann in swarm.history:
        trained[ann.stage] = max(trained[ann.stage], ann.optimizer_steps)
    for stage in range(swarm.settings.stages):
        steps_allowed = allowance(swarm, stage)
        drops_steps, drops_rounds, sources, afresh = [0], [0], [], 0
        for event in events:
            for record in event.records:
                if record["stage"] != stage or "killed_at_s" not in record:
                    continue
                if not record.get("start"):  # not restarted (training over), or it did not serve again
                    sources.append("did not serve" if "restarted_at_s" in record else "not restarted")
                    continue
                peer = next(p for p in swarm.peers if p.name == record["peer"])
                source, steps, taken_at, download = restart_source(peer.runs[record["start"] - 1])
                sources.append(source)
                record["source"], record["loaded_steps"] = source, steps
                if source == "afresh" and trained[stage] > 0:
                    afresh += 1
                if steps is None or taken_at is None:
                    continue
                served_at = swarm.began + record["serving_again_at_s"]
                # when it chose where to take the state from: a replica's announcements read before then are older
                # than the state it could have taken
                chose_at = taken_at - swarm.wall_offset - download
                replicas = [
                    swarm.latest(q, chose_at)
                    for q in swarm.peers
                    if q.stage == stage and q is not peer and q.starts and not down_at(q, chose_at)
                ]
                best_live = max(
                    ((a.averaging_round, a.optimizer_steps) for a in replicas if a is not None), default=None
                )
                record["best_live_replica"] = best_live
                # the averaging round it loaded: its first announcement after it served again
                after = [(t, a) for t, a in swarm.history if a.peer_id == peer.peer_id and t >= served_at]
                loaded = (after[0][1].averaging_round if after else 0, steps)
                # trainers route to it again: the first time it announces more samples served than at first
                worked = [t for t, a in after if a.samples_served > after[0][1].samples_served]
                record["first_work_after_s"] = round(worked[0] - served_at, 1) if worked else None
                best = best_live or record["before"]
                if best is None or loaded >= tuple(best):
                    continue
                drops_rounds.append(max(0, best[0] - loaded[0]))
                drops_steps.append(max(0, best[1] - loaded[1]))
                record["behind"] = {"rounds": drops_rounds[-1], "steps": drops_steps[-1]}
        lost = afresh > 0 or max(drops_steps) > steps_allowed
        result[str(stage)] = {
            "lost": lost,
            "restarts": len(sources),
            "sources": {s or "unknown": sources.count(s) for s in sorted(set(sources), key=str)},
            "afresh_after_training": afresh,
            "largest_drop_steps": max(drops_steps),
            "allowance_steps": steps_allowed,
            "largest_drop_rounds": max(drops_rounds),  # for information: a catch-up renumbers rounds
        }
    return result


def down_at(peer: Peer, when: float) -> bool:
    """Whether the peer was killed or stopped (and not yet serving again) at `when`."""
    spans = peer.downtimes + ([(peer.down_since, math.inf)] if peer.down else [])
    return any(a <= when <= b for a, b in spans)


def peer_warnings(swarm: Swarm) -> dict[str, int]:
    """Warnings, errors and tracebacks in the peers' logs, by message (numbers and ids blanked), most frequent first."""
    counts: dict[str, int] = {}
    for peer in swarm.peers:
        for start in range(1, peer.starts + 1):
            for line in log_text(peer, start).splitlines():
                if not re.search(r" (WARNING|ERROR|CRITICAL) |^Traceback|\[(WARN|ERROR)\]", line):
                    continue
                key = re.sub(r"\b(Qm|12D3)\w+|\b[0-9a-f]{8,}\b", "<id>", line)
                key = re.sub(r"\d+(\.\d+)?", "N", key.split(" ", 1)[-1])[:160]
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def capture_trainer_log(path: Path) -> list[logging.Handler]:
    """The trainers' log, INFO included (their bans of peers, with reasons), into `path`; warnings also to stderr."""
    logger = logging.getLogger(Trainer.__module__)
    formatter = logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.FileHandler(path), logging.StreamHandler(sys.stderr)]
    handlers[1].setLevel(logging.WARNING)
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handlers


def release_trainer_log(handlers: list[logging.Handler]) -> None:
    logger = logging.getLogger(Trainer.__module__)
    for handler in handlers:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


def run(name: str, workdir: Path, settings: Settings, manifest: Manifest, batches, with_faults: bool) -> dict:
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
        dht = joining.start_dht([p.maddr for p in swarm.peers], joining.LOOPBACK)
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


def fault_counts(events: list[dict]) -> dict:
    fired = [e for e in events if e["fired_at_s"] is not None]
    return {
        "planned": len(events),
        "fired": len(fired),
        "kill": sum(e["kind"] == "kill" for e in fired),
        "stop": sum(e["kind"] == "stop" for e in fired),
        "double_kill": sum(e["kind"] == "double_kill" for e in fired),
        "bootstrap_kills": sum(e.get("bootstrap", False) for e in fired),
    }


def summarize(settings: Settings, manifest: Manifest, runs: dict[str, dict], logs: Path) -> dict:
    timeouts = manifest.training.timeouts
    stall_limit = max(timeouts.forward, timeouts.backward) + STALL_MARGIN
    summary: dict = {
        "settings": {
            "stages": settings.stages,
            "replicas": settings.replicas,
            "trainers": settings.trainers,
            "max_in_flight": manifest.training.max_in_flight,
            "samples": settings.samples,
            "seed": settings.seed,
            "checkpoint_every_s": CHECKPOINT_EVERY,
            "forward_timeout_s": timeouts.forward,
            "backward_timeout_s": timeouts.backward,
            "averaging_every_samples": manifest.averaging.every_samples,
            "stall_limit_s": stall_limit,
        },
    }
    faults = runs.get("faults")
    if faults is not None:
        summary["faults_injected"] = fault_counts(faults["events"])
    summary.update(runs)
    goals = {}
    if faults is not None:
        goals["stall"] = faults["longest_stall_outside_outages_s"] <= stall_limit
        goals["progress"] = not any(s["lost"] for s in faults["progress_lost"].values())
    if faults is not None and "clean" in runs:
        difference = (faults["heldout_loss"] - runs["clean"]["heldout_loss"]) / runs["clean"]["heldout_loss"]
        summary["heldout_loss_relative_difference"] = round(difference, 4)
        goals["loss"] = abs(difference) <= LOSS_TOLERANCE
    summary["goals_met"] = goals
    summary["logs"] = str(logs)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=None, help="samples per run (default 24000; quick: 4800)")
    parser.add_argument("--faults", type=int, default=None, help="fault events in the faults run (default 6; quick: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults' times, kinds and targets")
    parser.add_argument("--stages", type=int, default=None, help="stages (default 3; quick: 2)")
    parser.add_argument("--replicas", type=int, default=2, help="peers per stage (default 2)")
    parser.add_argument("--trainers", type=int, default=2, help="trainers in this process (default 2)")
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 2 stages, 4800 samples, a bootstrap kill and a stall"
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
    print(json.dumps(benchmark(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
