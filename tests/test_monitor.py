"""swarm-monitor against a live local swarm: its API, its page in a real headless Chromium, a restart that keeps
its history, its trackers' files, and a swarm that disappears under it."""

from __future__ import annotations

import json
import os
import re
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, tiny_manifest_dict
from peers.swarm_monitor import main as monitor_main
from swarm.capacity.budget import format_memory
from swarm.local import processes
from swarm.local.processes import free_ports

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = ROOT / "test-artifacts"  # screenshots the browser test leaves for people to look at
HOSTILE_NAME = "<b>alice</b><script>x()</script>"  # printable, so a peer may announce it: it must show as text


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url: str) -> dict:
    return json.loads(get(url)[1])


def wait_until(condition, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_monitor(manifest: Path, tmp_path: Path, *flags: str, name: str = "monitor") -> processes.PeerProcess:
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    args = ["--join", str(manifest), "--port", "0", "--history", str(tmp_path / "history.sqlite"), "--json"]
    return processes.start_peer(
        [*args, "--every", "1", *flags], tmp_path / f"{name}.log", tmp_path / "cache", env, module="peers.swarm_monitor"
    )


def monitor_url(monitor: processes.PeerProcess) -> dict:
    return monitor.wait_for_json(lambda line: "url" in line, timeout=60, what="the monitor's URL")


def browser():
    """Headless Chromium through chromedriver, both from Debian's packages (.ci/run installs them)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail(
            "the browser test needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,2300"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def page_status(driver) -> str:
    """What the page's status card says, and the errors in its console (why it did not load)."""
    try:
        says = driver.execute_script("return document.getElementById('status-card').innerText")
        errors = [entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]
        return f"{says} (console errors: {errors})"
    except Exception as e:  # the page or the browser is gone: say so, the test fails anyway
        return f"(unreadable: {e!r})"


@pytest.mark.integration
@pytest.mark.slow(150)
def test_the_monitor_of_a_live_swarm_in_a_real_browser(start_peer, write_manifest, tmp_path, capsys):
    # no averaging: the monitor shows none of it here, and an averager is a process more per peer to start
    path = write_manifest(tiny_manifest_dict(averaging={"mode": "none"}), "swarm.json")
    # alice trains slowly (a device 20 times slower) so that the cores stay free for the monitor and the browser
    # (a fixed identity and port: she comes back at the manifest's address after the swarm has vanished)
    alice_flags = [
        "--stage",
        "1",
        "--public-name",
        HOSTILE_NAME,
        "--status-every",
        "1",
        "--simulated-speed",
        "0.05",
        "--identity",
        str(tmp_path / "alice.key"),
        "--host-maddrs",
        f"/ip4/127.0.0.1/tcp/{free_ports(1)[0]}",
    ]
    alice = start_peer(path, "--new-swarm", *alice_flags)  # fmt: skip
    alice.wait_for("wrote .*swarm.json")  # her address in the manifest: bob and the monitor start together
    bob = start_peer(path, "--stage", "0", "--public-name", "bob", "--no-trainer")
    monitors: list[processes.PeerProcess] = []
    driver = None
    try:
        monitors.append(start_monitor(path, tmp_path, "--tensorboard", str(tmp_path / "tb"), "--wandb", "swarm-test"))
        alice.wait_for("serving stage 1")
        bob.wait_for("serving stage 0")
        url = monitor_url(monitors[-1])["url"]
        # --- the API: peer-status' document, a history with a loss, Prometheus text, /healthz
        state = wait_until(
            lambda: (s := get_json(url + "api/v1/state"))["training"]["loss"] is not None
            and s["health"]["healthy"] and (s.get("data") or {}).get("readers") and s,
            90, "a healthy swarm with a loss",
        )  # fmt: skip
        assert state["monitor"]["status"] == "healthy" and state["swarm"]["name"] == "test-swarm"
        assert {p["public_name"] for p in state["peers"]} == {HOSTILE_NAME, "bob"}

        def history_with_losses() -> dict | None:
            series = get_json(url + "api/v1/history?window=hour")
            return series if sum(loss is not None for loss in series["loss"]) >= 2 else None

        history = wait_until(history_with_losses, 60, "two samples with a loss")
        assert history["stages"]["0"]["online_peers"][-1] == 1 and history["samples_per_second"][-1] > 0
        assert get(url + "healthz")[0] == 200
        metrics = get(url + "metrics")[1].decode()
        assert bob.peer_id() in metrics and alice.peer_id() in metrics
        assert "swarm_stage_throughput_samples_per_second" in metrics and "swarm_loss{" in metrics
        board = wait_until(
            lambda: [v for v in get_json(url + "api/v1/leaderboard")["volunteers"] if v["attested_samples"] > 0],
            60, "a volunteer with attested samples",
        )  # fmt: skip
        assert board[0]["public_name"] == "bob"  # alice's trainer vouches for bob, not for alice's own server

        # --- the page in a real browser: the data arrives, the tables and plots are drawn, names are text
        driver = browser()
        started = time.monotonic()
        driver.get(url)
        try:  # (a loaded 2-core machine runs a whole browser slowly)
            wait_until(lambda: driver.execute_script("return document.body.dataset.loaded === 'true'"), 90, "the page")
        except AssertionError as e:
            raise AssertionError(f"{e}; the page says {page_status(driver)!r}") from None
        load_seconds = time.monotonic() - started
        rows = driver.execute_script(
            "return [...document.querySelectorAll('#peers-table tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        )
        assert sorted(row[1] for row in rows) == sorted([HOSTILE_NAME, "bob"]), rows
        assert (
            driver.execute_script("return document.querySelectorAll('#peers-table b, #peers-table script').length") == 0
        )
        assert driver.execute_script("return document.querySelectorAll('#stage-list .stage-row').length") == 2
        check_spans_and_memory(driver, state)
        assert driver.find_element("id", "status").text == "healthy"
        assert driver.find_element("id", "data-read").text.endswith("%")  # of the epoch alice's trainer reads

        def points(plot: str, kind: str = "scatter") -> int:
            layer = ".barlayer .point" if kind == "bar" else ".scatterlayer .point"
            return driver.execute_script(f"return document.querySelectorAll('#{plot} {layer}').length")

        wait_until(lambda: points("loss-plot") >= 2 and points("speed-plot") >= 2, 30, "points in the plots")
        assert points("stage-plot", "bar") >= 2 and points("peers-plot") >= 2 and points("efficiency-plot") >= 1
        driver.find_element("css selector", "#windows button[data-window='day']").click()
        wait_until(lambda: points("loss-plot") >= 2, 10, "the day's loss plot")
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "monitor.png"))
        print(f"the page loaded with its data in {load_seconds:.2f} s")  # shown with pytest -s

        # --- a restart keeps the history (and the trackers wrote their files when it stopped)
        samples_before = get_json(url + "api/v1/history?window=all")["points"]
        monitors[-1].process.terminate()
        assert monitors[-1].process.wait(timeout=30) == 0
        monitors.append(start_monitor(path, tmp_path, name="monitor2"))
        restarted = monitor_url(monitors[-1])
        assert restarted["samples"] >= samples_before > 0
        url = restarted["url"]
        assert get_json(url + "api/v1/history?window=all")["loss"][0] == history["loss"][0]
        check_tracker_files(tmp_path)
        # a history file that is not one: a clear error and exit code 2, not a traceback
        corrupt = tmp_path / "corrupt.sqlite"
        corrupt.write_bytes(b"not a database" * 200)
        assert monitor_main(["--join", str(path), "--port", "0", "--history", str(corrupt)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("swarm-monitor: error:") and "not a readable SQLite database" in err, err

        # --- the swarm disappears: the page says so, the monitor keeps running
        alice.kill()
        bob.kill()
        wait_until(lambda: get(url + "healthz")[0] == 504, 90, "/healthz to say unreachable")
        driver.get(url)
        wait_until(lambda: driver.find_element("id", "status").text == "unreachable", 30, "the page to say unreachable")
        # it keeps sampling the unreachable swarm (two samples more, a second apart), and keeps running
        sampled = get_json(url + "api/v1/history?window=all")["points"]
        wait_until(
            lambda: monitors[-1].poll() is None and get_json(url + "api/v1/history?window=all")["points"] >= sampled + 2,
            30, "two more samples of the unreachable swarm", every=0.5,
        )  # fmt: skip
        assert monitors[-1].poll() is None and get_json(url + "api/v1/state")["monitor"]["reachable"] is False
        driver.save_screenshot(str(ARTIFACTS / "monitor-unreachable.png"))

        # --- alice comes back at the manifest's address: the monitor joins the DHT again and finds her
        start_peer(path, "--new-swarm", *alice_flags).wait_for("serving stage 1")
        wait_until(lambda: get(url + "healthz")[0] == 503, 90, "/healthz to say degraded (stage 0 unserved)")
        assert "joined the swarm's DHT again" in monitors[-1].output()
    finally:
        if driver is not None:
            driver.quit()
        processes.stop_peers(monitors, grace=15.0)


def check_spans_and_memory(driver, state: dict) -> None:
    """Each peer's stages and memory in the peers' table, and the coverage of each stage: here two peers, one a
    stage, so both stages are held by one peer (thin). tests/test_monitor_spans.py checks spans of several stages."""
    cells = driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#peers-table tbody tr')].map(r => "
        "[r.dataset.peerId, [r.querySelector('td.span').textContent, r.querySelector('td.memory').textContent]]))"
    )
    for peer in state["peers"]:
        stages, memory = cells[peer["peer_id"]]
        assert stages == f"stage {peer['stage']}", cells
        # what a peer holds changes from one read to the next; what it may use does not
        assert peer["memory_available"] > 0 and memory.endswith(f" of {format_memory(peer['memory_available'])}")
        assert re.fullmatch(r"\d+(\.\d\d GiB| MiB) of .*", memory), memory
    coverage = driver.execute_script(
        "return [...document.querySelectorAll('#coverage .coverage-stage')].map(b => [b.dataset.stage, b.className, "
        "b.querySelector('.coverage-peers').textContent, b.querySelector('.coverage-throughput').textContent])"
    )
    assert [row[:3] for row in coverage] == [
        ["0", "coverage-stage thin", "1 peer"],
        ["1", "coverage-stage thin", "1 peer"],
    ]
    assert all(re.fullmatch(r"\d+\.\d samples/s", row[3]) for row in coverage), coverage


def check_tracker_files(tmp_path: Path) -> None:
    """TensorBoard's event file and wandb's offline run, read back: both hold the swarm's loss."""
    from test_monitor_history import read_scalars

    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = read_scalars(events.read_bytes())
    assert scalars["swarm/loss"] and all(0 < loss < 10 for _, loss in scalars["swarm/loss"])
    assert scalars["swarm/peers_online"][-1][1] == 2
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    logged = wandb_history(run.read_bytes())
    assert any("swarm/loss" in row for row in logged) and all("swarm/tokens_trained" in row for row in logged)


def wandb_history(data: bytes) -> list[dict]:
    """The history rows of a .wandb file: a 7-byte header, then LevelDB-style records (checksum, length, type) in
    32 KiB blocks, each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    block, offset, pending, rows = 32768, 7, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_an_unreachable_swarm_exits_2_quickly(write_manifest, tmp_path, capsys):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEKYnHv3sXsjiyHYCaWwTAudbWmyGtnL2RZJUbA9FnEdV"
    started = time.monotonic()
    assert monitor_main(["--join", str(write_manifest(tiny_manifest_dict(initial_peers=[dead])))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("swarm-monitor: error:") and "no initial peer could be reached" in err, err
    for join in ("http://127.0.0.1:9/swarm.json", str(tmp_path / "missing.json")):
        assert monitor_main(["--join", join]) == 2
        err = capsys.readouterr().err
        assert err.startswith("swarm-monitor: error:") and "Traceback" not in err, err
    assert time.monotonic() - started < 60
    with pytest.raises(SystemExit) as exit_info:
        monitor_main(["--join", "x.json", "--every", "0"])
    assert exit_info.value.code == 2 and "--every" in capsys.readouterr().err


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        monitor_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "examples:" in out and "curl" in out and "/healthz" in out
