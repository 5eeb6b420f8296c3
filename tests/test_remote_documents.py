"""Reading a data source by URL (swarm/dataset/remote_documents.py), from a real HTTP server on loopback and from
file:// folders: names, order, skipped records, progress, and the errors a bad URL or a stalled server give."""

from __future__ import annotations

import functools
import gzip
import json
import socket
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from swarm.dataset import remote_documents
from swarm.dataset.documents import Reading
from swarm.dataset.remote_documents import (
    is_remote_source,
    read_remote_documents,
    remote_files,
    remote_total_bytes,
)
from swarm.errors import DataError


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """(the folder it serves, its base URL): a real HTTP server on 127.0.0.1."""
    folder = tmp_path / "served"
    folder.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def _write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _read(urls: list[str], text_key: str = "text") -> tuple[list[tuple[str, str]], Reading]:
    reading = Reading(total_bytes=remote_total_bytes(urls), on_progress=None)
    documents = [(d.name, "".join(d.pieces())) for d in read_remote_documents(urls, text_key, reading)]
    return documents, reading


def test_what_is_a_remote_source():
    for source in ("http://h/a.jsonl", "https://h/a.parquet", "hf://datasets/u/r", "s3://b/k", "file:///tmp/x"):
        assert is_remote_source(source), source
    for source in ("stdlib", "data/a.jsonl", "/tmp/x", "~/corpus", "nosuchscheme://x"):
        assert not is_remote_source(source), source


def test_a_jsonl_file_over_http_gives_its_documents_in_order(server):
    folder, base = server
    _write_jsonl(folder / "a.jsonl", [{"text": "first"}, {"text": "second", "id": 2}, {"text": "third"}])
    url = f"{base}/a.jsonl"
    assert remote_files(url) == [url]
    documents, reading = _read([url])
    assert documents == [(f"{url}:1", "first"), (f"{url}:2", "second"), (f"{url}:3", "third")]
    size = (folder / "a.jsonl").stat().st_size
    assert reading.total_bytes == size and reading.done_bytes == size
    assert reading.skipped == 0


def test_a_bad_json_line_is_skipped_and_counted(server):
    folder, base = server
    _write_jsonl(folder / "a.jsonl", [{"text": "good"}, "{not json", {"other": "x"}, "", {"text": "also good"}])
    url = f"{base}/a.jsonl"
    documents, reading = _read([url])
    assert documents == [(f"{url}:1", "good"), (f"{url}:5", "also good")]
    assert reading.skipped == 2
    assert reading.skipped_examples[0].startswith(f"{url}:2: not JSON")
    assert reading.skipped_examples[1].startswith(f"{url}:3: no non-empty string")


def test_a_gzipped_jsonl_file_over_http(server):
    folder, base = server
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "zipped"}\n{"text": "too"}\n'))
    url = f"{base}/a.jsonl.gz"
    documents, reading = _read(remote_files(url))
    assert documents == [(f"{url}:1", "zipped"), (f"{url}:2", "too")]
    assert reading.done_bytes == (folder / "a.jsonl.gz").stat().st_size  # progress counts the bytes as stored


def test_a_parquet_file_over_http_gives_its_rows(server):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder, base = server
    table = pa.table({"id": [1, 2, 3, 4, 5], "content": ["one", "two", None, "four", "five"]})
    pq.write_table(table, folder / "rows.parquet", row_group_size=2)  # three row groups
    url = f"{base}/rows.parquet"
    documents, reading = _read(remote_files(url), text_key="content")
    assert documents == [(f"{url}:1", "one"), (f"{url}:2", "two"), (f"{url}:4", "four"), (f"{url}:5", "five")]
    assert reading.skipped == 1
    assert reading.done_bytes == reading.total_bytes == (folder / "rows.parquet").stat().st_size
    with pytest.raises(DataError, match="no column 'text'"):
        _read([url])


