"""Loading a manifest by URL, from a real HTTP server on loopback: the good case and every bad one."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import tiny_manifest_dict
from peers.swarm_peer import main as peer_main
from swarm import PROTOCOL_VERSION
from swarm.errors import ManifestError, TokenizerError
from swarm.local import processes
from swarm.manifests.loading import load_manifest
from swarm.manifests.validation import manifest_from_dict

GOOD = tiny_manifest_dict()
OLD_VERSION = {**tiny_manifest_dict(), "protocol_version": 1}
# seconds a slow server takes (to answer, or to finish a trickle): the clients below give up after 1 or 2 s; a bound
# of half of it on their time is far above their normal figure (a loaded machine's too) and far below the server's
SLOW = 30.0


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the http.server API)
        routes = {
            "/swarm.json": (200, json.dumps(GOOD).encode()),
            "/old.json": (200, json.dumps(OLD_VERSION).encode()),
            "/page.html": (200, b"<html>not a manifest</html>"),
            "/other.json": (200, json.dumps({"hello": "world"}).encode()),
            "/binary": (200, bytes(range(256)) * 4),
            "/huge.json": (200, b" " * 2_000_000),
            "/broken": (500, b"oops"),
        }
        if self.path == "/slow.json":
            time.sleep(SLOW)
        if self.path == "/trickle.json":  # a byte every 0.3 s for SLOW s: no single read ever times out
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                for _ in range(int(SLOW / 0.3)):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass
            return
        status, body = routes.get(self.path, (404, b"not found"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def silent_port():
    """A port that accepts connections but never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


def test_a_manifest_loads_by_url_and_is_checked_against_the_swarm_id_in_the_url(server):
    expected = manifest_from_dict(GOOD)
    assert load_manifest(f"{server}/swarm.json") == expected
    assert load_manifest(f"{server}/swarm.json#{expected.swarm_id}").swarm_id == expected.swarm_id
    assert load_manifest(f"{server}/swarm.json#swarm_id={expected.swarm_id}").swarm_id == expected.swarm_id
    with pytest.raises(ManifestError, match="has swarm id .* but the URL says 0123456789abcdef"):
        load_manifest(f"{server}/swarm.json#0123456789abcdef")
    with pytest.raises(ManifestError, match="is not a swarm id"):
        load_manifest(f"{server}/swarm.json#latest")


@pytest.mark.parametrize(
    "path, message",
    [
        ("/missing.json", "answered HTTP 404"),
        ("/broken", "answered HTTP 500"),
        ("/page.html", "does not hold a valid swarm manifest: the document is not valid JSON"),
        ("/other.json", "does not hold a valid swarm manifest: manifest field 'name'"),
        ("/old.json", f"speaks protocol {PROTOCOL_VERSION}, the manifest asks for 1"),
        ("/binary", "not UTF-8"),
        ("/huge.json", "more than 1000000 bytes"),
    ],
)
def test_bad_urls_give_one_clear_error(server, path, message):
    with pytest.raises(ManifestError, match=message):
        load_manifest(server + path, timeout=5)


def test_a_url_that_does_not_answer_fails_within_the_timeout(server, silent_port):
    for url in (f"http://127.0.0.1:{silent_port}/swarm.json", f"{server}/slow.json"):
        begin = time.monotonic()
        with pytest.raises(ManifestError, match="did not (answer|send it) within 2 seconds"):
            load_manifest(url, timeout=2)
        assert time.monotonic() - begin < SLOW / 2


def test_a_server_that_trickles_its_answer_is_given_up_at_the_deadline_of_the_whole_get(server, monkeypatch):
    """urllib's timeout bounds each read: a byte every 0.3 s would hold a start for as long as the server likes."""
    from swarm.dataset import tokenizer_source

    begin = time.monotonic()
    with pytest.raises(ManifestError, match="did not send it within 2 seconds"):
        load_manifest(f"{server}/trickle.json", timeout=2)
    assert time.monotonic() - begin < SLOW / 2
    begin = time.monotonic()
    with pytest.raises(TokenizerError, match="could not get the tokenizer .*in 1 s and was still sending"):
        monkeypatch.setattr(tokenizer_source, "URL_TIMEOUT", 1.0)
        tokenizer_source._fetch(f"{server}/trickle.json")
    assert time.monotonic() - begin < SLOW / 2


def test_refused_connections_fail_fast():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nobody listens there
    with pytest.raises(ManifestError, match="could not get the manifest from .*refused"):
        load_manifest(f"http://127.0.0.1:{port}/swarm.json", timeout=5)


def test_swarm_peer_reports_a_bad_url_in_one_paragraph(server, capsys):
    begin = time.monotonic()
    code = peer_main(["--join", f"{server}/missing.json"])  # in this process: it fails before anything starts
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("swarm-peer: error: could not get the manifest")
    assert "Traceback" not in captured.err + captured.out
    assert time.monotonic() - begin < 30


# ------------------------------------------------------------------------------------ join by a peer's multiaddr


@pytest.mark.integration
@pytest.mark.slow(25)
def test_a_peer_joins_through_another_peers_multiaddr(start_peer, write_manifest):
    first = start_peer(write_manifest(tiny_manifest_dict()), "--stage", "0", "--no-trainer")
    first.wait_for("serving stage 0")
    joiner = start_peer(first.maddr(), "--stage", "1", "--no-trainer")  # no manifest at hand: the peer hands it out
    joiner.wait_for("serving stage 1")
    swarm_id = manifest_from_dict(tiny_manifest_dict()).swarm_id
    assert f"(id {swarm_id})" in joiner.output()


@pytest.mark.integration
@pytest.mark.slow(30)
def test_joining_through_a_peer_that_is_not_there_or_not_a_swarm_peer_fails_clearly(tmp_path):
    from hivemind import DHT

    from conftest import LOOPBACK

    bare = DHT(start=True, host_maddrs=[LOOPBACK])  # a DHT node, but no swarm-peer
    try:
        maddr = str(bare.get_visible_maddrs()[0])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed = sock.getsockname()[1]
        gone = f"/ip4/127.0.0.1/tcp/{closed}/p2p/{bare.peer_id}"
        # both at once (each is a whole swarm-peer start): each must give up on its own, with its own message, and
        # at once, when told no (the bare node does not speak the protocol; nothing listens at the port), never by
        # waiting for a deadline (15 s for the manifest, the DHT's startup timeout plus slack, 35 s)
        cases = {
            maddr: ("is it a running swarm-peer", "protocols not supported"),
            gone: ("could not join the DHT", "no initial peer could be reached"),
        }
        begin = time.monotonic()
        runs = {
            join: processes.start_peer(["--join", join, "--host-maddrs", LOOPBACK], tmp_path / f"peer{i}.log")
            for i, join in enumerate(cases)
        }
        try:
            for join, (message, cause) in cases.items():
                code, output = runs[join].process.wait(timeout=90), runs[join].output()
                assert code == 2, output[-2000:]
                assert message in output and "Traceback" not in output, output[-2000:]
                assert cause in output and "TimeoutError" not in output and "did not get ready" not in output, output
        finally:
            for run in runs.values():
                processes.kill_peer(run)
        # (about 10 s for both on an idle machine; this bound only says that neither hung)
        assert time.monotonic() - begin < 60
    finally:
        bare.shutdown()
