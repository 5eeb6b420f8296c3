"""A public swarm's data travels with it (real peer processes, a real HTTP server on loopback): the creator
publishes the manifest and the prepared folder side by side; a volunteer who joins by the manifest's URL, from a
folder with nothing in it, fetches the chunks it reads, verified, and trains; when the web server goes away the
swarm trains on, the volunteer getting chunks from the creator's peer; a data cache too small for two chunks is
refused in one line before the peer takes a stage."""

from __future__ import annotations

import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import tiny_manifest_dict
from swarm.dataset.corpus import index_sha256, prepare_corpus
from swarm.dataset.tokenizer import byte_tokenizer

pytestmark = pytest.mark.integration


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def publish(folder):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def status_with(peer, accept, timeout=120.0):
    return peer.wait_for_json(lambda line: "data" in line and accept(line), timeout=timeout)


@pytest.mark.slow(60)
def test_a_volunteer_joins_by_url_and_trains_on_published_data_even_when_the_server_goes(start_peer, tmp_path):
    site = tmp_path / "site"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(60):
        (corpus / f"doc{k}.txt").write_text(f"document {k}: " + " ".join(f"w{(k * j) % 89}" for j in range(400)))
    index = prepare_corpus(str(corpus), site / "prepared", byte_tokenizer(), chunk_tokens=3000)
    # no averaging: the data's paths are what is tested, and an averager is a process more per peer to start
    manifest = tiny_manifest_dict(
        data={"source": "prepared", "index_sha256": index_sha256(index)}, averaging={"mode": "none"}
    )
    (site / "swarm.json").write_text(json.dumps(manifest))
    server = publish(site)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/swarm.json"
        # the creator's peer reads the folder in place (the manifest's own folder)
        creator = start_peer(site / "swarm.json", "--stage", "0", "--status-every", "1")
        manifest["initial_peers"] = [creator.maddr()]
        (site / "swarm.json").write_text(json.dumps(manifest))
        # (both volunteers start at once: each is a process that loads torch and hivemind, seconds apiece)
        small = start_peer(url, "--stage", "1", "--data-cache", "4KB", cache_dir=tmp_path / "small")
        # a cache of 4 chunks: chunks read earlier are evicted, so later ones must be fetched again
        volunteer = start_peer(
            url, "--stage", "1", "--status-every", "1", "--data-cache", "12KB", cache_dir=tmp_path / "volunteer"
        )
        # a volunteer with a cache far too small: refused in one line, before it serves anything
        assert small.process.wait(timeout=120) == 2
        assert "smaller than two of this swarm's chunks" in small.output() and "--data-cache" in small.output()
        assert "serving" not in small.output().lower() and "Traceback" not in small.output()
        line = status_with(volunteer, lambda s: s["data"]["chunks_read"] >= 2 and s["trainer_samples"] > 0)
        assert line["data"]["bytes_from"].get("web", 0) > 0 and line["data"]["refused"] == {}
        assert "folder" not in line["data"]["bytes_from"]  # the volunteer has no copy of the data: it downloads
    finally:
        server.shutdown()
        server.server_close()
    # the published copy is gone: the volunteer's new chunks come from the creator's peer, and training goes on
    # (5 chunks more than its cache of 4 holds: at least one of them was fetched after the web server went away)
    read = line["data"]["chunks_read"]
    later = status_with(volunteer, lambda s: s["data"]["chunks_read"] >= read + 5, timeout=150)
    assert later["data"]["bytes_from"].get("peer", 0) > 0 and later["data"]["cache_bytes"] <= 12_000
    assert later["trainer_failed_microbatches"] == 0 and later["trainer_samples"] > line["trainer_samples"]
    # the two trainers split the epoch: few chunks read twice
    creator_line = status_with(creator, lambda s: s["data"]["readers"] == 2)
    assert creator_line["data"]["duplicates"] <= 2 and later["data"]["duplicates"] <= 2
    assert "Traceback" not in volunteer.output()
