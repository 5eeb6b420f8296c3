"""swarm-peer --check's rows on the training data (swarm/preflight/data_probes.py, data_checks.py), in this process
against a real HTTP server on loopback that publishes a prepared folder next to its manifest: the index from the
source (or a mirror when the source is down) and pinned, the first chunk fetched and verified with its rate, the
data cache's disk; a stopped server and a chunk changed on the server fail, saying where and what to do. The rows
through the program itself are tests/test_preflight.py's."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import tiny_manifest_dict
from swarm.dataset.corpus import index_sha256, prepare_corpus
from swarm.dataset.index import parse_index
from swarm.dataset.tokenizer import byte_tokenizer
from swarm.local.processes import free_ports
from swarm.manifests.loading import load_manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.preflight.checks import Blocks, Status
from swarm.preflight.data_checks import DataFindings, data_rows
from swarm.preflight.data_probes import probe_data
from swarm.preflight.run import PreflightOptions
from swarm.preflight.run import data_rows as preflight_data_rows

CHUNK_TOKENS = 1 << 20  # 1 MiB chunks of byte tokens: large enough to measure loopback's rate, not latency
MIB = 1 << 20


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A creator's site: the manifest and the prepared folder ("prepared", 2 train chunks) side by side."""
    folder = tmp_path_factory.mktemp("site")
    text = folder.parent / f"{folder.name}-text"
    text.mkdir()
    for k in range(24):
        (text / f"doc{k}.txt").write_text(f"document {k}: " + " ".join(f"w{(k * j) % 89}" for j in range(20_000)))
    prepare_corpus(str(text), folder / "prepared", byte_tokenizer(), chunk_tokens=CHUNK_TOKENS)
    manifest = tiny_manifest_dict(data={"source": "prepared", "index_sha256": index_sha256(folder / "prepared")})
    (folder / "swarm.json").write_text(json.dumps(manifest))
    return folder


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def publish(folder: Path) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def url_of(server: ThreadingHTTPServer, name: str = "") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/{name}"


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch) -> Path:
    """The user's data cache: an empty folder of this test's (the check must leave nothing there)."""
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def check(manifest, cap: int = 64 * MIB, own: str | None = None) -> dict:
    return {name: row for name, row in data_rows(probe_data(manifest, own, cap)).items()}


def test_published_data_passes_and_a_stopped_server_fails_naming_its_url(site, empty_cache):
    server = publish(site)
    try:
        manifest = load_manifest(url_of(server, "swarm.json"))  # relative data paths: next to the manifest's URL
        rows = check(manifest)
    finally:
        server.shutdown()
        server.server_close()
    index, chunk, disk = rows["data_index"], rows["data_chunk"], rows["data_disk"]
    assert index.status == Status.PASS and "matches data.index_sha256" in index.detail, index
    assert url_of(server, "prepared/index.json") in index.detail and index.figures["chunks"] == 2
    assert chunk.status == Status.PASS and "chunk-00000.bin (1 MiB)" in chunk.detail, chunk
    assert "SHA-256 verified" in chunk.detail and chunk.figures["bytes"] == CHUNK_TOKENS
    assert chunk.figures["download_mbits"] > 10  # loopback
    assert disk.status == Status.PASS and "room for --data-cache 64 MiB (64 chunks)" in disk.detail, disk
    assert not empty_cache.exists()  # the chunk went to a temporary folder, not into the user's cache

    rows = check(manifest)  # the same manifest, its server stopped
    index = rows["data_index"]
    assert index.status == Status.FAIL and index.blocks == Blocks.JOIN, index
    assert f"{url_of(server, 'prepared/index.json')} could not be reached" in index.detail
    assert "is up and that this machine can reach it" in index.remedy and "--no-trainer" in index.remedy
    assert rows["data_chunk"].status == Status.SKIP and rows["data_disk"].status == Status.SKIP