def test_a_file_url_folder_is_listed_sorted_and_read(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "b.jsonl", [{"text": "b1"}, {"text": "b2"}])
    _write_jsonl(folder / "sub" / "a.jsonl", [{"text": "a1"}])
    (folder / "notes.txt").write_text("not a data file")
    files = remote_files(f"file://{folder}")
    assert files == [f"file://{folder}/b.jsonl", f"file://{folder}/sub/a.jsonl"]
    documents, reading = _read(files)
    assert [text for _, text in documents] == ["b1", "b2", "a1"]
    assert documents[0][0] == f"file://{folder}/b.jsonl:1"
    assert reading.done_bytes == reading.total_bytes > 0
    assert remote_files(f"file://{folder}/*.jsonl") == [f"file://{folder}/b.jsonl"]


def test_a_parquet_file_by_fsspec_is_read_by_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [f"row {k}" for k in range(10)]}), tmp_path / "r.parquet", row_group_size=3)
    url = f"file://{tmp_path}/r.parquet"
    documents, reading = _read(remote_files(url))
    assert documents == [(f"{url}:{k + 1}", f"row {k}") for k in range(10)]
    assert reading.done_bytes == reading.total_bytes == (tmp_path / "r.parquet").stat().st_size


def test_several_urls_separated_by_commas(server):
    folder, base = server
    _write_jsonl(folder / "x.jsonl", [{"text": "x"}])
    _write_jsonl(folder / "y.jsonl", [{"text": "y"}])
    files = remote_files(f"{base}/y.jsonl, {base}/x.jsonl")
    assert files == [f"{base}/y.jsonl", f"{base}/x.jsonl"]  # in the order given
    assert [text for _, text in _read(files)[0]] == ["y", "x"]


def test_sources_that_cannot_be_listed_are_refused(tmp_path):
    with pytest.raises(DataError, match="cannot be listed"):
        remote_files("https://example.invalid/datasets/")
    with pytest.raises(DataError, match="not a URL"):
        remote_files("https://example.invalid/a.jsonl,local/b.jsonl")
    with pytest.raises(DataError, match="no file or folder"):
        remote_files(f"file://{tmp_path}/missing")
    with pytest.raises(DataError, match="holds no .jsonl"):
        remote_files(f"file://{tmp_path}")


def test_a_missing_file_names_its_url(server, tmp_path):
    _, base = server
    url = f"{base}/missing.jsonl"
    assert remote_total_bytes([url]) == 0
    with pytest.raises(DataError, match=f"{url} answered HTTP 404"):
        _read([url])
    with pytest.raises(DataError, match="no file at file://"):
        _read([f"file://{tmp_path}/missing.jsonl"])


def test_a_refused_connection_names_its_url():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/a.jsonl"
    with pytest.raises(DataError, match=f"{url} refused the connection"):
        _read([url])


def test_a_stalled_server_fails_within_the_timeout(monkeypatch):
    monkeypatch.setattr(remote_documents, "TIMEOUT", 0.5)
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/a.jsonl"
        assert remote_total_bytes([url]) == 0
        with pytest.raises(DataError, match="sent nothing for 0.5 s"):
            _read([url])


class _StallingHandler(SimpleHTTPRequestHandler):
    """Sends its headers and one line of a longer body, then nothing (for a while: the client gives up first)."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"text": "before the stall"}\n')
        self.wfile.flush()
        time.sleep(3)

    def log_message(self, format, *args):
        pass


def test_a_server_that_stalls_mid_file_fails_within_the_timeout(monkeypatch):
    monkeypatch.setattr(remote_documents, "TIMEOUT", 0.5)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StallingHandler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/a.jsonl"
        reading = Reading(total_bytes=0, on_progress=None)
        documents = read_remote_documents([url], "text", reading)
        begin = time.monotonic()
        with pytest.raises(DataError, match="sent nothing for 0.5 s"):
            next(documents)  # the first line arrives, but the reader waits for a full piece: the stall shows here
        assert time.monotonic() - begin < 2.5
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
