"""peer-status: the pure summary of a swarm's records, and the program against a live local swarm."""

from __future__ import annotations

import functools
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, tiny_manifest_dict
from peers.peer_status import main as status_main
from swarm.dht.records import Announcement, TrainerReport, announcement_lifetime
from swarm.local import processes
from swarm.manifests.loading import load_manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.watch.reader import SwarmReader
from swarm.watch.status import DEGRADED, HEALTHY, exit_code, find_peer, peer_status, swarm_health

NOW = 10_000.0
MANIFEST = manifest_from_dict(tiny_manifest_dict())  # 2 stages, announce period 1 s


def announcement(peer_id: str, stage: int, age: float = 0.5, state: str = "online", **fields) -> Announcement:
    expiration = NOW - age + announcement_lifetime(MANIFEST.network.announce_period)
    fields = {"throughput": 10.0, **fields}
    return Announcement(peer_id=peer_id, stage=stage, state=state, expiration=expiration, **fields)


def report(peer_id: str, loss: float, speed: float, samples: int = 100) -> TrainerReport:
    return TrainerReport(peer_id=peer_id, loss=loss, samples_per_second=speed, samples=samples, expiration=NOW + 2)


# ------------------------------------------------------------------------------------- pure summary


def test_a_peer_serving_a_span_counts_in_every_stage_of_it_and_shows_its_span():
    manifest = manifest_from_dict(
        tiny_manifest_dict(model={"depth": 4}, stages={"count": 4}, balancing={"spans": True})
    )
    wide = [announcement("wide", stage, throughput=5.0) for stage in range(1, 4)]  # one record a stage
    stages = [
        [announcement("first", 0, throughput=20.0), announcement("first", 1, throughput=20.0)],
        *[[r] for r in wide],
    ]
    stages[3].append(announcement("gone", 3, state="offline"))
    doc = swarm_health(manifest, stages, [], NOW)
    assert [row["online_peers"] for row in doc["stages"]] == [1, 2, 1, 1] and doc["health"]["healthy"]
    assert [row["throughput"] for row in doc["stages"]] == [20.0, 25.0, 5.0, 5.0]
    spans = {p["peer_id"]: p["span"] for p in doc["peers"]}
    assert spans == {"first": [0, 2], "wide": [1, 4], "gone": [3, 4]} and doc["swarm"]["peers_online"] == 2
    assert doc["health"]["bottleneck_stage"] in (2, 3)


def test_a_moving_peer_shows_the_span_it_serves_and_the_stages_it_takes_over():
    """During a move a peer has online records for its span and joining ones for the stages it takes over: shown
    as [0, 2] -> [2, 4], never as one wide span [0, 4]."""
    manifest = manifest_from_dict(
        tiny_manifest_dict(model={"depth": 4}, stages={"count": 4}, balancing={"spans": True})
    )
    stages = [
        [announcement("mover", 0)],
        [announcement("mover", 1)],
        [announcement("mover", 2, state="joining"), announcement("other", 2)],
        [announcement("mover", 3, state="joining"), announcement("other", 3)],
    ]
    peer = find_peer(swarm_health(manifest, stages, [], NOW), "mover")[0]
    assert peer["span"] == [0, 2] and peer["moving_to"] == [2, 4], peer
    assert find_peer(swarm_health(manifest, stages, [], NOW), "other")[0]["moving_to"] is None


def test_a_slow_read_does_not_make_a_fresh_peer_stale_and_departed_peers_are_told_apart():
    """Records are aged from the start of the read: a peer that refreshed its record 0.5 s before a read that took
    4 s (more than 2 announce periods) is online, not stale. A peer whose last record said offline and then
    disappeared 'left'; one whose online record just stopped coming 'vanished'."""
    reader = SwarmReader(MANIFEST, "m.json")
    began = NOW
    stages = [[announcement("fresh", 0), announcement("leaver", 0, state="offline")], [announcement("vanisher", 1)]]
    document = swarm_health(MANIFEST, stages, [], began)  # as read() computes it: from the read's start
    assert {p["peer_id"]: p["status"] for p in document["peers"]} == {
        "fresh": "online", "leaver": "offline", "vanisher": "online"
    }  # fmt: skip
    late = swarm_health(MANIFEST, stages, [], began + 4.0)  # what aging from the read's end would say
    assert {p["peer_id"]: p["status"] for p in late["peers"]}["fresh"] == "stale"
    reader.add_gone_peers(document, began)
    later = swarm_health(MANIFEST, [[announcement("fresh", 0, age=-9.5)], []], [], began + 10)  # refreshed since
    reader.add_gone_peers(later, began + 10)
    gone = {p["peer_id"]: (p["status"], p.get("departure")) for p in later["peers"]}
    assert gone == {"fresh": ("online", None), "leaver": ("gone", "left"), "vanisher": ("gone", "vanished")}, gone


