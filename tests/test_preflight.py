"""swarm-peer --check: the preflight's verdicts (pure, in this process) and the program against real swarms: a live
one-peer swarm (shared by the tests that need one), dead initial peers, wrong manifest URLs. And the same verdicts
where a real start meets them: a clock far off refuses the start, a CPU that cannot help serving trains only."""

from __future__ import annotations

import functools
import http.server
import json
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.capacity.budget import usable_budget
from swarm.capacity.costs import MemorySettings
from swarm.dataset.corpus import index_sha256, prepare_corpus
from swarm.dataset.tokenizer import byte_tokenizer
from swarm.local import processes
from swarm.local.processes import free_ports
from swarm.manifests.validation import manifest_from_dict
from swarm.preflight.checks import Blocks, Check, ExitCode, Status, exit_code, memory_check, no_cuda_reason
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
    """swarm-peer --check --json as a program, started as the suite's peers are: (exit code, its JSON document, the
    rest of what it printed, seconds taken)."""
    begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swarm-check-") as folder:
        args = ["--check", "--json", "--join", str(join), *LOOPBACK_ONLY, *flags]
        peer = processes.start_peer(args, Path(folder) / "check.log")
        try:
            code = peer.process.wait(timeout=timeout)
        finally:
            processes.kill_peer(peer)
        output = peer.output()
    assert "Traceback" not in output, output[-3000:]
    documents = [line for line in output.splitlines() if line.startswith('{"') and '"checks"' in line]
    assert len(documents) == 1, output[-3000:]  # --json: the document is one line
    rest = "\n".join(line for line in output.splitlines() if line not in documents)
    return code, json.loads(documents[0]), rest, time.monotonic() - begin


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


def test_clock_offsets_warn_past_a_second_and_fail_past_what_the_dht_allows():
    lifetime = 30.0
    assert clock_check([0.2, -0.1, 0.3], [], lifetime).status == Status.PASS
    behind = clock_check([1.8, 2.2], [], lifetime)  # the peers' clocks are 2 s ahead: this one is behind
    assert behind.status == Status.WARN and "behind" in behind.detail and "timedatectl set-ntp true" in behind.remedy
    assert behind.figures["offset_seconds"] == pytest.approx(-2.0)
    # hivemind's DHT refuses initial peers more than 3 s off: such a peer could not even join
    refused = clock_check([-4.0], [], lifetime)
    assert refused.status == Status.FAIL and "3 s the DHT allows" in refused.detail
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


def test_a_gpu_that_torch_cannot_use_is_explained_by_what_the_machine_has():
    """The cases a CPU-only machine cannot provoke for real: the reason is a pure function of the driver and build."""
    assert "no NVIDIA driver is loaded" in no_cuda_reason("2.13.0", "12.6", "")
    cpu_build = no_cuda_reason("2.13.0+cpu", None, "550.54.14")
    assert "torch 2.13.0+cpu is a CPU-only build, but this machine has NVIDIA driver 550.54.14" in cpu_build
    assert "download.pytorch.org/whl/cu" in cpu_build
    old_driver = no_cuda_reason("2.13.0", "12.8", "470.42.01")
    assert "built for CUDA 12.8, which NVIDIA driver 470.42.01 cannot run" in old_driver
    assert "update the driver" in old_driver and "--device cpu" in old_driver


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


@pytest.mark.integration
def test_check_fetches_the_published_data_and_holds_it_to_data_cache(tmp_path):
    """The data rows through the program (their cases: tests/test_preflight_data.py): the index and a chunk from a
    real web server next to the manifest, and --data-cache reaching the disk row (no initial peers: exit 2 anyway)."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "doc.txt").write_text(" ".join(f"w{k % 89}" for k in range(3000)))
    prepare_corpus(str(text), tmp_path / "prepared", byte_tokenizer(), chunk_tokens=4096)
    data = {"source": "prepared", "index_sha256": index_sha256(tmp_path / "prepared")}
    (tmp_path / "swarm.json").write_text(json.dumps(tiny_manifest_dict(data=data)))
    server = ManifestServer(tmp_path)
    try:
        _, document, progress, _ = run_check(server.url("swarm.json"), "--data-cache", "6KiB")
    finally:
        server.close()
    found = statuses(document)
    assert list(found) == list(ORDER) and found["data_index"] == "pass", document
    assert (
        found["data_chunk"] in ("pass", "warn") and "SHA-256 verified" in check_named(document, "data_chunk")["detail"]
    )
    disk = check_named(document, "data_disk")
    assert disk["status"] == "fail" and "--data-cache 6.0 KiB cannot hold two chunks" in disk["detail"], disk
    assert "checking the training data's source" in progress


# ------------------------------------------------------------------------- the same verdicts at a real start


@pytest.mark.integration
@pytest.mark.slow(20)
def test_a_peer_whose_clock_is_seconds_off_is_refused_at_start_in_one_line_and_one_a_second_off_warned(
    live_swarm, start_peer
):
    """hivemind's DHT refuses to bootstrap from peers more than 3 s off, and says only that none could be reached."""
    begin = time.monotonic()
    refused = start_peer(live_swarm, module="tests.adversaries.skewed_clock_peer", env={"SKEWED_CLOCK_SECONDS": "6"})
    warned = start_peer(live_swarm, module="tests.adversaries.skewed_clock_peer", env={"SKEWED_CLOCK_SECONDS": "-2"})
    code = refused.process.wait(timeout=60)
    out = refused.output()
    assert code == 2, out[-3000:]
    assert "swarm-peer: error: this machine's clock is 6 s ahead of the peers'" in out, out[-3000:]
    assert "refuses peers more than 3 s off" in out and "timedatectl set-ntp true" in out
    assert "Traceback" not in out and "no initial peer could be reached" not in out
    warned.wait_for(r"warning: this machine's clock is 2\.\d s behind the peers'.*timedatectl", timeout=60)
    warned.wait_for(r"serving stage|trains only", timeout=60)
    assert time.monotonic() - begin < 60


@pytest.mark.integration
@pytest.mark.slow(30)
@pytest.mark.parametrize(
    "flags, too_slow, reason",
    [
        # a CPU 1000 times slower than the one serving stage 0: a microbatch routed through it would wait on it.
        # (100 times was too close: under a whole suite's load the stage-0 peer measured itself 4 times slower)
        (["--simulated-speed", "0.001"], True, "through a block"),
        (["--max-memory", "50MB"], False, "capped by --max-memory"),
    ],
    ids=["too-slow", "no-stage-fits"],
)
def test_a_cpu_peer_that_cannot_help_serving_trains_only_and_says_why(live_swarm, start_peer, flags, too_slow, reason):
    peer = start_peer(live_swarm, *flags, "--status-every", "1")
    event = peer.wait_for_event("trains_only", timeout=90)
    assert event["too_slow"] is too_slow and reason in event["reason"], event
    status = peer.wait_for_json(lambda line: "stage" in line and "event" not in line, what="a status line")
    assert status["stage"] is None and status["span"] is None  # it serves nothing, and runs on as a trainer
    assert "serving stage" not in peer.output() and peer.process.poll() is None