def test_a_dead_source_with_a_live_mirror_warns_and_a_small_disk_or_cap_is_refused(site):
    (dead,) = free_ports(1)
    dead_url = f"http://127.0.0.1:{dead}/prepared/"
    data = {"source": dead_url, "mirrors": ["prepared"], "index_sha256": index_sha256(site / "prepared")}
    server = publish(site)
    try:
        manifest = manifest_from_dict(tiny_manifest_dict(data=data))
        rows = check(dataclasses.replace(manifest, origin=url_of(server, "swarm.json")), cap=1 * MIB)
    finally:
        server.shutdown()
        server.server_close()
    index, chunk = rows["data_index"], rows["data_chunk"]
    assert index.status == Status.WARN and dead_url + "index.json could not be reached" in index.detail, index
    assert chunk.status == Status.PASS and f"from {url_of(server, 'prepared/')}" in chunk.detail, chunk
    disk = rows["data_disk"]  # a cap of one chunk: the peer would refuse it at its start
    assert disk.status == Status.FAIL and "cannot hold two chunks (2 MiB)" in disk.detail, disk
    assert "give --data-cache 2MiB or more" in disk.remedy


def test_a_chunk_changed_on_the_server_fails_its_sha256(site, tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    chunk_file = copy / "prepared" / "chunk-00000.bin"
    data = bytearray(chunk_file.read_bytes())
    data[1000] ^= 0xFF  # the same size: only its hash tells
    chunk_file.write_bytes(bytes(data))
    server = publish(copy)
    try:
        rows = check(load_manifest(url_of(server, "swarm.json")))
    finally:
        server.shutdown()
        server.server_close()
    assert rows["data_index"].status == Status.PASS  # the index is the pinned one
    chunk = rows["data_chunk"]
    assert chunk.status == Status.FAIL and chunk.blocks == Blocks.JOIN, chunk
    assert f"{url_of(server, 'prepared/chunk-00000.bin')} sent bytes whose SHA-256 is not the chunk's" in chunk.detail
    assert "publish the prepared folder again" in chunk.remedy and "--no-trainer" in chunk.remedy


def test_slow_links_and_small_disks_warn(site):
    index = parse_index((site / "prepared" / "index.json").read_bytes(), "test")
    size = index.chunks[0].size

    def found(**figures) -> DataFindings:
        return DataFindings("prepared", True, answers=[("here", "")], index=index, cap=8 * MIB, **figures)

    slow = data_rows(found(chunk_from="here", chunk_bytes=size, chunk_seconds=2.0, cache_free=100 * MIB))
    assert slow["data_chunk"].status == Status.WARN and "4.2 Mbit/s" in slow["data_chunk"].detail
    assert "delays its first microbatch" in slow["data_chunk"].remedy
    assert slow["data_disk"].status == Status.PASS
    short = data_rows(found(cache_free=3 * MIB, cache_held=1 * MIB))["data_disk"]  # 4 MiB of room under an 8 MiB cap
    assert short.status == Status.WARN and "smaller --data-cache" in short.remedy, short
    full = data_rows(found(cache_free=MIB))["data_disk"]
    assert full.status == Status.FAIL and "not room for two chunks" in full.detail and "SWARM_CACHE_DIR" in full.remedy


def test_no_trainer_skips_the_data_and_raw_sources_are_looked_for_on_this_machine(tmp_path):
    manifest = manifest_from_dict(tiny_manifest_dict())  # data.source "stdlib"
    skipped = preflight_data_rows(manifest, PreflightOptions(join="x", trainer=False), print)
    assert {row.status for row in skipped.values()} == {Status.SKIP}
    assert all(row.detail == "not checked: --no-trainer" for row in skipped.values())
    rows = check(manifest)
    assert rows["data_index"].status == Status.PASS and "raw text on this machine" in rows["data_index"].detail
    assert rows["data_chunk"].status == rows["data_disk"].status == Status.PASS  # nothing to download or cache
    missing = check(manifest, own=str(tmp_path / "nothing-here"))["data_index"]
    assert missing.status == Status.FAIL and "neither 'stdlib', a file nor a folder" in missing.detail
