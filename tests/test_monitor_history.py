"""swarm-monitor's library without processes: the SQLite history, the leaderboard's counting, the swarm's
Prometheus text, the trackers' files and the page's routes, over documents made by swarm/watch/status.py."""

from __future__ import annotations

import json
import math
import sqlite3
import struct
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import tiny_manifest_dict
from swarm.dht.records import Announcement, TrainerReport, announcement_lifetime
from swarm.errors import HistoryError, SwarmError
from swarm.manifests.validation import manifest_from_dict
from swarm.monitor.history import THIN_EVERY, History
from swarm.monitor.leaderboard import Leaderboard, advance, disagreement
from swarm.monitor.prometheus import swarm_metrics
from swarm.monitor.sampling import peer_rows, stage_rows, swarm_sample
from swarm.monitor.server import MonitorServer, MonitorState
from swarm.monitor.trackers import TensorBoardTracker, WandbTracker, scalars
from swarm.watch.status import swarm_health

MANIFEST = manifest_from_dict(tiny_manifest_dict())  # 2 stages, announce period 1 s
ALICE = "12D3KooWAliceAliceAliceAliceAliceAliceAliceAlice11"
BOB = "12D3KooWBobBobBobBobBobBobBobBobBobBobBobBobBob111"
TRAINER = "12D3KooWTrainerTrainerTrainerTrainerTrainerTrain1"


def document(now: float, served: int = 100, attested: int = 100, loss: float = 3.0, name: str = "alice") -> tuple:
    """A healthy two-peer swarm at `now`: alice (stage 0) and bob (stage 1), and one trainer's report."""
    expiration = now - 0.2 + announcement_lifetime(MANIFEST.network.announce_period)
    stages = [
        [Announcement(ALICE, 0, "online", 20.0, samples_served=served, averaging_rounds=3, public_name=name,
                      expiration=expiration)],
        [Announcement(BOB, 1, "online", 10.0, samples_served=served, expiration=expiration)],
    ]  # fmt: skip
    report = TrainerReport(
        TRAINER, loss, 5.0, attested, served=((ALICE, attested), (BOB, attested)), expiration=now + 2
    )
    return swarm_health(MANIFEST, stages, [report], now), [report]


def record(history: History, doc: dict, now: float, reachable: bool = True) -> None:
    history.record(swarm_sample(doc, reachable, now), stage_rows(doc, reachable), peer_rows(doc, reachable))


def test_samples_go_in_and_come_out_as_aligned_series(tmp_path):
    history = History(tmp_path / "h.sqlite", MANIFEST.swarm_id)
    for k in range(10):
        doc, _ = document(1000.0 + k, loss=3.0 - k / 10)
        record(history, doc, 1000.0 + k)
    doc, _ = document(1010.0)
    record(history, doc, 1010.0, reachable=False)  # the swarm vanished: a gap, and no peers online
    series = history.series("hour", 1011.0)
    assert series["points"] == 11 and len(series["time"]) == 11
    assert series["loss"][:3] == [3.0, 2.9, 2.8] and series["loss"][-1] is None
    assert series["reachable"] == [1] * 10 + [0]
    assert series["stages"]["0"]["online_peers"] == [1] * 10 + [0]
    assert series["stages"]["1"]["throughput"][0] == 10.0
    assert json.dumps(series, allow_nan=False)  # nothing a browser's JSON parser would refuse
    with pytest.raises(HistoryError, match="unknown window"):
        history.series("fortnight", 1011.0)


def test_old_samples_are_thinned_not_dropped(tmp_path):
    """A day of samples every 5 s: the last hour stays whole, older ones one a minute; a month old one stays."""
    history = History(tmp_path / "h.sqlite", MANIFEST.swarm_id)
    doc, _ = document(0.0)
    now = 40 * 86400.0
    record(history, doc, now - 35 * 86400.0)  # a sample from a month ago
    times = [now - 86400.0 + 5.0 * k for k in range(int(86400 / 5))]
    for t in times:
        record(history, doc, t)
    kept = [row[0] for row in history.execute("SELECT time FROM samples ORDER BY time")]
    last_hour = [t for t in kept if t >= now - 3600]
    older = [t for t in kept if now - 86400 <= t < now - 3600 - THIN_EVERY * 5]
    assert len(last_hour) >= 3600 / 5 - 1, len(last_hour)  # every sample of the last hour
    assert 23 * 60 * 0.95 <= len(older) <= 23 * 60 + 2, len(older)  # one a minute before
    assert kept[0] == now - 35 * 86400.0  # the oldest sample is thinned, never dropped
    stage_rows_left = history.execute("SELECT count(*) FROM stage_samples")[0][0]
    assert stage_rows_left == 2 * len(kept)  # the stages' rows go with their samples
    assert history.series("all", now)["points"] <= 1500