def test_a_peer_that_took_its_stage_from_a_stale_checkpoint_says_how_many_steps_were_lost():
    """steps_behind travels in the record (an older peer's record has none: 0) into the document and the table."""
    from rich.console import Console

    from peers.peer_status import peers_table
    from swarm.dht.records import parse_announcement

    def read_back(ann: Announcement, without: tuple[str, ...] = ()) -> Announcement:
        record = {key: value for key, value in ann.to_record().items() if key not in without}
        parsed = parse_announcement(ann.peer_id, record, ann.stage, ann.expiration)
        assert parsed is not None
        return parsed

    recovered = read_back(announcement("12D3KooW" + "Behind" * 4, 0, steps_behind=12))
    older = read_back(announcement("12D3KooW" + "Fresh" * 4, 1, steps_behind=3), without=("steps_behind",))
    assert (recovered.steps_behind, older.steps_behind) == (12, 0)
    document = swarm_health(MANIFEST, [[recovered], [older]], [], NOW)
    assert {p["peer_id"][-5:]: p["steps_behind"] for p in document["peers"]} == {"ehind": 12, "Fresh": 0}
    console = Console(width=300, record=True)
    console.print(peers_table(document))
    rows = [[cell.strip() for cell in line.replace("┃", "│").split("│")] for line in console.export_text().splitlines()]
    header = next(row for row in rows if "behind" in row)
    behind = {row[header.index("peer")][-5:]: row[header.index("behind")] for row in rows if len(row) == len(header)}
    assert behind["ehind"] == "12 steps" and behind["Fresh"] == "-", behind


def test_peer_status_online_stale_offline():
    period = MANIFEST.network.announce_period
    assert peer_status(announcement("a", 0, age=0.5), NOW, period) == ("online", 0.5)
    assert peer_status(announcement("a", 0, age=0.5, state="joining"), NOW, period)[0] == "joining"
    assert peer_status(announcement("a", 0, age=2.5), NOW, period)[0] == "stale"
    assert peer_status(announcement("a", 0, state="offline"), NOW, period)[0] == "offline"


def test_healthy_swarm_summary():
    stages = [
        [announcement("peer-a", 0, throughput=30.0, samples_served=500, averaging_round=2, round_samples=100)],
        [
            announcement("peer-b", 1, throughput=10.0, averaging_round=2, round_samples=60, public_name="bob"),
            announcement("peer-c", 1, throughput=15.0, averaging_round=2, round_samples=40, reachable=False),
        ],
    ]
    reports = [report("peer-a", 2.0, 30.0), report("peer-b", 3.0, 10.0), report("peer-c", float("nan"), 0.0)]
    doc = swarm_health(MANIFEST, stages, reports, NOW, manifest_source="m.json")
    assert exit_code(doc) == HEALTHY and doc["health"]["unserved_stages"] == []
    assert doc["swarm"]["peers_online"] == 3 and doc["swarm"]["manifest"] == "m.json"
    assert doc["health"]["bottleneck_stage"] == 1 and doc["health"]["bottleneck_throughput"] == 25.0
    assert doc["health"]["balance_efficiency"] == 1.0  # 30 vs 25 is the best these three can do
    assert [row["online_peers"] for row in doc["stages"]] == [1, 2]
    assert doc["stages"][0]["samples_served"] == 500 and doc["stages"][1]["averaging_rounds"] == 2
    assert [p["reachable"] for p in doc["peers"] if p["peer_id"] == "peer-c"] == [False]
    training = doc["training"]
    assert training["trainers"] == 3 and training["samples_per_second"] == 40.0
    assert training["loss"] == pytest.approx(2.25)  # weighted by speed; NaN (no microbatch yet) left out
    # 2 rounds of every_samples, plus what the stage's peers did in the current round
    assert training["samples_trained"] == 2 * MANIFEST.averaging.every_samples + 100
    assert training["tokens_trained"] == training["samples_trained"] * MANIFEST.model.context_length
    json.dumps(doc)  # the --json document


