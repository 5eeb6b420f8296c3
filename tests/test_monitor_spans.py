"""swarm-monitor of a swarm whose peers serve spans: each peer's stages and memory, and the per-stage coverage, in
the API (a real HTTP server on loopback) and on the page (a real headless Chromium), from real records: what
peers of today announce (spans, memory) beside a peer of an older swarm (no memory in its record)."""

from __future__ import annotations

import json
import time
import urllib.request

from test_monitor import ARTIFACTS, browser, page_status, wait_until

from conftest import tiny_manifest_dict
from swarm.capacity.budget import format_memory
from swarm.dht.records import Announcement, announcement_lifetime, parse_announcement
from swarm.manifests.validation import manifest_from_dict
from swarm.monitor.history import History
from swarm.monitor.leaderboard import Leaderboard
from swarm.monitor.server import MonitorServer, MonitorState
from swarm.watch.status import swarm_health

MANIFEST = manifest_from_dict(tiny_manifest_dict(model={"depth": 4}, stages={"count": 4}, balancing={"spans": True}))
GIB, MIB = 1 << 30, 1 << 20
# stage 0: first and past; stage 1: first and wide; stage 2: wide alone (thin); stage 3: nobody online (gone is offline)
FIRST, WIDE = (
    dict(memory_used=3 * GIB // 2, memory_available=6 * GIB),
    dict(memory_used=600 * MIB, memory_available=3 * GIB),
)


def read_back(ann: Announcement, without: tuple[str, ...] = ()) -> Announcement:
    """`ann` as a monitor reads it from the DHT: its record, less the fields `without` (an older peer's), parsed."""
    record = {key: value for key, value in ann.to_record().items() if key not in without}
    parsed = parse_announcement(ann.peer_id, record, ann.stage, ann.expiration)
    assert parsed is not None
    return parsed


def span_swarm(now: float) -> dict:
    """peer-status' document of a 4-stage swarm: `first` serves stages 0-1, `wide` 1-2 (one record a stage, each
    with its span's rate), `past` stage 0 with a record from before memory was announced, `gone` stage 3 (offline).
    Each peer's public name is its name above; its id ends with it."""
    expiration = now - 0.2 + announcement_lifetime(MANIFEST.network.announce_period)

    def ann(name: str, stage: int, throughput: float, state: str = "online", **fields) -> Announcement:
        peer_id = f"12D3KooW{name.capitalize() * 4}"
        return Announcement(peer_id, stage, state, throughput, expiration=expiration, public_name=name, **fields)

    stages = [
        [ann("first", 0, 20.0, **FIRST), read_back(ann("past", 0, 8.0), without=("memory_used", "memory_available"))],
        [ann("first", 1, 20.0, **FIRST), ann("wide", 1, 5.0, **WIDE)],
        [ann("wide", 2, 5.0, **WIDE)],
        [ann("gone", 3, 0.0, state="offline")],
    ]
    return swarm_health(MANIFEST, [[read_back(a) for a in anns] for anns in stages], [], now)


def serve(document: dict, tmp_path) -> tuple[MonitorServer, History]:
    history = History(tmp_path / "h.sqlite", MANIFEST.swarm_id)
    server = MonitorServer(MonitorState(document, True), history, Leaderboard(history), "127.0.0.1", 0)
    server.start()
    return server, history


def test_the_api_shows_each_peers_span_and_memory_and_each_stages_coverage(tmp_path):
    server, history = serve(span_swarm(time.time()), tmp_path)
    try:
        with urllib.request.urlopen(server.url + "api/v1/state", timeout=10) as response:
            state = json.loads(response.read())
    finally:
        server.stop()
        history.close()
    peers = {p["public_name"]: p for p in state["peers"]}
    assert {name: p["span"] for name, p in peers.items()} == {"first": [0, 2], "wide": [1, 3], "past": [0, 1],
                                                               "gone": [3, 4]}  # fmt: skip
    assert (peers["first"]["memory_used"], peers["first"]["memory_available"]) == (3 * GIB // 2, 6 * GIB)
    assert (peers["wide"]["memory_used"], peers["wide"]["memory_available"]) == (600 * MIB, 3 * GIB)
    assert (peers["past"]["memory_used"], peers["past"]["memory_available"]) == (0, 0)  # not announced: shown as "-"
    # coverage: a span peer counts, with its span's rate, in every stage of its span
    assert [s["online_peers"] for s in state["stages"]] == [2, 2, 1, 0]
    assert [s["throughput"] for s in state["stages"]] == [28.0, 25.0, 5.0, 0.0]
    assert state["health"]["unserved_stages"] == [3] and state["monitor"]["status"] == "degraded"


def test_the_page_shows_spans_memory_and_coverage_in_a_real_browser(tmp_path):
    document = span_swarm(time.time())
    past = next(p for p in document["peers"] if p["public_name"] == "past")
    del past["span"]  # as a document from before spans has it: the page shows "-", not an error
    server, history = serve(document, tmp_path)
    driver = None
    try:
        driver = browser()
        driver.get(server.url)
        try:
            wait_until(lambda: driver.execute_script("return document.body.dataset.loaded === 'true'"), 60, "the page",
                       every=0.2)  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"{e}; the page says {page_status(driver)!r}") from None
        rows = driver.execute_script(
            "return Object.fromEntries([...document.querySelectorAll('#peers-table tbody tr')].map(r => "
            "[r.cells[1].textContent, [r.querySelector('td.span').textContent, r.querySelector('td.memory').textContent]]))"
        )
        assert rows == {
            "first": ["stages 0-1", f"{format_memory(3 * GIB // 2)} of {format_memory(6 * GIB)}"],
            "wide": ["stages 1-2", "600 MiB of 3.00 GiB"],
            "past": ["-", "-"],
            "gone": ["stage 3", "-"],
        }, rows
        assert rows["first"][1] == "1.50 GiB of 6.00 GiB"
        coverage = driver.execute_script(
            "return [...document.querySelectorAll('#coverage .coverage-stage')].map(b => "
            "[b.dataset.stage, b.className, b.querySelector('.coverage-peers').textContent, "
            "b.querySelector('.coverage-throughput').textContent])"
        )
        assert coverage == [
            ["0", "coverage-stage", "2 peers", "28.0 samples/s"],
            ["1", "coverage-stage", "2 peers", "25.0 samples/s"],
            ["2", "coverage-stage thin", "1 peer", "5.0 samples/s"],
            ["3", "coverage-stage thin unserved", "0 peers", "0.0 samples/s"],
        ], coverage
        # the stage list names a span peer under every stage of its span
        chips = driver.execute_script(
            "return [...document.querySelectorAll('#stage-list .stage-row')].map(r => "
            "[...r.querySelectorAll('.chip')].map(c => c.textContent.split(' ')[0]).sort())"
        )
        assert chips[1] == ["first", "wide"] and chips[2] == ["wide"], chips
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "monitor-spans.png"))
    finally:
        if driver is not None:
            driver.quit()
        server.stop()
        history.close()
