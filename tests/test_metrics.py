"""`swarm-peer --metrics-port`: Prometheus metrics of a peer, scraped over HTTP while it trains."""

from __future__ import annotations

import asyncio
import math
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conftest import tiny_manifest_dict
from peers.swarm_peer import parse_args
from swarm import __version__
from swarm.architectures.model import build_stage
from swarm.client.trainer import Trainer
from swarm.dht.records import PeerState
from swarm.errors import PeerStartError
from swarm.manifests.validation import manifest_from_dict
from swarm.peer.peer import Peer
from swarm.server.stage import ServingOptions, StageServer
from swarm.throughput import Throughput
from swarm.watch.metrics import PeerCollector, start_metrics_server


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def values(samples: list[Sample], name: str, **labels: str) -> list[float]:
    return [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = values(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0]


# ------------------------------------------------------------------------------------------ real peer processes


@pytest.mark.integration
@pytest.mark.slow(40)
def test_peer_serves_metrics_while_training(start_peer, write_manifest, tmp_path):
    raw = tiny_manifest_dict(averaging={"mode": "none"})  # no averager processes to start: no round is scraped
    text = tmp_path / "corpus.txt"  # quicker to load than the manifest's data (the standard library's sources)
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 2000)
    first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", "--throughput", "1000")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    # serves stage 1 and trains (through the first peer's stage 0); port 0: any free port, printed
    flags = ["--stage", "1", "--throughput", "1000", "--data", str(text), "--public-name", "scraped"]
    peer = start_peer(write_manifest(raw, "joined.json"), *flags, "--metrics-port", "0")
    url = peer.wait_for(r"metrics at (http://127\.0\.0\.1:\d+/metrics)").group(1)
    peer_id = peer.peer_id()

    deadline = time.monotonic() + 90
    while True:  # until the trainer has completed microbatches through both stages
        before = scrape(url)
        if values(before, "swarm_trainer_loss") and value(before, "swarm_stage_samples_served_total", stage="1") > 0:
            break
        assert time.monotonic() < deadline, f"no training seen in the metrics:\n{peer.output()[-3000:]}"
        time.sleep(0.5)

    def progress(samples: list[Sample]) -> tuple[float, float]:
        served = value(samples, "swarm_stage_samples_served_total", stage="1")
        return served, value(samples, "swarm_trainer_samples_total")

    while True:  # a second scrape, once both have grown (the trainer counts a microbatch after its backward)
        time.sleep(0.5)
        after = scrape(url)
        if all(a > b for a, b in zip(progress(after), progress(before))):
            break
        assert time.monotonic() < deadline, f"no progress between scrapes:\n{peer.output()[-3000:]}"

    for sample in after:  # every series of ours names the swarm and the peer
        if sample.name.startswith("swarm_"):
            assert sample.labels["swarm_id"] == manifest.swarm_id and sample.labels["peer_id"] == peer_id, sample
    (info,) = [s for s in after if s.name == "swarm_peer_info"]
    assert info.value == 1
    assert info.labels["version"] == __version__ and info.labels["public_name"] == "scraped"
    assert info.labels["swarm_name"] == "test-swarm" and info.labels["device"]
    assert value(after, "swarm_peer_state", state="online") == 1
    assert value(after, "swarm_peer_state", state="joining") == 0
    assert value(after, "swarm_peer_stage") == 1
    assert value(after, "swarm_peer_uptime_seconds") > value(before, "swarm_peer_uptime_seconds")
    assert value(after, "swarm_stage_compute_throughput_samples_per_second", stage="1") == 1000
    assert value(after, "swarm_stage_outstanding_requests", stage="1") >= 0
    assert value(before, "swarm_trainer_samples_total") > 0
    assert value(after, "swarm_data_tokens_read_total") > 0 and value(after, "swarm_data_readers") >= 1
    loss = value(after, "swarm_trainer_loss")
    assert math.isfinite(loss) and 0 < loss < 10, loss
    assert value(after, "swarm_trainer_stage_unserved", stage="0") == 0
    # the trainer's stage-0 calls go to the other peer over the network
    assert value(after, "swarm_sent_bytes_total", kind="activations") > 0
    assert value(after, "swarm_received_bytes_total", kind="activations") > 0
    errors = {s.labels["kind"]: s.value for s in after if s.name == "swarm_errors_total"}
    assert set(errors) == {"bad_request", "busy", "banned", "failed_averaging_round", "failed_microbatch"}, errors
    assert errors["bad_request"] == 0
    assert not [s for s in after if s.name.startswith("swarm_stage_") and s.labels.get("stage") != "1"]

    peer.process.send_signal(signal.SIGTERM)  # the metrics server does not hold up a clean exit
    assert peer.process.wait(timeout=30) == 0, peer.output()[-3000:]
    assert "stopped cleanly" in peer.output()


@pytest.mark.integration
def test_taken_metrics_port_is_a_clear_error(start_peer, write_manifest):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        begin = time.monotonic()
        peer = start_peer(
            write_manifest(tiny_manifest_dict()),
            *("--stage", "0", "--no-trainer", "--throughput", "1000", "--metrics-port", str(port)),
        )
        assert peer.process.wait(timeout=90) == 2, peer.output()
    elapsed = time.monotonic() - begin
    out = peer.output()
    assert f"port {port} on 127.0.0.1 is already in use" in out and "--metrics-port" in out, out
    assert "Traceback" not in out, out
    assert elapsed < 60  # a peer's start (imports, its DHT) on a loaded 2-core machine, then the error at once
    deadline = time.monotonic() + 10  # its DHT process and p2pd daemon are gone too
    while peer.group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not peer.group_alive()