def test_degraded_when_a_stage_has_no_online_peer():
    stages = [
        [announcement("peer-a", 0, age=2.5)],  # stale: it has missed announcements
        [announcement("peer-b", 1), announcement("peer-c", 1, state="joining")],
    ]
    doc = swarm_health(MANIFEST, stages, [], NOW)
    assert exit_code(doc) == DEGRADED and doc["health"]["unserved_stages"] == [0]
    assert doc["health"]["bottleneck_stage"] == 0
    assert {p["peer_id"]: p["status"] for p in doc["peers"]} == {
        "peer-a": "stale",
        "peer-b": "online",
        "peer-c": "joining",
    }
    assert doc["training"]["loss"] is None and doc["training"]["trainers"] == 0


def test_inefficient_assignment_is_reported():
    stages = [
        [announcement("a", 0, throughput=10.0), announcement("b", 0, throughput=10.0)],
        [announcement("c", 1, throughput=1.0)],
    ]
    doc = swarm_health(MANIFEST, stages, [], NOW)
    assert doc["health"]["balance_efficiency"] == pytest.approx(1 / 10)  # best: {a, c} and {b} gives 10


def test_too_few_peers_for_an_efficiency():
    doc = swarm_health(MANIFEST, [[announcement("a", 0)], []], [], NOW)
    assert doc["health"]["balance_efficiency"] is None


def test_a_peer_that_moved_is_one_row():
    stages = [[announcement("peer-a", 0, state="offline")], [announcement("peer-a", 1), announcement("peer-b", 1)]]
    doc = swarm_health(MANIFEST, stages, [], NOW)
    assert [(p["peer_id"], p["stage"], p["status"]) for p in doc["peers"]] == [
        ("peer-a", 1, "online"),
        ("peer-b", 1, "online"),
    ]
    assert [p["stage"] for p in find_peer(doc, "peer-a")] == [1]  # not ambiguous


def test_an_unserved_stage_is_the_bottleneck_even_on_a_tie():
    stages = [[announcement("peer-a", 0, throughput=0.0)], []]  # stage 0 served at 0 samples/s, stage 1 not at all
    assert swarm_health(MANIFEST, stages, [], NOW)["health"]["bottleneck_stage"] == 1


def test_find_peer_by_part_of_id_or_name():
    stages = [[announcement("12D3KooWAAAAbbbb", 0, public_name="alice")], [announcement("12D3KooWCCCCdddd", 1)]]
    doc = swarm_health(MANIFEST, stages, [], NOW)
    assert [p["stage"] for p in find_peer(doc, "bbbb")] == [0]
    assert [p["stage"] for p in find_peer(doc, "alice")] == [0]
    assert len(find_peer(doc, "12D3KooW")) == 2  # ambiguous: the program asks for more of the id
    assert find_peer(doc, "zz") == []  # too short to be a part of an id, and nobody's name


# ------------------------------------------------------------------------------ the program, live


def status_in_process(capsys, *flags: str) -> tuple[int, str, str]:
    """peer-status's main() in the test's process: what the program prints and returns, without the seconds of
    CPU that a new process spends importing torch and hivemind (the live test asks a dozen times)."""
    previous = signal.getsignal(signal.SIGTERM)  # main() makes SIGTERM its Ctrl-C
    try:
        code = status_main(list(flags))
    finally:
        signal.signal(signal.SIGTERM, previous)
    out, err = capsys.readouterr()
    return code, out, err


def status_json(capsys, *flags: str) -> tuple[int, dict]:
    code, out, err = status_in_process(capsys, *flags, "--json")
    assert code != 2 and out.strip(), err
    return code, json.loads(out)


