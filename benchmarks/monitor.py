"""Monitor benchmark: swarm-monitor's memory with 10,000 samples of history, the size of its history, and how long
its page takes to load in a real browser.

    python -m benchmarks.monitor [--samples 10000] [--peers 16]

1. History: `--samples` samples of a synthetic swarm of `--peers` peers (2 stages) and half as many trainers,
   5 s apart and ending now, go through the monitor's own code (History.record, Leaderboard.update), as the
   sampler writes them; then more, up to a whole day. Reported: the time per sample, the file's size at 10,000
   samples and after a day (thinned as it goes), and a month's size estimated from the thinning tiers.
2. Memory: a real 2-peer swarm on loopback, and swarm-monitor started on that history (its samples are of the
   same swarm id); after 30 more samples (one a second), and again after `--watch` seconds more, the resident
   memory of the monitor's processes (its Python process, hivemind's DHT process, the p2pd daemon and torch's
   shared-memory manager: shared pages counted in each), and of the monitor's own Python process alone.
3. Page load: headless Chromium (Debian's, through selenium) opens the page: seconds from the navigation until
   the data has arrived and every plot is drawn, for the "hour" window and for "all" (10,000+ samples, which the
   history bucketes to at most 1,500 points), cold (first visit) and warm (plotly.js cached).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from swarm.dht.records import Announcement, TrainerReport, announcement_lifetime
from swarm.local import processes
from swarm.local.fast_swarm import fast_test_swarm_dict
from swarm.manifests.loading import load_manifest
from swarm.monitor.history import THINNING, History
from swarm.monitor.leaderboard import Leaderboard
from swarm.monitor.sampling import peer_rows, stage_rows, swarm_sample
from swarm.watch.status import swarm_health

PERIOD = 5.0  # seconds between samples, the monitor's default


def peer_id(k: int) -> str:
    return "12D3KooW" + f"Peer{k:04d}".ljust(44, "x")


def synthetic_document(manifest, peers: int, now: float, k: int) -> tuple[dict, list[TrainerReport]]:
    lifetime = announcement_lifetime(manifest.network.announce_period)
    stages: list[list[Announcement]] = [[] for _ in range(manifest.num_stages)]
    for p in range(peers):
        stage = p % manifest.num_stages
        stages[stage].append(
            Announcement(
                peer_id(p), stage, "online", 10.0 + p, delivered_throughput=5.0, samples_served=k * 8 + p,
                averaging_round=k // 100, averaging_rounds=k // 100, public_name=f"volunteer-{p}",
                activation_bytes_sent=k * 1000, expiration=now - 0.5 + lifetime,
            )
        )  # fmt: skip
    reports = [
        TrainerReport(peer_id(t), 3.0 - k / 10_000, 4.0, k * 4, served=tuple((peer_id(p), k) for p in range(peers)
                      if p != t), own_samples=k, expiration=now + 2)
        for t in range(0, peers, 2)
    ]  # fmt: skip
    return swarm_health(manifest, stages, reports, now), reports


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fill_history(path: Path, manifest, samples: int, peers: int) -> dict:
    """Write a day of samples ending now (or `samples`, if more), as the monitor does; figures at `samples`."""
    day = int(86400 / PERIOD)
    total = max(samples, day)
    now = time.time()
    history = History(path, manifest.swarm_id)
    board = Leaderboard(history)
    rss_before = rss_mb()
    figures: dict = {}
    started = time.perf_counter()
    for k in range(total):
        when = now - PERIOD * (total - k)
        doc, reports = synthetic_document(manifest, peers, when, k)
        history.record(swarm_sample(doc, True, when), stage_rows(doc, True), peer_rows(doc, True))
        board.update(doc, reports, when)
        if k + 1 == samples:
            figures.update(
                samples_written=samples,
                ms_per_sample=round((time.perf_counter() - started) / samples * 1000, 2),
                history_mb_at_samples=round(path.stat().st_size / 1e6, 2),
                sampler_rss_growth_mb=round(rss_mb() - rss_before, 1),
            )
    kept = history.sample_count()
    history.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    history.close()
    size = path.stat().st_size
    # a month at PERIOD: every sample of the last hour, then one per tier bucket
    month, young = 0.0, 0.0
    for age, bucket in THINNING:
        if age > young:
            span = min(age, 30 * 86400.0) - young
            month += span / PERIOD if bucket == 0 else max(span, 0) / bucket
        young = min(age, 30 * 86400.0)
    figures.update(
        day_samples_written=total,
        day_samples_kept=kept,
        day_history_mb=round(size / 1e6, 2),
        month_samples_kept_estimate=round(month),
        month_history_mb_estimate=round(size / kept * month / 1e6, 2),
        peers=peers,
    )
    return figures


def page_load_seconds(url: str) -> dict:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,2300"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    drawn = """return document.body.dataset.loaded === 'true' &&
        ['loss-plot', 'speed-plot', 'peers-plot', 'efficiency-plot'].every(
            id => document.querySelectorAll('#' + id + ' .scatterlayer .point').length > 0)"""
    figures = {}
    try:
        for label, window in (("cold_hour", "hour"), ("warm_hour", "hour"), ("warm_all", "all")):
            started = time.perf_counter()
            driver.get(f"{url}?window={window}")
            while not driver.execute_script(drawn):
                if time.perf_counter() - started > 60:
                    raise RuntimeError(f"the page did not draw its plots within 60 s ({label})")
                time.sleep(0.02)
            figures[f"page_load_{label}_s"] = round(time.perf_counter() - started, 2)
        figures["points_all"] = driver.execute_script("return document.getElementById('loss-plot').data[0].x.length")
    finally:
        driver.quit()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--watch", type=float, default=120.0, help="seconds the monitor runs between two readings")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swarm-monitor-bench-"))
    manifest_path = work / "swarm.json"
    manifest_path.write_text(json.dumps(fast_test_swarm_dict()))
    started: list[processes.PeerProcess] = []
    try:
        base = [*processes.loopback_args(manifest_path), "--duration", "1800"]
        alice = processes.start_peer([*base, "--new-swarm", "--stage", "1", "--simulated-speed", "0.05"],
                                     work / "alice.log", work / "cache")  # fmt: skip
        started.append(alice)
        alice.wait_for("serving stage 1", timeout=120)
        started.append(processes.start_peer([*base, "--no-trainer"], work / "bob.log", work / "cache"))
        started[-1].wait_for("serving stage 0", timeout=120)
        manifest = load_manifest(manifest_path)
        result = {"benchmark": "monitor", **fill_history(work / "history.sqlite", manifest, args.samples, args.peers)}

        monitor_args = ["--join", str(manifest_path), "--port", "0", "--history", str(work / "history.sqlite"),
                        "--json", "--every", "1"]  # fmt: skip
        monitor = processes.start_peer(monitor_args, work / "monitor.log", work / "cache", module="peers.swarm_monitor")
        started.append(monitor)
        where = monitor.wait_for_json(lambda line: "url" in line, timeout=60, what="the monitor's URL")
        result["history_samples_at_start"] = where["samples"]
        time.sleep(30)
        first_rss = processes.memory_mb(monitor.pgid).get(f"python {monitor.pid}", float("nan"))
        time.sleep(args.watch)
        memory = processes.memory_mb(monitor.pgid)
        result["monitor_rss_mb"] = round(sum(memory.values()), 1)
        result["monitor_python_rss_mb"] = round(memory.get(f"python {monitor.pid}", memory.get(f"python3 {monitor.pid}",
                                                                                              float("nan"))), 1)  # fmt: skip
        result["monitor_python_rss_growth_mb"] = round(result["monitor_python_rss_mb"] - first_rss, 1)
        result["monitor_growth_over_samples"] = int(args.watch)  # --every 1: one sample a second
        result["monitor_processes"] = {name.split()[0]: round(mb, 1) for name, mb in memory.items()}
        result.update(page_load_seconds(where["url"]))
        result["monitor_rss_mb_after_page_loads"] = round(sum(processes.memory_mb(monitor.pgid).values()), 1)
        result["benchmark_max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        print(json.dumps(result))
    finally:
        processes.stop_peers(started, grace=10.0)


if __name__ == "__main__":
    main()
