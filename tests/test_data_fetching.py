"""Fetching a published corpus's chunks, verified: a real HTTP server on loopback that serves them right, wrong,
broken off, trickling or not at all; hostile indexes; the cache's cap; peers that hand chunks out over real
hivemind P2P (one that sends wrong bytes is banned); the reading order's coverage; a restarted reader's place."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from conftest import tiny_manifest_dict
from swarm.dataset import locations
from swarm.dataset.cache import ChunkCache, parse_size
from swarm.dataset.corpus import prepare_corpus
from swarm.dataset.fetching import ChunkFetcher, PeerSource, fetch_index
from swarm.dataset.index import MAX_CHUNKS, parse_index
from swarm.dataset.locations import FolderLocation, WebLocation, location_of
from swarm.dataset.reading_order import choose_chunk, from_bitmap, to_bitmap
from swarm.dataset.sharing import MAX_PER_ASKER, DataService
from swarm.dataset.stream import ChunkStream
from swarm.dataset.tokenizer import byte_tokenizer
from swarm.errors import ChunkError, DataError
from swarm.manifests.validation import manifest_from_dict

CHUNK_TOKENS = 2000


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A small corpus prepared into chunks of 2,000 byte tokens (about 25 chunks)."""
    folder = tmp_path_factory.mktemp("corpus")
    source = folder / "text"
    source.mkdir()
    for k in range(40):
        (source / f"doc{k}.txt").write_text(f"document {k}: " + " ".join(f"word{(k * j) % 97}" for j in range(250)))
    prepare_corpus(str(source), folder / "prepared", byte_tokenizer(), chunk_tokens=CHUNK_TOKENS)
    return folder / "prepared"


class Behaviour:
    """What the test server does with each file: 'ok', 'wrong' (flipped bytes), 'cut' (half, then closes),
    'trickle' (a byte now and then), '404', '500'. Range requests are honoured (for resumes)."""

    def __init__(self):
        self.modes: dict[str, str] = {}
        self.requests: list[tuple[str, str | None]] = []


def serve(folder: Path, behaviour: Behaviour):
    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            name = self.path.rsplit("/", 1)[-1]
            behaviour.requests.append((name, self.headers.get("Range")))
            mode = behaviour.modes.get(name, "ok")
            if mode in ("404", "500"):
                self.send_error(int(mode))
                return
            path = folder / name
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            start = 0
            if self.headers.get("Range") and mode != "norange":
                start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
            body = data[start:]
            if mode == "wrong":
                body = bytes(b ^ 0xFF for b in body)
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if mode == "cut":
                behaviour.modes[name] = "ok"  # the next try resumes and succeeds
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            if mode == "trickle":
                import time

                for byte in body[:50]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.1)
                return
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def web(prepared):
    behaviour = Behaviour()
    server = serve(prepared, behaviour)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", behaviour
    finally:
        server.shutdown()
        server.server_close()


def index_of(prepared: Path):
    return parse_index((prepared / "index.json").read_bytes(), "test")


def test_chunks_come_verified_from_the_web_resuming_a_broken_download(prepared, web, tmp_path):
    url, behaviour = web
    index = index_of(prepared)
    cache = ChunkCache(tmp_path / "cache", 10 * CHUNK_TOKENS)
    fetcher = ChunkFetcher(index, [location_of(url, "")], cache)
    first, second = index.chunks[0], index.chunks[1]
    behaviour.modes[second.file] = "cut"

    async def run():
        tokens = await fetcher.get(first)
        assert bytes(tokens) == (prepared / first.file).read_bytes()
        with pytest.raises(ChunkError, match="broke off|ended|stopped"):
            await fetcher.get(second)  # half of it arrived, then the connection closed
        fetcher._skip_until.clear()
        tokens = await fetcher.get(second)  # resumed with a range request
        assert bytes(tokens) == (prepared / second.file).read_bytes()

    asyncio.run(run())
    heldout = asyncio.run(fetcher.heldout())  # fetched the same way
    assert bytes(heldout) == b"".join((prepared / chunk.file).read_bytes() for chunk in index.heldout)
    ranges = [r for name, r in behaviour.requests if name == second.file]
    assert ranges == [None, f"bytes={second.size // 2}-"]
    heldout_size = sum(chunk.size for chunk in index.heldout)
    assert fetcher.stats.bytes_from["web"] == first.size + second.size + heldout_size  # nothing downloaded twice
    assert cache.has(first.sha256) and cache.has(second.sha256)


