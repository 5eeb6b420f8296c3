"""The swarm's data progress as peer-status, swarm-monitor and a peer's metrics show it: pure functions over the
trainers' reader records (swarm/watch/data_progress.py) and over a peer's own data stats."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from conftest import tiny_manifest_dict
from peers.peer_status import render
from swarm.dataset.progress import ReaderRecord
from swarm.dataset.reading_order import to_bitmap
from swarm.manifests.validation import manifest_from_dict
from swarm.monitor.prometheus import swarm_metrics
from swarm.watch.data_progress import data_progress
from swarm.watch.metrics import PeerCollector, PeerInfo
from swarm.watch.stats import PeerSnapshot, Traffic
from swarm.watch.status import swarm_health

DATA, OTHER = "a" * 64, "b" * 64
CHUNKS = 10


def record(peer_id: str, epoch: int, finished=(), reading=(), held=(), data=DATA, chunks=CHUNKS, **counters):
    return ReaderRecord(
        peer_id=peer_id,
        data=data,
        epoch=epoch,
        finished=to_bitmap(finished, chunks),
        held=to_bitmap(held, chunks),
        reading=tuple(reading),
        chunks=chunks,
        **counters,
    )


def three_trainers() -> list[ReaderRecord]:
    return [
        record("peer-b", 1, finished={1, 3}, reading=[(6, 4), (7, 0)], tokens=200, chunks_read=2, bytes_fetched=2000),
        record(  # its chunk 3 is one B finished: it counts once, and not as half
            "peer-a",
            1,
            finished={0, 1, 2},
            reading=[(5, 7), (3, 1)],
            held={0, 5},
            tokens=300,
            chunks_read=3,
            duplicates=1,
            cache_bytes=4096,
            cache_cap=8192,
            bytes_fetched=3000,
        ),  # fmt: skip
        record("peer-c", 0, finished=set(range(9)), reading=[(9, 2)], tokens=50, chunks_read=9, duplicates=2),
    ]


def test_the_swarm_reads_the_union_of_the_latest_epoch_and_sums_every_trainer():
    summary = data_progress(three_trainers(), DATA)
    # epoch 1 (C is still in 0): finished {0, 1, 2, 3}, begun {5, 6} (half each; 7, only queued, not): (4 + 1) / 10
    assert (summary["epoch"], summary["chunks"], summary["epoch_read"]) == (1, CHUNKS, 0.5)
    assert (summary["chunks_finished"], summary["chunks_reading"]) == (4, 2)
    assert (summary["readers"], summary["other_readers"]) == (3, 0)
    assert (summary["tokens_read"], summary["chunks_read"], summary["duplicates"]) == (550, 14, 3)
    assert summary["bytes_fetched"] == 5000
    rows = summary["trainers"]
    assert [row["peer_id"] for row in rows] == ["peer-a", "peer-b", "peer-c"]
    assert rows[0] == {
        "peer_id": "peer-a", "short_id": "peer-a", "epoch": 1, "chunk": 5, "windows": 7, "tokens_read": 300,
        "chunks_read": 3, "duplicates": 1, "bytes_fetched": 3000, "cache_bytes": 4096, "cache_cap": 8192,
        "chunks_held": 2,
    }  # fmt: skip
    assert rows[2]["epoch"] == 0 and (rows[2]["chunk"], rows[2]["windows"]) == (9, 2)
    json.dumps(summary)  # the --json document and the monitor's API


def test_an_epoch_read_whole_and_no_records():
    done = data_progress([record("peer-a", 4, finished=range(CHUNKS))], DATA)
    assert (done["epoch"], done["epoch_read"], done["trainers"][0]["chunk"]) == (4, 1.0, None)
    empty = data_progress([], DATA)
    assert empty == {
        "data": DATA, "chunks": 0, "epoch": 0, "epoch_read": 0.0, "chunks_finished": 0, "chunks_reading": 0,
        "readers": 0, "other_readers": 0, "tokens_read": 0, "chunks_read": 0, "duplicates": 0, "bytes_fetched": 0,
        "trainers": [],
    }  # fmt: skip


def test_a_raw_source_shows_the_data_most_trainers_read():
    records = [*three_trainers(), record("peer-x", 7, finished={0}, data=OTHER, chunks=20, tokens=10**6)]
    raw = data_progress(records)  # no hash in the manifest: the most common data
    assert (raw["data"], raw["readers"], raw["other_readers"], raw["epoch"]) == (DATA, 3, 1, 1)
    pinned = data_progress(records, OTHER)  # the manifest's data, however few read it
    assert (pinned["data"], pinned["readers"], pinned["chunks"], pinned["epoch_read"]) == (OTHER, 1, 20, 0.05)
    tie = data_progress([record("peer-a", 0, tokens=5), record("peer-x", 0, data=OTHER, tokens=9)])
    assert tie["data"] == OTHER  # as many readers each: the data read most


def test_peer_status_and_the_monitor_show_the_data():
    manifest = manifest_from_dict(tiny_manifest_dict())
    document = swarm_health(manifest, [[], []], [], 1000.0)
    document["data"] = data_progress(three_trainers(), DATA)
    console = Console(record=True, width=160)
    console.print(render(argparse.Namespace(peer=None), document))
    text = console.export_text()
    assert "data aaaaaaaaaaaa: epoch 1, 50.0% of it read (4 of 10 chunks finished, 2 being read)" in text, text
    assert "550 tokens read by 3 trainers, 3 chunks read twice, 5.0kB fetched" in text, text
    assert "peer-a" in text and "4.1kB of 8.2kB" in text and "trainers' reading" in text, text
    console = Console(record=True, width=160)
    console.print(render(argparse.Namespace(peer=None), {**document, "data": data_progress([], "")}))
    assert "no trainer has said what it reads" in console.export_text()

    metrics = swarm_metrics(document, True, 1).decode()
    assert 'swarm_data_epoch_read_ratio{swarm_id="' in metrics and "} 0.5\n" in metrics
    assert "swarm_data_tokens_read{" in metrics


def test_a_peer_s_metrics_carry_its_trainer_s_data_stats():
    stats = {
        "epoch": 2, "epoch_read": 0.25, "chunk": 3, "chunks": 10, "chunks_read": 4, "duplicates": 1,
        "tokens_read": 1000, "bytes_from": {"web": 300, "peer": 200}, "refused": {"wrong hash": 1},
        "download_rate": 0, "cache_bytes": 500, "cache_cap": 4000, "readers": 2,
    }  # fmt: skip
    info = PeerInfo("swarm", "test", "peer-a", "cpu", "", 2, 0.0)
    collector = PeerCollector(info, lambda: PeerSnapshot.of(None, None, 0, Traffic(), data=stats))
    samples = {
        (
            sample.name,
            tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("swarm_id", "peer_id"))),
        ): sample.value
        for family in collector.collect()
        for sample in family.samples
    }
    assert samples[("swarm_data_epoch", ())] == 2 and samples[("swarm_data_epoch_read_ratio", ())] == 0.25
    assert samples[("swarm_data_chunks_read_total", ())] == 4
    assert samples[("swarm_data_duplicate_chunks_total", ())] == 1
    assert samples[("swarm_data_fetched_bytes_total", (("source", "web"),))] == 300
    assert samples[("swarm_data_fetched_bytes_total", (("source", "peer"),))] == 200
    assert samples[("swarm_data_refused_chunks_total", (("reason", "wrong hash"),))] == 1
    assert samples[("swarm_data_cache_bytes", ())] == 500 and samples[("swarm_data_cache_capacity_bytes", ())] == 4000
    without = PeerCollector(info, lambda: PeerSnapshot.of(None, None, 0, Traffic()))
    assert not [family for family in without.collect() if family.name.startswith("swarm_data_")]