# ------------------------------------------------------------------------------------------------ in process


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--metrics-port", "65536"], "--metrics-port must be a port number"),
        (["--metrics-port", "-1"], "--metrics-port must be a port number"),
        (["--metrics-host", "0.0.0.0"], "--metrics-host needs --metrics-port"),
    ],
)
def test_bad_metrics_flags(capsys, flags, expected):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--join", "m.json", *flags])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_metrics_flags_default_to_off_and_loopback():
    assert parse_args(["--join", "m.json"]).metrics_port is None
    args = parse_args(["--join", "m.json", "--metrics-port", "9100"])
    assert (args.metrics_port, args.metrics_host) == (9100, "127.0.0.1")


def offline_peer() -> tuple[Peer, Trainer, StageServer]:
    """A peer without a DHT, a trainer and a stage server it does not have yet: enough for what the metrics read."""
    manifest = manifest_from_dict(tiny_manifest_dict())
    peer = Peer(manifest, None, None, torch.device("cpu"), ServingOptions(public_name="a"), peer_id="peer-a")
    trainer = Trainer(manifest, None, None, "peer-a", view=peer.context.view, traffic=peer.context.traffic)
    server = StageServer(manifest, 1, build_stage(manifest, 1), torch.device("cpu"), "peer-a", Throughput(30.0, 20.0))
    return peer, trainer, server


def test_metrics_follow_the_peer_from_joining_to_serving():
    peer, trainer, server = offline_peer()

    async def run() -> tuple[list[Sample], list[Sample], list[Sample]]:
        metrics = start_metrics_server("127.0.0.1", 0, peer.info(), peer.snapshot)
        try:
            assert metrics.port > 0 and metrics.url == f"http://127.0.0.1:{metrics.port}/metrics"
            joining = await asyncio.to_thread(scrape, metrics.url)  # no server yet, no trainer yet
            peer.trainer = trainer
            trainer.unserved_stages.add(0)  # no microbatch yet: the loss is NaN
            waiting = await asyncio.to_thread(scrape, metrics.url)
            peer.rebalancer.server, server.state = server, PeerState.ONLINE
            server.worker.counters.samples_served, server.admission.bad_requests = 64, 3
            server.round_counters.failed = 1
            trainer.unserved_stages.clear()
            trainer.samples, trainer.failed_microbatches = 8, 2
            trainer.recent.append((time.monotonic(), 2.5, 8))
            peer.context.traffic.averaging_sent = 1234
            serving = await asyncio.to_thread(scrape, metrics.url)
        finally:
            metrics.stop()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(scrape, metrics.url)
        return joining, waiting, serving

    joining, waiting, serving = asyncio.run(run())
    assert value(joining, "swarm_peer_state", state="joining") == 1
    assert value(joining, "swarm_peer_moves_total") == 0
    assert not [s for s in joining if s.name.startswith(("swarm_stage_", "swarm_trainer_", "swarm_peer_stage"))]

    assert not values(waiting, "swarm_trainer_loss")  # left out, not NaN
    assert value(waiting, "swarm_trainer_stage_unserved", stage="0") == 1
    assert value(waiting, "swarm_trainer_stage_unserved", stage="1") == 0
    assert value(waiting, "swarm_errors_total", kind="failed_microbatch", stage="") == 0

    assert value(serving, "swarm_peer_state", state="online") == 1
    assert value(serving, "swarm_peer_state", state="joining") == 0
    assert value(serving, "swarm_peer_stage") == 1
    assert value(serving, "swarm_stage_samples_served_total", stage="1") == 64
    assert value(serving, "swarm_stage_serving_throughput_samples_per_second", stage="1") == 20
    assert value(serving, "swarm_trainer_loss") == 2.5
    assert value(serving, "swarm_trainer_stage_unserved", stage="0") == 0
    assert value(serving, "swarm_sent_bytes_total", kind="averaging") == 1234
    assert value(serving, "swarm_errors_total", kind="bad_request", stage="1") == 3
    assert value(serving, "swarm_errors_total", kind="failed_averaging_round", stage="1") == 1
    assert value(serving, "swarm_errors_total", kind="failed_microbatch", stage="") == 2
    assert value(serving, "swarm_peer_info", peer_id="peer-a", public_name="a") == 1


def test_a_blocked_event_loop_gives_the_static_metrics_only():
    peer, _, server = offline_peer()
    peer.rebalancer.server = server

    async def run() -> list[str]:
        collector = PeerCollector(peer.info(), peer.snapshot, loop=asyncio.get_running_loop(), timeout=0.2)
        scraping = asyncio.get_running_loop().run_in_executor(None, lambda: list(collector.collect()))
        time.sleep(3.0)  # the loop is busy with something else than answering the scrape (which gives up at 0.2 s)
        return [family.name for family in await scraping]

    assert asyncio.run(run()) == ["swarm_peer", "swarm_peer_uptime_seconds"]


def test_unusable_address_is_a_clear_error():
    peer, _, _ = offline_peer()

    async def run() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(PeerStartError, match="already in use; choose another --metrics-port"):
                start_metrics_server("127.0.0.1", taken.getsockname()[1], peer.info(), peer.snapshot)
        with pytest.raises(PeerStartError, match="cannot listen on 192.0.2.1"):  # not an address of this machine
            start_metrics_server("192.0.2.1", 0, peer.info(), peer.snapshot)

    asyncio.run(run())
