"""A churn run's swarm (__main__.py): its peers and manifests, what a poller reads of their
announcements, and the faults: planned from a seed (kills, stalls, a double kill) and injected when the
trainers reach their points of the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import signal
import sys
import time
from pathlib import Path

from benchmarks.churn.peers import (
    CHECKPOINT_EVERY,
    START_TIMEOUT,
    Peer,
    Settings,
    kill_peer,
    log_text,
    make_peers,
    serving,
    signal_group,
    start_peer,
)
from benchmarks.common import start_milestones
from swarm.dht.records import Announcement, PeerState, announcement_lifetime, fetch_announcements
from swarm.manifests.manifest import Manifest

POLL_PERIOD = 1.0  # seconds between two reads of the stages' announcements
SETTLE = CHECKPOINT_EVERY  # seconds a peer serves (and checkpoints) before a fault may hit it again


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
