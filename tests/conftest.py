"""Fixtures that start real peer processes on loopback and always stop them (and their p2pd daemons).

Each peer runs in its own session (process group), so that the peer, its DHT process and its p2pd daemon
can be killed together, by their group id, whatever a test does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from peers import processes
from peers.processes import LOOPBACK, PeerProcess

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.common import tiny_manifest_dict  # noqa: E402

__all__ = ["LOOPBACK", "ROOT", "PeerProcess", "client_dht", "group_alive", "live_processes", "tiny_manifest_dict"]


def pytest_configure(config):
    # A test run stopped with SIGTERM (e.g. by a time limit) still runs the fixtures' finalizers, which stop
    # every peer it started. Under pytest-xdist the controller passes the signal on to its workers (its child
    # processes), which run the tests and so hold the peers.
    def interrupt(signum, frame):
        if not hasattr(config, "workerinput"):
            for pid, fields in processes.live_processes().items():
                if int(fields[1]) == os.getpid():
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        raise KeyboardInterrupt(f"received signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    # Peers started by the programs under test (swarm-demo's, for one) cache their measured throughput here,
    # never in the user's cache; the start_peer fixture gives each test its own.
    if "SWARM_CACHE_DIR" not in os.environ:
        cache = Path(tempfile.mkdtemp(prefix="swarm-test-cache-"))
        os.environ["SWARM_CACHE_DIR"] = str(cache)
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    """Tests marked slow first, the longest first (@pytest.mark.slow(SECONDS): what it took in a whole run with
    pytest-xdist on a busy 2-core machine), the others in their order: the longest start at once, on different
    workers, instead of one of them being left for the end."""

    def expected_seconds(item) -> float:
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else float(slow.args[0]) if slow.args else 15.0

    items.sort(key=lambda item: -expected_seconds(item))


# Modules whose tests share a running swarm (a module-scoped fixture) and run in file order: under pytest-xdist
# each is one unit of work, sent whole to one worker. (They are marked xdist_group too, but xdist 3.8's
# loadgroup renames test ids in a way that pytest 9 ignores, so the marks alone group nothing: see below.)
SHARED_SWARM_MODULES = {"tests/test_fuzz_rpc.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup as meant: every test a unit of work of its own, but a module in SHARED_SWARM_MODULES one
    unit (xdist's LoadGroupScheduling groups by an id suffix that its workers set in a private attribute of
    pytest's items, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedSwarmScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_SWARM_MODULES else nodeid

    return SharedSwarmScheduling(config, log)


def client_dht(maddr: str):
    """A DHT client in the test process, joined to the swarm through `maddr` (stop it with .shutdown())."""
    from hivemind import DHT

    return DHT(initial_peers=[maddr], start=True, client_mode=True, host_maddrs=[LOOPBACK])


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process that is not a zombie."""
    return [(pid, int(fields[1]), int(fields[2])) for pid, fields in processes.live_processes().items()]


group_alive = processes.group_alive


@pytest.fixture
def start_peer(tmp_path):
    """start_peer(manifest_path, *flags) -> PeerProcess; every peer is killed (group-wide) at teardown."""
    started: list[PeerProcess] = []

    def start(
        manifest_path: Path, *flags: str, cache_dir: Path | None = None, module: str = "peers.swarm_peer"
    ) -> PeerProcess:
        # --duration: even a peer orphaned by a killed test run stops by itself
        args = [*processes.loopback_args(manifest_path), "--duration", "900", *flags]
        # each test measures throughput afresh: its own cache (or `cache_dir`), never the user's
        cache = cache_dir or tmp_path / "cache"
        peer = processes.start_peer(args, tmp_path / f"peer{len(started)}.log", cache_dir=cache, module=module)
        started.append(peer)
        return peer

    yield start
    processes.stop_peers(started, grace=10.0)  # all at once: each takes seconds


@pytest.fixture
def write_manifest(tmp_path):
    def write(manifest: dict, name: str = "manifest.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(manifest))
        return path

    return write