@pytest.mark.parametrize("mode, error", [("wrong", "SHA-256"), ("404", "HTTP 404"), ("500", "HTTP 500")])
def test_a_bad_server_is_refused_and_a_mirror_used(prepared, web, tmp_path, mode, error):
    url, behaviour = web
    index = index_of(prepared)
    chunk = index.chunks[2]
    behaviour.modes[chunk.file] = mode
    mirror = FolderLocation(prepared)
    fetcher = ChunkFetcher(index, [location_of(url, ""), mirror], ChunkCache(tmp_path / "c", 10 * CHUNK_TOKENS))
    with pytest.raises(ChunkError, match=error):  # no mirror that can be downloaded from: the reason is named
        asyncio.run(ChunkFetcher(index, [location_of(url, "")], ChunkCache(tmp_path / "d", 10**6)).get(chunk))
    tokens = asyncio.run(fetcher.get(chunk))
    assert bytes(tokens) == (prepared / chunk.file).read_bytes()
    if mode == "wrong":
        assert not ChunkCache(tmp_path / "d", 10**6).has(chunk.sha256)  # wrong bytes never enter the cache


def test_a_trickling_server_is_given_up_at_the_stall_limit(prepared, web, tmp_path, monkeypatch):
    url, behaviour = web
    index = index_of(prepared)
    chunk = index.chunks[3]
    behaviour.modes[chunk.file] = "trickle"
    monkeypatch.setattr(locations, "STALL_LIMIT", 1.0)
    monkeypatch.setattr(locations, "MIN_RATE", 10**9)  # the chunk's deadline: STALL_LIMIT
    fetcher = ChunkFetcher(index, [location_of(url, "")], ChunkCache(tmp_path / "c", 10**6))
    with pytest.raises(ChunkError, match="too slow|stopped sending"):
        asyncio.run(fetcher.get(chunk))