def wait_for_document(capsys, join: str, accept, timeout: float = 90.0) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        code, doc = status_json(capsys, "--join", join)
        if accept(code, doc) or time.monotonic() > deadline:
            return code, doc
        time.sleep(0.5)


class StatusRuns:
    """peer-status processes run side by side (each loads torch and hivemind and joins the DHT: seconds apiece),
    each in a session of its own; whatever is left of them (their DHT processes and p2pd daemons too) is killed
    at the end."""

    def __init__(self):
        self.started: list[subprocess.Popen] = []

    def start(self, *flags: str, **options) -> subprocess.Popen:
        options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **options}
        run = subprocess.Popen(
            [sys.executable, "-m", "peers.peer_status", *flags], cwd=ROOT, start_new_session=True, **options
        )
        self.started.append(run)
        return run

    @staticmethod
    def result(run: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
        out, err = run.communicate(timeout=timeout)
        return run.returncode, out, err

    def close(self) -> None:
        for run in self.started:
            processes.signal_peer(run.pid, signal.SIGKILL)
            run.wait()


@pytest.fixture
def http_folder(tmp_path):
    """Serve tmp_path over HTTP on loopback."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.integration
@pytest.mark.slow(160)
def test_peer_status_of_a_live_swarm(start_peer, write_manifest, http_folder, capsys):
    # no averaging: peer-status reads no round here, and an averager is a process more per peer to start
    path = write_manifest(tiny_manifest_dict(averaging={"mode": "none"}), "swarm.json")
    # alice's trainer trains all along: as a device 20 times slower (her stage, the last, paces the pipeline), so
    # that it leaves the cores to peer-status and the other tests
    flags = ["--public-name", "alice", "--status-every", "1", "--simulated-speed", "0.05"]
    alice = start_peer(path, "--new-swarm", "--stage", "1", *flags)
    alice.wait_for("wrote .*swarm.json")
    manifest = load_manifest(path)
    assert alice.maddr() in manifest.initial_peers  # --new-swarm wrote its address into the manifest
    alice.wait_for("serving stage 1")

    # alone on stage 1: stage 0 is not served
    # (alice's record may show her stale for a moment on a loaded machine: her 1 s refreshes run late)
    code, doc = wait_for_document(
        capsys, str(path), lambda code, doc: len(doc["peers"]) == 1 and doc["peers"][0]["status"] == "online"
    )
    assert code == DEGRADED and doc["health"]["unserved_stages"] == [0], doc
    assert doc["swarm"]["swarm_id"] == manifest.swarm_id and doc["peers"][0]["public_name"] == "alice"

    # through the initial peer that --new-swarm wrote; one trainer (alice's) is enough and spares the CPU
    bob = start_peer(path, "--stage", "0", "--public-name", "bob", "--no-trainer")
    bob.wait_for("serving stage 0")
    # alice's trainer has a loss (its own status line says so) before peer-status is asked
    alice.wait_for_json(lambda line: line.get("trainer_loss") is not None, timeout=90, what="a trainer loss")
    code, doc = wait_for_document(
        capsys,
        str(path),
        lambda code, doc: (
            code == HEALTHY
            and doc["training"]["loss"] is not None
            and doc["training"]["trainers"] == 1
            and (doc["data"] or {}).get("readers") == 1
        ),
    )
    assert code == HEALTHY, doc
    # alice's trainer says what it reads (a raw source: the data its records name)
    (reader,) = doc["data"]["trainers"]
    assert reader["peer_id"] == alice.peer_id() and doc["data"]["chunks"] > 0 and len(doc["data"]["data"]) == 64
    names = {p["public_name"]: p for p in doc["peers"]}
    assert set(names) == {"alice", "bob"} and all(p["status"] == "online" for p in names.values())
    assert names["alice"]["stage"] == 1 and names["bob"]["stage"] == 0
    assert names["alice"]["peer_id"] == alice.peer_id() and names["alice"]["reachable"] is True
    assert all(p["device"] == "cpu" and p["version"] and p["uptime"] > 0 for p in names.values())
    assert doc["swarm"]["peers_online"] == 2 and doc["swarm"]["name"] == "test-swarm"
    assert [row["online_peers"] for row in doc["stages"]] == [1, 1]
    assert all(row["throughput"] > 0 for row in doc["stages"])
    assert doc["health"]["balance_efficiency"] == 1.0
    assert doc["training"]["samples_per_second"] > 0 and 0 < doc["training"]["loss"] < 10

    runs = StatusRuns()
    try:
        # the two peer-status processes start at once (each loads torch and hivemind: seconds), and the checks in
        # this process run while they do: the rich tables, and --watch, whose first document is read before bob dies
        tables = runs.start("--join", str(path))
        watch = runs.start("--join", str(path), "--watch", "1", "--json", stderr=subprocess.DEVNULL)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout], daemon=True).start()

        # the program itself: the rich tables (piped, as a script would read them)
        code, out, err = runs.result(tables)
        assert code == HEALTHY, err
        for text in ("test-swarm", manifest.swarm_id, "healthy", "alice", "bob", alice.peer_id()[-8:], "training:",
                     "chunks finished"):  # fmt: skip
            assert text in out, (text, out)

        # one peer in detail, a peer nobody is
        code, out, err = status_in_process(capsys, "--join", str(path), "--peer", "alice", "--json")
        assert code == 0 and json.loads(out)["peer_id"] == alice.peer_id(), err
        code, out, err = status_in_process(capsys, "--join", str(path), "--peer", "nobody")
        assert code == DEGRADED and "no peer matches" in err

        # joined through a peer's multiaddr, and through an HTTP URL that names the swarm id
        for join in (bob.maddr(), f"{http_folder}/swarm.json#{manifest.swarm_id}"):
            code, doc = status_json(capsys, "--join", join)
            assert code == HEALTHY and doc["swarm"]["swarm_id"] == manifest.swarm_id, join
            assert {p["public_name"] for p in doc["peers"]} == {"alice", "bob"}

        # --watch, a process of its own: bob dies; he shows as stale or gone, and the swarm as degraded
        def next_document() -> dict:
            try:
                return json.loads(lines.get(timeout=60))  # a watch that stalls fails the test instead of hanging it
            except queue.Empty:
                raise AssertionError(
                    f"peer-status --watch printed nothing for 60 s (exit status {watch.poll()})"
                ) from None

        first = next_document()
        assert first["health"]["healthy"]
        bob.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            doc = next_document()
            bob_now = [p for p in doc["peers"] if p["public_name"] == "bob"]
            if bob_now and bob_now[0]["status"] == "gone":
                break
        assert bob_now and bob_now[0]["status"] == "gone", doc["peers"]
        assert not doc["health"]["healthy"] and doc["health"]["unserved_stages"] == [0]
        watch.send_signal(signal.SIGINT)
        try:
            watch.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    finally:
        runs.close()


def test_unreachable_swarm_exits_2_quickly(write_manifest, capsys):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEKYnHv3sXsjiyHYCaWwTAudbWmyGtnL2RZJUbA9FnEdV"
    for raw, message in (
        (tiny_manifest_dict(initial_peers=[dead]), "no initial peer could be reached"),
        (tiny_manifest_dict(), "lists no initial peers"),
    ):
        started = time.monotonic()
        assert status_main(["--join", str(write_manifest(raw))]) == 2
        err = capsys.readouterr().err
        assert err.startswith("peer-status: error:") and message in err, err
        assert time.monotonic() - started < 30


def test_bad_join_arguments_exit_2(tmp_path, capsys):
    for join in ("http://127.0.0.1:9/swarm.json", str(tmp_path / "missing.json"), str(ROOT / "README.md")):
        started = time.monotonic()
        assert status_main(["--join", join]) == 2
        err = capsys.readouterr().err
        assert err.startswith("peer-status: error:") and "Traceback" not in err, err
        assert time.monotonic() - started < 30
    with pytest.raises(SystemExit) as exit_info:
        status_main(["--join", "x.json", "--watch", "0"])
    assert exit_info.value.code == 2 and "--watch" in capsys.readouterr().err  # argparse's usage error


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        status_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "examples:" in out and "exit codes" in out
