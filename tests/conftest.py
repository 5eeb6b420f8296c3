"""Fixtures that start real peer processes on loopback and always stop them (and their p2pd daemons).

Each peer runs in its own session (process group), so that the peer, its DHT process and its p2pd daemon
can be killed together, by their group id, whatever a test does. Also: how tests wait (wait_until,
settled_status), and how pytest-xdist schedules the tests (the longest first; a shared swarm's tests together).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from swarm.local import processes
from swarm.local.fast_swarm import fast_test_swarm_dict as tiny_manifest_dict
from swarm.local.processes import LOOPBACK, PeerProcess

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")

__all__ = [
    "LOOPBACK",
    "ROOT",
    "PeerProcess",
    "client_dht",
    "group_alive",
    "live_processes",
    "settled_status",
    "tiny_manifest_dict",
    "wait_until",
]


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
    # Peers forked from a process that has imported them once (swarm/local/forkserver.py): 5 s of CPU less a peer.
    # SWARM_TEST_FORK_PEERS=0 starts each in a fresh interpreter, as a volunteer's peer starts.
    if os.environ.get("SWARM_TEST_FORK_PEERS", "1") == "1":
        processes.fork_peers_from_a_preloaded_process()
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


# Tests that share a running swarm (a module- or package-scoped fixture), by the start of their ids: a folder's
# (tests/fuzz_rpc/) or a module's. Under pytest-xdist each entry is one unit of work, sent whole to one worker,
# which runs its tests in order and starts the swarm once. (xdist's own --dist loadgroup would group xdist_group
# marks, but xdist 3.8's loadgroup renames test ids in a way that pytest 9 ignores: see below.)
SHARED_SWARMS = ("tests/fuzz_rpc/", "tests/test_attacks_on_one_swarm.py", "tests/test_preflight.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup as meant: every test a unit of work of its own, but the tests of an entry of SHARED_SWARMS
    one unit (xdist's LoadGroupScheduling groups by an id suffix that its workers set in a private attribute of
    pytest's items, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedSwarmScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((shared for shared in SHARED_SWARMS if nodeid.startswith(shared)), nodeid)

    return SharedSwarmScheduling(config, log)


def client_dht(maddr: str):
    """A DHT client in the test process, joined to the swarm through `maddr` (stop it with .shutdown())."""
    from hivemind import DHT

    return DHT(initial_peers=[maddr], start=True, client_mode=True, host_maddrs=[LOOPBACK])


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process that is not a zombie."""
    return [(pid, int(fields[1]), int(fields[2])) for pid, fields in processes.live_processes().items()]


group_alive = processes.group_alive


# Tests wait for a condition, with a deadline, never for a fixed time: on a loaded 2-core machine a state takes
# longer to arrive than on an idle one, and a fixed sleep is too short there or too long here. (A fixed time is
# right only where the time itself is what a test sets up: a window in which something must not happen.)


def wait_until(condition: Callable[[], T], timeout: float, what: str, every: float = 0.2) -> T:
    """condition()'s first true value, asked every `every` seconds; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if result := condition():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def settled_status(peer: PeerProcess, keys: Sequence[str], timeout: float = 60.0, lines: int = 3) -> dict[str, Any]:
    """The peer's status line once `keys` stopped changing: the newest of `lines` consecutive status lines, all
    printed after this call, that agree on every key (e.g. a stage peer's counters after its trainer stopped:
    what was in flight is finished by then)."""
    seen = len(peer.status_lines())

    def settled() -> dict[str, Any] | None:
        if peer.process.poll() is not None:
            raise AssertionError(f"the peer exited while its status settled; its log ends:\n{peer.tail()}")
        recent = peer.status_lines()[seen:][-lines:]
        if len(recent) == lines and all(all(line.get(k) == recent[0].get(k) for k in keys) for line in recent):
            return recent[-1]
        return None

    return wait_until(settled, timeout, f"the status of {list(keys)} to settle ({lines} equal lines)")


class PeerStarter:
    """Starts peers of swarms on loopback, their logs in `folder`; stop_all() kills every one (group-wide)."""

    def __init__(self, folder: Path):
        self.folder, self.started = folder, []

    def __call__(
        self,
        manifest_path: Path,
        *flags: str,
        cache_dir: Path | None = None,
        module: str = "peers.swarm_peer",
        env: dict[str, str] | None = None,
    ) -> PeerProcess:
        # --duration: even a peer orphaned by a killed test run stops by itself
        args = [*processes.loopback_args(manifest_path), "--duration", "900", *flags]
        # each test measures throughput afresh: its own cache (or `cache_dir`), never the user's
        cache = cache_dir or self.folder / "cache"
        log = self.folder / f"peer{len(self.started)}.log"
        peer = processes.start_peer(args, log, cache_dir=cache, env=env, module=module)
        self.started.append(peer)
        return peer

    def stop_all(self) -> None:
        # killed at once, as if their machines died: a clean shutdown (checkpoint, offline record) takes seconds
        # of both cores per test, and has tests of its own (test_peer_process.py, test_cli.py)
        for peer in self.started:
            peer.kill()


@pytest.fixture
def start_peer(tmp_path):
    """start_peer(manifest_path, *flags) -> PeerProcess; every peer is killed (group-wide) at teardown."""
    starter = PeerStarter(tmp_path)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="module")
def start_module_peer(tmp_path_factory):
    """start_peer for a swarm that a module's tests share (the module must be in SHARED_SWARMS, so that its tests
    run together, in one worker): its peers are killed after the module's last test."""
    starter = PeerStarter(tmp_path_factory.mktemp("swarm"))
    yield starter
    starter.stop_all()


@pytest.fixture
def write_manifest(tmp_path):
    def write(manifest: dict, name: str = "manifest.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(manifest))
        return path

    return write