def test_hostile_indexes_are_refused(prepared):
    good = json.loads((prepared / "index.json").read_text())

    def bad(**changes) -> bytes:
        index = json.loads(json.dumps(good))
        for key, value in changes.items():
            if key == "chunk0":
                index["chunks"][0].update(value)
            else:
                index[key] = value
        return json.dumps(index).encode()

    for name in ("../etc/passwd", "/etc/passwd", "http://evil.example/x.bin", ".hidden", "a/b.bin", ""):
        with pytest.raises(DataError, match="plain file name"):
            parse_index(bad(chunk0={"file": name}), "test")
    with pytest.raises(DataError, match="size"):
        parse_index(bad(chunk0={"size": 10**15}), "test")
    with pytest.raises(DataError, match="tokens"):
        parse_index(bad(chunk0={"tokens": -1}), "test")
    with pytest.raises(DataError, match="more than"):
        parse_index(bad(chunks=good["chunks"] * (MAX_CHUNKS // len(good["chunks"]) + 1)), "test")
    with pytest.raises(DataError, match="not JSON"):
        parse_index(b"\xff\xfe{", "test")
    with pytest.raises(DataError, match="pins"):
        parse_index((prepared / "index.json").read_bytes(), "test", expected_sha256="0" * 64)
    with pytest.raises(DataError, match="not a folder next to the manifest"):
        location_of("../elsewhere", "http://127.0.0.1:1/swarm.json")
    assert location_of("prepared", "http://127.0.0.1:1/x/swarm.json").name == "http://127.0.0.1:1/x/prepared/"


def test_the_cache_keeps_its_cap_and_refuses_less_than_two_chunks(prepared, tmp_path):
    index = index_of(prepared)
    with pytest.raises(DataError, match="smaller than two of this swarm's chunks.*--data-cache"):
        ChunkCache(tmp_path / "small", CHUNK_TOKENS).check_cap(CHUNK_TOKENS)
    cache = ChunkCache(tmp_path / "c", 3 * CHUNK_TOKENS)
    fetcher = ChunkFetcher(index, [WebLocation("http://127.0.0.1:9/"), FolderLocation(tmp_path / "none")], cache)
    fetcher.locations = [_CopyingFolder(prepared)]

    async def run():
        for chunk in index.chunks[:6]:
            await fetcher.get(chunk)
            assert cache.used_bytes <= cache.cap_bytes

    asyncio.run(run())
    held = cache.held()
    assert len(held) == 3 and index.chunks[5].sha256 in held and index.chunks[0].sha256 not in held  # LRU went
    assert parse_size("4GB") == 4 * 10**9 and parse_size("16MiB") == 16 * 2**20
    with pytest.raises(DataError, match="not a size"):
        parse_size("lots")


class _CopyingFolder(FolderLocation):
    """A folder read as if it were remote: its chunks are copied into the cache (what a download does)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.kind = "store"

    def local_path(self, chunk):
        return None

    def download(self, chunk, part, on_bytes):
        FolderLocation.download(FolderLocation(self.folder), chunk, part, on_bytes)


def test_a_full_disk_while_caching_is_one_line(prepared, tmp_path):
    """The cache's disk (a 16 kB tmpfs this test mounts: it needs root) fills up under a cap that is larger."""
    import os
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        index = index_of(prepared)
        fetcher = ChunkFetcher(index, [_CopyingFolder(prepared)], ChunkCache(disk / "cache", 10**6))

        async def run():
            for chunk in index.chunks:  # 2,000 bytes each: the disk is full after a few
                await fetcher.get(chunk)

        with pytest.raises(DataError, match="disk of the data cache .* is full: free space there"):
            asyncio.run(run())
    finally:
        subprocess.run(["umount", str(disk)])


def test_peers_hand_out_chunks_and_one_that_sends_wrong_bytes_is_banned(prepared, tmp_path):
    index = index_of(prepared)
    manifest = manifest_from_dict(tiny_manifest_dict(data={"source": "prepared", "index_sha256": index.sha256}))
    chunk = index.chunks[4]

    async def run():
        honest_p2p, liar_p2p = await P2P.create(), await P2P.create()
        maddrs = [*await honest_p2p.get_visible_maddrs(), *await liar_p2p.get_visible_maddrs()]
        asker_p2p = await P2P.create(initial_peers=maddrs)
        try:
            honest, liar = DataService(manifest), DataService(manifest)
            honest.holdings = lambda sha256: prepared / chunk.file if sha256 == chunk.sha256 else None
            wrong = bytes(b ^ 1 for b in (prepared / chunk.file).read_bytes())
            liar.holdings = lambda sha256: wrong if sha256 == chunk.sha256 else None
            for service, p2p in ((honest, honest_p2p), (liar, liar_p2p)):
                await service.add_p2p_handlers(p2p, namespace=DataService.NAMESPACE)
            liar_id, honest_id = str(liar_p2p.peer_id), str(honest_p2p.peer_id)
            holders = [liar_id]
            peers = PeerSource(asker_p2p, manifest, holders=lambda number: list(holders), anyone=lambda: [])
            fetcher = ChunkFetcher(
                index, [WebLocation("http://127.0.0.1:9/")], ChunkCache(tmp_path / "c", 10**6), peers
            )
            with pytest.raises(ChunkError, match="SHA-256 is not the chunk's"):
                await fetcher.get(chunk)  # only the liar holds it: its copy is refused, never cached
            assert liar_id in peers.banned and not fetcher.cache.has(chunk.sha256)
            holders.append(honest_id)
            tokens = await fetcher.get(chunk)  # the liar is not asked again; the honest peer's copy is verified
            assert bytes(tokens) == (prepared / chunk.file).read_bytes()
            assert liar.served_bytes == chunk.size and honest.served_bytes == chunk.size
            # a flood: many pieces at once from one asker; never more than MAX_PER_ASKER of them are served at once
            # (how many are refused depends on how the requests interleave, which load changes), and nothing breaks
            from swarm.dataset.sharing import fetch_from_peer

            asker_id, held_at_once = str(asker_p2p.peer_id), []

            def counting(sha256: str):
                held_at_once.append(honest.in_flight[asker_id])
                return prepared / chunk.file if sha256 == chunk.sha256 else None

            honest.holdings = counting
            results = await asyncio.gather(
                *[
                    fetch_from_peer(
                        asker_p2p, honest_id, manifest, chunk.sha256, chunk.size, tmp_path / f"f{k}", abs, 30
                    )
                    for k in range(12)
                ],
                return_exceptions=True,
            )
            assert held_at_once and max(held_at_once) <= MAX_PER_ASKER, held_at_once
            assert all(r is None or (isinstance(r, ChunkError) and "too many" in str(r)) for r in results), results
            # an asker with MAX_PER_ASKER pieces in flight here is refused, whatever the timing
            honest.in_flight[asker_id] = MAX_PER_ASKER
            refused_before = honest.refused_busy
            with pytest.raises(ChunkError, match="too many"):
                await fetch_from_peer(asker_p2p, honest_id, manifest, chunk.sha256, chunk.size, tmp_path / "x", abs, 30)
            assert honest.refused_busy == refused_before + 1
            del honest.in_flight[asker_id]
            await fetch_from_peer(asker_p2p, honest_id, manifest, chunk.sha256, chunk.size, tmp_path / "after", abs, 30)
            return peers.banned, fetcher.stats
        finally:
            for p2p in (honest_p2p, liar_p2p, asker_p2p):
                await p2p.shutdown()

    banned, stats = asyncio.run(run())
    assert stats.refused["wrong hash"] == 1 and stats.bytes_from["peer"] == 2 * chunk.size


def test_the_index_comes_from_a_peer_when_no_location_answers(prepared, tmp_path):
    index = index_of(prepared)
    manifest = manifest_from_dict(tiny_manifest_dict(data={"source": "prepared", "index_sha256": index.sha256}))

    async def run():
        holder_p2p = await P2P.create()
        asker_p2p = await P2P.create(initial_peers=await holder_p2p.get_visible_maddrs())
        try:
            service = DataService(manifest)
            service.holdings = lambda sha256: index.raw if sha256 == index.sha256 else None
            await service.add_p2p_handlers(holder_p2p, namespace=DataService.NAMESPACE)
            peers = PeerSource(asker_p2p, manifest, holders=lambda n: [], anyone=lambda: [str(holder_p2p.peer_id)])
            cache = ChunkCache(tmp_path / "c", 10**6)
            got = await fetch_index([location_of("http://127.0.0.1:9/data/", "")], index.sha256, cache, peers)
            assert got.sha256 == index.sha256 and cache.has(index.sha256)
            with pytest.raises(DataError, match="cannot get the swarm's data index.*--no-trainer"):
                await fetch_index([location_of("http://127.0.0.1:9/", "")], "1" * 64, cache, None)
        finally:
            await holder_p2p.shutdown()
            await asker_p2p.shutdown()

    asyncio.run(run())


def test_readers_cover_an_epoch_with_few_duplicates():
    """Trainers that come and go, each choosing by what the others' records said a moment ago (a stale view):
    the swarm reads every chunk of the epoch, and few twice."""
    count, readers = 400, [f"reader{k}" for k in range(6)]
    finished: dict[str, set[int]] = {r: set() for r in readers}
    reading: dict[str, int | None] = {r: None for r in readers}
    view_finished: set[int] = set()
    view_taken: dict[str, int | None] = {}
    reads = []
    for step in range(count * 2):
        reader = readers[step % len(readers)]
        if step % 37 == 0:  # a trainer leaves and a new one starts in its place
            reading[reader] = None
        if reading[reader] is not None:
            finished[reader].add(reading[reader])
            reads.append(reading[reader])
        taken = {c for r, c in view_taken.items() if r != reader and c is not None}
        chunk = choose_chunk("data", 0, count, reader, view_finished | finished[reader], taken)
        reading[reader] = chunk
        if step % len(readers) == 0:  # the DHT view refreshes every round of the readers
            view_finished = set().union(*finished.values())
            view_taken = dict(reading)
        if len(set(reads)) == count:
            break
    assert len(set(reads)) == count
    assert (len(reads) - count) / len(reads) <= 0.05
    bitmap = to_bitmap({0, 5, 399}, count)
    assert len(bitmap) == 50 and from_bitmap(bitmap, count) == {0, 5, 399} and from_bitmap(bitmap, 401) == set()


def test_a_restarted_reader_resumes_its_place(prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "home"))
    index = index_of(prepared)

    def stream() -> ChunkStream:
        fetcher = ChunkFetcher(index, [FolderLocation(prepared)], ChunkCache(tmp_path / "c", 10**6))
        return ChunkStream(fetcher, "QmReader", "swarm0123456789a")

    async def read(s: ChunkStream, batches: int) -> list[bytes]:
        return [bytes((await s.next_batch(4, 32))[0].numpy().astype("uint8")) for _ in range(batches)]

    async def run():
        first = stream()
        seen = await read(first, 30)  # a chunk of 2,000 tokens has 60 windows of 33: 120 windows read
        await first.close()
        finished, current = set(first.mine), first.current.chunk
        again = stream()  # the same identity, restarted
        assert again.mine == finished and again.queue[0][0] == current
        more = await read(again, 10)
        await again.close()
        return seen, more, again

    seen, more, again = asyncio.run(run())
    assert not set(more) & set(seen)  # no window read twice
    assert again.place.duplicates == 0


def test_swarm_init_pins_data_published_at_a_url(prepared, web, tmp_path, capsys):
    from peers.swarm_init import main

    url, _ = web
    out = tmp_path / "swarm.json"
    assert (
        main(["web", "--preset", "tiny", "--data", url, "--mirror", "https://mirror.example/d/", "--out", str(out)])
        == 0
    )
    data = json.loads(out.read_text())["data"]
    assert data["index_sha256"] == index_of(prepared).sha256 and data["source"] == url
    assert data["mirrors"] == ["https://mirror.example/d/"]
    without = tmp_path / "plain.json"
    assert main(["web", "--preset", "tiny", "--data", url, "--out", str(without)]) == 0
    from swarm.manifests.loading import load_manifest

    assert load_manifest(out).swarm_id == load_manifest(without).swarm_id  # mirrors are places, not the swarm
    capsys.readouterr()
    assert main(["web", "--preset", "tiny", "--data", "http://127.0.0.1:9/d/", "--out", str(tmp_path / "x.json")]) == 2
    assert "cannot read the data's index" in capsys.readouterr().err