def test_a_restarted_monitor_keeps_its_history_and_counts(tmp_path):
    path = tmp_path / "h.sqlite"
    history = History(path, MANIFEST.swarm_id)
    board = Leaderboard(history)
    doc, reports = document(1000.0, served=100, attested=80)
    record(history, doc, 1000.0)
    board.update(doc, reports, 1000.0)
    history.close()

    history = History(path, MANIFEST.swarm_id)  # a restart
    board = Leaderboard(history)
    assert history.sample_count() == 1
    # the peers and the trainer restarted too: their counters start again from zero, the totals go on
    doc, reports = document(1005.0, served=30, attested=20)
    record(history, doc, 1005.0)
    board.update(doc, reports, 1005.0)
    doc, reports = document(1010.0, served=60, attested=50)
    board.update(doc, reports, 1010.0)
    rows = {row["public_name"] or row["short_id"]: row for row in board.rows()}
    assert rows["alice"]["claimed_samples"] == 160 and rows["alice"]["attested_samples"] == 130
    assert rows["alice"]["averaging_rounds"] == 3 and rows["alice"]["rank"] in (1, 2)
    assert rows["alice"]["hours_online"] == pytest.approx(5 / 3600, abs=1e-3)  # the gap across the restart: not counted


def test_counters_bank_what_they_had_when_they_restart():
    assert advance(0, 0, 10) == (0, 10)
    assert advance(0, 10, 25) == (0, 25)
    assert advance(0, 25, 5) == (25, 5)  # restarted: 25 banked
    assert advance(25, 5, -3) == (30, 0)  # a negative count is read as zero


def test_disagreement_beyond_noise_is_flagged():
    assert disagreement(1000, 900, 50) is None  # within noise
    assert disagreement(1000, 400, 500) is None  # its own trainer's samples count on its side
    assert disagreement(10_000, 1_000, 0) == "claims more than trainers attest"
    assert disagreement(1_000, 10_000, 0) == "trainers attest more than it claims"
    assert disagreement(150, 0, 0) is None  # too few samples to say


def test_a_peer_that_claims_ten_times_what_trainers_attest_is_flagged_on_the_board(tmp_path):
    history = History(tmp_path / "h.sqlite", MANIFEST.swarm_id)
    board = Leaderboard(history)
    doc, reports = document(1000.0, served=50_000, attested=5_000)
    board.update(doc, reports, 1000.0)
    assert {row["disagreement"] for row in board.rows()} == {"claims more than trainers attest"}


def test_corrupt_foreign_and_other_swarms_files_are_refused_clearly(tmp_path):
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(HistoryError, match="not a readable SQLite database.*--history"):
        History(corrupt, MANIFEST.swarm_id)
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE invoices (id INTEGER)")
    with pytest.raises(HistoryError, match="something else .*invoices"):
        History(foreign, MANIFEST.swarm_id)
    History(tmp_path / "ours.sqlite", "aaaaaaaaaaaaaaaa").close()
    with pytest.raises(HistoryError, match="history of swarm aaaaaaaaaaaaaaaa"):
        History(tmp_path / "ours.sqlite", MANIFEST.swarm_id)
    (tmp_path / "folder.sqlite").mkdir()
    with pytest.raises(HistoryError, match="pass another --history"):
        History(tmp_path / "folder.sqlite", MANIFEST.swarm_id)


def test_prometheus_text_of_the_whole_swarm():
    doc, _ = document(1000.0, name='eve"}\nfake_metric 1')
    families = {f.name: f for f in text_string_to_metric_families(swarm_metrics(doc, True, 7).decode())}
    assert families["swarm_healthy"].samples[0].value == 1
    assert families["swarm_loss"].samples[0].value == 3.0
    throughput = {s.labels["stage"]: s.value for s in families["swarm_stage_throughput_samples_per_second"].samples}
    assert throughput == {"0": 20.0, "1": 10.0}
    peers = {s.labels["peer_id"]: s for s in families["swarm_monitor_peer_throughput_samples_per_second"].samples}
    assert peers[ALICE].labels == {"swarm_id": MANIFEST.swarm_id, "peer_id": ALICE, "stage": "0"}
    names = {s.labels["public_name"] for s in families["swarm_monitor_peer_info"].samples}
    assert 'eve"}\nfake_metric 1' in names and "fake_metric" not in families  # a label value, escaped
    unreachable = {f.name for f in text_string_to_metric_families(swarm_metrics(doc, False, 7).decode())}
    assert unreachable == {"swarm_monitor_reachable", "swarm_monitor_samples"}


