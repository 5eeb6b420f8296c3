"""swarm-peer --check: the preflight's verdicts (pure, in this process) and the program against real swarms: a live
one-peer swarm (shared by the tests that need one), dead initial peers, wrong manifest URLs."""

from __future__ import annotations

import functools
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_manifest_dict
from peers.processes import free_ports
from swarm.capacity.budget import usable_budget
from swarm.capacity.costs import MemorySettings
from swarm.manifests.validation import manifest_from_dict
from swarm.preflight.checks import Blocks, Check, ExitCode, Status, exit_code, memory_check
from swarm.preflight.run import ORDER
from swarm.preflight.swarm_checks import (
    PeerAnswer,
    bandwidth_check,
    clock_check,
    initial_peers_check,
    offsets_from_records,
)

MADE_UP_PEER = "12D3KooWEKYnHv3sXsjiyHYCaWwTAudbWmyGtnL2RZJUbA9FnEdV"
LOOPBACK_ONLY = ("--host-maddrs", "/ip4/127.0.0.1/tcp/0")  # the check's dial-back node listens on loopback only


def run_check(join: str | Path, *flags: str, timeout: float = 60) -> tuple[int, dict, str, float]:
    """swarm-peer --check --json as a program: (exit code, its JSON document, its stderr, seconds taken)."""
    begin = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "peers.swarm_peer", "--check", "--json", "--join", str(join), *LOOPBACK_ONLY, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    document = json.loads(result.stdout)
    return result.returncode, document, result.stderr, time.monotonic() - begin


def statuses(document: dict) -> dict[str, str]:
    return {check["name"]: check["status"] for check in document["checks"]}


def check_named(document: dict, name: str) -> dict:
    return next(check for check in document["checks"] if check["name"] == name)


# ------------------------------------------------------------------------------------------------ pure verdicts


def test_exit_code_is_the_worst_failure():
    def check(status: Status, blocks: Blocks = Blocks.JOIN) -> Check:
        return Check("x", status, "", blocks=blocks)

    assert exit_code([check(Status.PASS), check(Status.WARN), check(Status.SKIP)]) == ExitCode.CAN_SERVE
    assert exit_code([check(Status.PASS), check(Status.FAIL, Blocks.SERVE)]) == ExitCode.TRAINER_ONLY
    assert exit_code([check(Status.FAIL, Blocks.SERVE), check(Status.FAIL, Blocks.JOIN)]) == ExitCode.CANNOT_JOIN
    assert exit_code([check(Status.WARN, Blocks.JOIN)]) == ExitCode.CAN_SERVE  # a warning never counts


def test_clock_offsets_warn_past_ten_seconds_and_fail_past_a_record_lifetime():
    lifetime = 30.0
    assert clock_check([0.2, -0.1, 0.3], [], lifetime).status == Status.PASS
    behind = clock_check([12.0, 12.5], [], lifetime)  # the peers' clocks are 12 s ahead: this one is behind
    assert behind.status == Status.WARN and "behind" in behind.detail and "timedatectl set-ntp true" in behind.remedy
    assert behind.figures["offset_seconds"] == pytest.approx(-12.25)
    assert clock_check([-40.0], [], lifetime).status == Status.FAIL
    assert clock_check([], [], lifetime).status == Status.WARN  # nothing to compare with: said, not a failure
    # from records: written at most one announce period before they were read (announce period 10, lifetime 30)
    now = 1_000_000.0
    offsets = offsets_from_records([now + 30.0 - 5.0, now + 30.0], lifetime, 10.0, now)
    assert offsets == [0.0, 5.0]
    assert clock_check([], offsets, lifetime).figures["source"] == "DHT records"


def test_bandwidth_below_the_minimum_warns():
    mbits = 1e6 / 8  # bytes/s in a Mbit/s
    assert bandwidth_check([("a", 100 * mbits, 40 * mbits)]).status == Status.PASS
    slow_up = bandwidth_check([("a", 100 * mbits, 4 * mbits)])
    assert slow_up.status == Status.WARN and "minimum of 10 down / 5 up" in slow_up.detail
    assert "recommended" in bandwidth_check([("a", 20 * mbits, 10 * mbits)]).detail  # enough, not recommended
    assert bandwidth_check([], "nobody online").status == Status.WARN


def test_initial_peers_fail_only_when_none_answers():
    up, down = PeerAnswer("/ip4/1.2.3.4/tcp/1/p2p/A", rtt=0.05), PeerAnswer("/ip4/1.2.3.5/tcp/1/p2p/B", error="gone")
    assert initial_peers_check([up]).status == Status.PASS
    assert initial_peers_check([up, down]).status == Status.WARN
    assert initial_peers_check([down]).status == Status.FAIL and initial_peers_check([]).status == Status.FAIL


