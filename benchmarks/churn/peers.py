"""The churn benchmark's settings and its stage peers (__main__.py runs it): each peer's identity, port,
stage and folder are fixed before it first starts, so that it restarts as itself; a start, a kill of its whole
process group, a stop and a clean shutdown of all.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import re
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from swarm.local import processes
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.local.processes import PeerProcess, free_ports
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict

CHECKPOINT_EVERY = 10.0  # seconds between a peer's checkpoints
STATUS_EVERY = 2.0  # seconds between a peer's status lines
START_TIMEOUT = 240.0  # for a peer to serve (6 peers loading torch at once on 2 busy cores are slow)
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
    after_faults: float | None = None  # train on until every fault has ended, then these seconds (None: to samples)


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
            after_faults=args.after_faults,
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
        after_faults=args.after_faults,
    )


def benchmark_manifest(stages: int) -> Manifest:
    """The tests' fast swarm with one layer per stage, and averaging on."""
    raw = fast_test_swarm_dict(name="churn-benchmark", model={"depth": stages}, stages={"count": stages})
    return manifest_from_dict({**raw, "averaging": AVERAGING})


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
        peer.process.signal_all(sig)


def kill_peer(peer: Peer) -> None:
    """SIGKILL the peer's whole group at once (as if its machine died) and clean up after it."""
    if peer.process is not None:
        processes.kill_peer(peer.process)
    peer.stopped = False


def stop_all(peers: list[Peer]) -> None:
    """SIGTERM every peer at once (a clean shutdown), then kill what is left of each group."""
    processes.stop_peers([peer.process for peer in peers if peer.process is not None], STOP_GRACE)


def down_at(peer: Peer, when: float) -> bool:
    """Whether the peer was killed or stopped (and not yet serving again) at `when`."""
    spans = peer.downtimes + ([(peer.down_since, math.inf)] if peer.down else [])
    return any(a <= when <= b for a, b in spans)