def test_tensorboard_scalars_can_be_read_back(tmp_path):
    tracker = TensorBoardTracker(tmp_path / "tb")
    for k in range(3):
        doc, _ = document(1000.0 + k, loss=3.0 - k / 10)
        doc["training"]["tokens_trained"] = 1000 * k
        tracker.log(doc, 1000.0 + k)
    tracker.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    values = read_scalars(events.read_bytes())
    assert values["swarm/loss"] == [(0, 3.0), (1000, pytest.approx(2.9)), (2000, pytest.approx(2.8))]
    assert set(scalars(doc)) <= set(values) and values["stage1/online_peers"][0][1] == 1


def read_scalars(data: bytes) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's event file: TFRecords (length, its CRC, an Event protobuf, its CRC), read with tensorboardX's
    own protobuf classes."""
    from tensorboardX.proto.event_pb2 import Event

    values: dict[str, list[tuple[int, float]]] = {}
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        event = Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            values.setdefault(value.tag, []).append((event.step, value.simple_value))
    return values


def test_the_pages_routes(tmp_path):
    history = History(tmp_path / "h.sqlite", MANIFEST.swarm_id)
    board = Leaderboard(history)
    now = time.time()
    doc, reports = document(now, name="<img src=x onerror=alert(1)>")
    doc["peers"][0]["throughput"] = math.nan  # a NaN that got this far must not break the JSON
    record(history, doc, now)
    board.update(doc, reports, now)
    state = MonitorState(doc, True)
    server = MonitorServer(state, history, board, "127.0.0.1", 0)
    server.start()
    try:

        def get(path: str, **headers) -> tuple[int, dict, bytes]:
            request = urllib.request.Request(server.url.rstrip("/") + path, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status, dict(response.headers), response.read()
            except urllib.error.HTTPError as e:
                return e.code, dict(e.headers), e.read()

        code, headers, body = get("/")
        assert code == 200 and b'src="/static/plotly.min.js"' in body and "default-src 'self'" in headers[
            "Content-Security-Policy"]  # fmt: skip
        code, headers, body = get("/static/plotly.min.js", **{"Accept-Encoding": "gzip"})
        assert code == 200 and headers["Content-Encoding"] == "gzip" and len(body) > 500_000
        for name in ("monitor.js", "monitor.css"):
            assert get(f"/static/{name}")[0] == 200
        code, _, body = get("/api/v1/state")
        state_doc = json.loads(body)
        assert state_doc["monitor"]["status"] == "healthy" and state_doc["peers"][0]["throughput"] is None
        assert state_doc["peers"][0]["public_name"] == "<img src=x onerror=alert(1)>"  # data, shown as text
        assert json.loads(get("/api/v1/history?window=day")[2])["points"] == 1
        assert get("/api/v1/history?window=<script>")[0] == 400
        assert json.loads(get("/api/v1/leaderboard")[2])["volunteers"][0]["attested_samples"] == 100
        assert get("/healthz")[0] == 200
        doc_degraded = json.loads(json.dumps(state_doc))
        doc_degraded["health"]["healthy"] = False
        state.update(doc_degraded, True)
        assert get("/healthz")[0] == 503
        state.update(doc_degraded, False, "no peer answers")
        code, _, body = get("/healthz")
        assert code == 504 and json.loads(body) == {"status": "unreachable", "exit_code": 2}
        assert b"swarm_monitor_reachable" in get("/metrics")[2]
        assert get("/static/../../etc/passwd")[0] == 404 and get("/nope")[0] == 404
    finally:
        server.stop()
        history.close()


def test_a_tracker_whose_extra_is_missing_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # what `import tensorboardX` does when it is missing
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SwarmError, match=r"pip install 'swarm\[tensorboard\]'"):
        TensorBoardTracker(tmp_path / "tb")
    with pytest.raises(SwarmError, match=r"pip install 'swarm\[wandb\]'"):
        WandbTracker("project", "run", {})