def test_memory_check_names_the_stages_that_fit_and_a_pinned_stage_that_does_not():
    manifest = manifest_from_dict(tiny_manifest_dict())
    settings = MemorySettings(cuda=False)
    check, lengths = memory_check(manifest, usable_budget(torch.device("cpu"), available=8 << 30), settings)
    assert check.status == Status.PASS and lengths == [1, 1]
    tiny = usable_budget(torch.device("cpu"), available=100 << 20)
    check, _ = memory_check(manifest, tiny, settings)
    assert check.status == Status.FAIL and check.blocks == Blocks.SERVE and "--trainer-only" in check.remedy
    check, _ = memory_check(manifest, usable_budget(torch.device("cpu"), available=8 << 30), settings, 5)
    assert check.status == Status.FAIL and "stages 0..1" in check.detail


# ------------------------------------------------------------------------------------------- a live swarm


@pytest.fixture(scope="module")
def live_swarm(start_module_peer, tmp_path_factory) -> Path:
    """A one-peer swarm serving stage 0 of 2; the path of its published manifest (with the peer's address)."""
    folder = tmp_path_factory.mktemp("preflight")
    original = folder / "swarm.json"
    original.write_text(json.dumps(tiny_manifest_dict()))
    published = folder / "published.json"
    peer = start_module_peer(
        original, "--new-swarm", "--write-manifest", str(published), "--stage", "0", "--no-trainer"
    )
    peer.wait_for("serving stage 0", timeout=90)
    return published


@pytest.mark.integration
@pytest.mark.slow(30)
def test_check_against_a_live_swarm_passes_and_lists_every_check(live_swarm):
    code, document, progress, took = run_check(live_swarm)
    found = statuses(document)
    assert code == 0, document
    assert document["exit_code"] == 0 and document["swarm"]["stages"] == 2
    assert list(found) == list(ORDER) and all(status in ("pass", "warn") for status in found.values())
    for name in ("manifest", "initial_peers", "reachability", "bandwidth", "clock", "memory"):
        assert found[name] == "pass", check_named(document, name)
    assert check_named(document, "initial_peers")["figures"]["peers"][0]["rtt_ms"] < 1000
    assert check_named(document, "bandwidth")["figures"]["download_mbits"] > 10  # loopback
    assert abs(check_named(document, "clock")["figures"]["offset_seconds"]) < 2
    assert "pinging the initial peers" in progress  # it says what it does while it runs
    assert took < 40


@pytest.mark.integration
@pytest.mark.slow(15)
def test_check_with_too_little_memory_for_any_stage_says_trainer_only(live_swarm):
    code, document, _, _ = run_check(live_swarm, "--max-memory", "50MB")
    memory = check_named(document, "memory")
    assert code == 1 and document["exit_code"] == 1, document
    assert memory["status"] == "fail" and memory["blocks"] == "serve"
    assert "capped by --max-memory" in memory["detail"] and "--trainer-only" in memory["remedy"]
    assert statuses(document)["initial_peers"] == "pass"  # it can still join, as a trainer


@pytest.mark.integration
@pytest.mark.slow(15)
def test_check_from_a_machine_that_cannot_be_dialed_back_warns(live_swarm):
    # it listens, but announces a port where nobody answers: as behind a NAT without port forwarding
    (closed,) = free_ports(1)
    code, document, _, _ = run_check(live_swarm, "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{closed}")
    reachability = check_named(document, "reachability")
    assert reachability["status"] == "warn", reachability
    assert reachability["figures"]["reachable"] is False and "--announce-maddrs" in reachability["remedy"]
    assert code == 0  # it still serves, over the connections it opens


# ------------------------------------------------------------------------------------- nothing to join


@pytest.mark.integration
def test_check_with_dead_initial_peers_cannot_join(write_manifest):
    (port,) = free_ports(1)
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/{MADE_UP_PEER}"
    path = write_manifest(tiny_manifest_dict(initial_peers=[dead]))
    code, document, _, took = run_check(path)
    initial = check_named(document, "initial_peers")
    assert code == 2 and document["exit_code"] == 2
    assert initial["status"] == "fail" and initial["blocks"] == "join"
    assert "cannot reach any of the 1 initial peers" in initial["detail"] and "firewall" in initial["remedy"]
    assert statuses(document)["reachability"] == "skip"
    assert took < 30


class ManifestServer:
    """An HTTP server on 127.0.0.1 (a thread of this process) that serves one folder."""

    def __init__(self, folder: Path):
        handler = functools.partial(QuietHandler, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@pytest.mark.integration
def test_check_with_a_wrong_manifest_url_cannot_join(tmp_path):
    (port,) = free_ports(1)
    code, document, _, _ = run_check(f"http://127.0.0.1:{port}/swarm.json")  # nobody listens there
    manifest = check_named(document, "manifest")
    assert code == 2 and manifest["status"] == "fail" and "could not get the manifest" in manifest["detail"]
    assert statuses(document)["initial_peers"] == "skip"

    (tmp_path / "swarm.json").write_text(json.dumps(tiny_manifest_dict()))
    server = ManifestServer(tmp_path)
    try:
        code, document, _, _ = run_check(server.url("swarm.json") + "#0123456789abcdef")  # another swarm's id
    finally:
        server.close()
    manifest = check_named(document, "manifest")
    assert code == 2 and manifest["status"] == "fail"
    assert "but the URL says 0123456789abcdef" in manifest["detail"], manifest
