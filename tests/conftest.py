"""Fixtures that start real peer processes on loopback and always stop them (and their p2pd daemons).

Each peer runs in its own session (process group), so that the peer, its DHT process and its p2pd daemon
can be killed together, by their group id, whatever a test does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peers import processes
from swarm import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # A test run stopped with SIGTERM (e.g. by a time limit) still runs the fixtures' finalizers, which stop
    # every peer it started.
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"received signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def tiny_manifest_dict(**overrides) -> dict:
    """A small, fast 2-stage swarm for tests."""
    manifest = {
        "name": "test-swarm",
        "protocol_version": PROTOCOL_VERSION,
        "model": {"vocab_size": 256, "width": 64, "depth": 2, "heads": 2, "context_length": 32, "seed": 0},
        "stages": {"count": 2},
        "training": {
            "microbatch_size": 8,
            "microbatches_per_step": 1,
            "learning_rate": 0.003,
            "max_in_flight": 2,
            "timeouts": {"forward": 5, "backward": 5, "microbatch": 60},
        },
        "data": {"source": "stdlib", "shards": 4},
        "network": {"announce_period": 1.0},
        "initial_peers": [],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    return manifest


def client_dht(maddr: str):
    """A DHT client in the test process, joined to the swarm through `maddr` (stop it with .shutdown())."""
    from hivemind import DHT

    return DHT(initial_peers=[maddr], start=True, client_mode=True, host_maddrs=[LOOPBACK])


class PeerProcess:
    """One `swarm-peer` process in its own process group, with its output in a log file."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self.log_file = open(log_path, "wb")
        # each test measures throughput afresh: its own cache, never the user's
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_CACHE_DIR": str(log_path.parent / "cache")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peers.peer", *args],
            cwd=ROOT,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        self.pgid = self.process.pid  # the session leader's pid is the group id

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output())
            if match:
                return match
            if self.process.poll() is not None:
                raise AssertionError(f"peer exited ({self.process.returncode}) before {pattern!r}:\n{self.output()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.output()[-3000:]}")

    def maddr(self, timeout: float = 60.0) -> str:
        return self.wait_for(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", timeout).group(1)

    def peer_id(self, timeout: float = 60.0) -> str:
        return self.wait_for(r"peer ((?:12D3|Qm)\w+)", timeout).group(1)  # Qm: an RSA key (--identity)

    def status_lines(self) -> list[dict]:
        lines = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return [line for line in lines if "event" not in line]  # event lines: see swarm/events.py

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        processes.signal_group(self.pgid, sig)

    def group_alive(self) -> bool:
        return processes.group_alive(self.pgid)  # zombies of the group do not count once the leader is reaped

    def socket_files(self) -> set[Path]:
        """Unix socket files that the peer's processes (python, DHT process, p2pd) have open."""
        return processes.socket_files(self.pgid)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL the whole group; remove socket files a kill leaves."""
        processes.stop_peers([self.process], grace)
        self.log_file.close()

    def kill(self, sockets: set[Path] | None = None) -> None:
        """SIGKILL the peer, its DHT process and its p2pd daemon at once, as if the machine died."""
        processes.kill_peer(self.process, sockets)
        self.log_file.close()


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process that is not a zombie."""
    return [(pid, int(fields[1]), int(fields[2])) for pid, fields in processes.live_processes().items()]


group_alive = processes.group_alive


@pytest.fixture
def start_peer(tmp_path):
    """start_peer(manifest_path, *flags) -> PeerProcess; every peer is killed (group-wide) at teardown."""
    started: list[PeerProcess] = []

    def start(manifest_path: Path, *flags: str) -> PeerProcess:
        # --duration: even a peer orphaned by a killed test run stops by itself
        args = ["--join", str(manifest_path), "--host-maddrs", LOOPBACK, "--threads", "1", "--json"]
        args += ["--duration", "900", *flags]
        peer = PeerProcess(args, tmp_path / f"peer{len(started)}.log")
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.stop()


@pytest.fixture
def write_manifest(tmp_path):
    def write(manifest: dict, name: str = "manifest.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(manifest))
        return path

    return write
