"""Getting a chunk (or the data's index) onto this machine, verified: from the cache, the published locations in
order, then the peers that hold it.

Nothing is trained on before its SHA-256 is checked: a chunk read in place from a folder is hashed once, a
download is hashed before it enters the cache, and a copy that fails is thrown away and counted. A location that
fails (down, 404, too slow, wrong bytes) is skipped for a while, longer each time; a peer that sends wrong bytes is
not asked again. Concurrent requests for one chunk share one download; `prefetch` starts one ahead of need.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hivemind.p2p import P2P

from swarm.dataset.cache import ChunkCache, full_disk_error
from swarm.dataset.index import MAX_INDEX_BYTES, Chunk, DataIndex, parse_index
from swarm.dataset.locations import Location, chunk_deadline, remove_quietly
from swarm.dataset.sharing import fetch_from_peer
from swarm.errors import ChunkError, DataError
from swarm.manifests.manifest import Manifest

logger = logging.getLogger(__name__)

BACKOFF_FIRST, BACKOFF_MAX = 10.0, 300.0  # seconds a failed location is skipped: doubling from the first
PEERS_ASKED = 4  # peers asked for one chunk, one after another
RATE_WINDOW = 10.0  # seconds the download rate is measured over
PROGRESS_EVERY = 10.0  # seconds between two progress lines of one long download


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class FetchStats:
    """What the fetcher did: bytes by where they came from ("web", "store", "folder", "peer"), chunks fetched, and
    the copies refused or failed, by reason."""

    bytes_from: collections.Counter = field(default_factory=collections.Counter)
    chunks: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)  # "wrong hash", "failed", ...
    recent: collections.deque = field(default_factory=collections.deque)  # (time, bytes)

    def count(self, kind: str, size: int) -> None:
        self.bytes_from[kind] += size
        now = time.monotonic()
        self.recent.append((now, size))
        while self.recent and self.recent[0][0] < now - RATE_WINDOW:
            self.recent.popleft()

    def rate(self) -> float:
        """Bytes per second over the last RATE_WINDOW seconds."""
        now = time.monotonic()
        return sum(size for at, size in self.recent if at >= now - RATE_WINDOW) / RATE_WINDOW

    @property
    def downloaded(self) -> int:
        return sum(size for kind, size in self.bytes_from.items() if kind != "folder")


class PeerSource:
    """The swarm's peers as a source of data: `holders(chunk number)` says who holds a train chunk (from their
    reader records: swarm/dataset/progress.py), `anyone()` who may hold the index."""

    def __init__(
        self, p2p: P2P, manifest: Manifest, holders: Callable[[int], list[str]], anyone: Callable[[], list[str]]
    ):
        self.p2p, self.manifest = p2p, manifest
        self.holders, self.anyone = holders, anyone
        self.banned: set[str] = set()  # sent wrong bytes


class ChunkFetcher:
    """Chunks of `index`, verified, from `cache`, `locations` (in order) or `peers`."""

    def __init__(self, index: DataIndex, locations: list[Location], cache: ChunkCache, peers: PeerSource | None = None):
        self.index, self.locations, self.cache, self.peers = index, locations, cache, peers
        self.stats = FetchStats()
        self._verified: set[str] = set()  # chunks read in place, already hashed
        self._pending: dict[str, asyncio.Future] = {}
        self._skip_until: dict[str, float] = {}  # location name -> time
        self._backoff: dict[str, float] = {}
        self._by_sha = index.by_sha256()

    # ------------------------------------------------------------------------------ what others may ask for

    def holdings(self, sha256: str) -> Path | bytes | None:
        """This machine's verified copy of the index or of one of its chunks (what DataService hands out)."""
        if sha256 == self.index.sha256:
            return self.index.raw
        chunk = self._by_sha.get(sha256)
        if chunk is None:
            return None
        for location in self.locations:  # a folder on this machine (the asker verifies what it gets, as always)
            if (path := location.local_path(chunk)) is not None:
                return path
        return self.cache.path(sha256) if self.cache.has(sha256) else None

    def held_numbers(self) -> set[int]:
        """The train chunks this machine holds: in its cache (verified), or in a folder it reads in place."""
        folders = [location for location in self.locations if location.kind == "folder"]
        if folders and all(folders[0].local_path(chunk) is not None for chunk in self.index.chunks[:1]):
            return {chunk.number for chunk in self.index.chunks if folders[0].local_path(chunk) is not None}
        held = self.cache.held()
        return {chunk.number for chunk in self.index.chunks if chunk.sha256 in held}

    # ------------------------------------------------------------------------------ getting a chunk

    def prefetch(self, chunk: Chunk) -> None:
        """Start fetching `chunk` now (its failure is only logged: `get` will try again)."""
        future = self._start(chunk)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" line

    async def get(self, chunk: Chunk) -> np.ndarray:
        """The chunk's tokens (memory-mapped), verified. ChunkError if no place gave it; DataError if this machine
        cannot keep it (a full disk, a cache full of chunks in use)."""
        path = await asyncio.shield(self._start(chunk))
        return np.memmap(path, dtype=self.index.dtype, mode="r", shape=(chunk.tokens,))

    def _start(self, chunk: Chunk) -> asyncio.Future:
        future = self._pending.get(chunk.sha256)
        if future is None:
            future = asyncio.ensure_future(self._fetch(chunk))
            self._pending[chunk.sha256] = future
            future.add_done_callback(lambda _: self._pending.pop(chunk.sha256, None))
        return future

    async def _fetch(self, chunk: Chunk) -> Path:
        for location in self.locations:
            path = location.local_path(chunk)
            if path is not None and (chunk.sha256 in self._verified or await self._verify_in_place(path, chunk)):
                return path
        if self.cache.has(chunk.sha256):
            self.cache.touch(chunk.sha256)
            return self.cache.path(chunk.sha256)
        self.cache.make_room(chunk.size)
        errors: list[str] = []
        for location in self.locations:
            if location.kind == "folder" or self._skip_until.get(location.name, 0) > time.monotonic():
                continue
            try:
                path = await asyncio.to_thread(self._download, location, chunk)
                self._succeeded(location)
                return path
            except ChunkError as e:
                errors.append(str(e))
                self._failed(location, str(e))
        if self.peers is not None:
            holders = [p for p in self.peers.holders(chunk.number) if p not in self.peers.banned]
            random.shuffle(holders)
            for peer_id in holders[:PEERS_ASKED]:
                try:
                    return await self._from_peer(peer_id, chunk)
                except ChunkError as e:
                    errors.append(str(e))
        where = "; ".join(errors[-3:]) or "no place holds it (the published locations are skipped after failures)"
        raise ChunkError(f"data chunk {chunk.file} could not be fetched: {where}")

    async def heldout(self) -> np.ndarray:
        """The held-out part's tokens: every held-out chunk, fetched and verified like the train chunks."""
        parts = [np.asarray(await self.get(chunk)) for chunk in self.index.heldout]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.index.dtype)

    async def _verify_in_place(self, path: Path, chunk: Chunk) -> bool:
        try:
            ok = path.stat().st_size == chunk.size and await asyncio.to_thread(file_sha256, path) == chunk.sha256
        except OSError:
            ok = False
        if ok:
            self._verified.add(chunk.sha256)
            self.stats.count("folder", chunk.size)
        else:
            self.stats.refused["wrong hash"] += 1
            logger.warning(f"the data file {path} does not have the SHA-256 its index states: not read from there")
        return ok

    def _download(self, location: Location, chunk: Chunk) -> Path:
        """In a worker thread: download, verify, keep. ChunkError on any failure of the location. A download that
        takes long says how far it is every PROGRESS_EVERY seconds (a slow link is not a silent stall)."""
        with self.cache.download_lock(chunk.sha256):
            if self.cache.has(chunk.sha256):  # another process of this machine fetched it meanwhile
                return self.cache.path(chunk.sha256)
            part = self.cache.part_path(chunk.sha256)
            begin = said = time.monotonic()
            done = 0

            def on_bytes(size: int) -> None:
                nonlocal said, done
                done += size
                self.stats.count(location.kind, size)
                if time.monotonic() - said >= PROGRESS_EVERY:
                    said = time.monotonic()
                    rate = done * 8 / 1e6 / max(said - begin, 1e-9)
                    logger.info(
                        f"data: {chunk.file} from {location.name}: {done:,} of {chunk.size:,} bytes, {rate:.1f} Mbit/s"
                    )

            try:
                location.download(chunk, part, on_bytes)
            except OSError as e:  # the part file could not be created or opened: this machine's disk, not the place
                raise full_disk_error(self.cache.folder, e) from None
            if file_sha256(part) != chunk.sha256:
                remove_quietly(part)
                self.stats.refused["wrong hash"] += 1
                raise ChunkError(f"{location.name}{chunk.file} sent bytes whose SHA-256 is not the chunk's")
            self.stats.chunks += 1
            return self.cache.commit(part, chunk.sha256)

    async def _from_peer(self, peer_id: str, chunk: Chunk) -> Path:
        part = self.cache.folder / f"{chunk.sha256}.{peer_id[-12:]}.peer"
        try:
            await fetch_from_peer(
                self.peers.p2p,
                peer_id,
                self.peers.manifest,
                chunk.sha256,
                chunk.size,
                part,
                lambda size: self.stats.count("peer", size),
                chunk_deadline(chunk.size),
            )
        except ChunkError:
            self.stats.refused["failed"] += 1
            remove_quietly(part)
            raise
        try:
            if await asyncio.to_thread(file_sha256, part) != chunk.sha256:
                self.peers.banned.add(peer_id)
                self.stats.refused["wrong hash"] += 1
                logger.warning(f"peer {peer_id} sent data chunk {chunk.file} with the wrong SHA-256: not asked again")
                raise ChunkError(f"peer {peer_id[-8:]} sent bytes whose SHA-256 is not the chunk's")
            self.stats.chunks += 1
            return self.cache.commit(part, chunk.sha256)
        finally:
            remove_quietly(part)

    def _failed(self, location: Location, reason: str) -> None:
        if "SHA-256" not in reason:  # a wrong copy was counted where its hash was checked (_download)
            self.stats.refused["failed"] += 1
        wait = min(BACKOFF_MAX, self._backoff.get(location.name, BACKOFF_FIRST / 2) * 2)
        self._backoff[location.name] = wait
        self._skip_until[location.name] = time.monotonic() + wait
        logger.warning(f"data: {reason}; not asking {location.name} for {wait:.0f} s")

    def _succeeded(self, location: Location) -> None:
        self._backoff.pop(location.name, None)


async def fetch_index(
    locations: list[Location], expected_sha256: str, cache: ChunkCache, peers: PeerSource | None
) -> DataIndex:
    """The data's index, pinned by `expected_sha256`: from the cache, a location, or a peer. DataError that lists
    what was tried if none has it."""
    tried: list[str] = []
    if cache.has(expected_sha256):
        try:
            return parse_index(
                cache.path(expected_sha256).read_bytes(), str(cache.path(expected_sha256)), expected_sha256
            )
        except (DataError, OSError) as e:
            tried.append(str(e))
    for location in locations:
        try:
            raw = await asyncio.to_thread(location.read_index)
            index = parse_index(
                raw, location.name + "index.json" if location.kind != "folder" else location.name, expected_sha256
            )
        except DataError as e:
            tried.append(str(e))
            continue
        cache.put(raw, expected_sha256)
        return index
    for peer_id in (peers.anyone() if peers is not None else [])[:PEERS_ASKED]:
        part = cache.folder / f"{expected_sha256}.{peer_id[-12:]}.peer"
        try:
            await fetch_from_peer(
                peers.p2p,
                peer_id,
                peers.manifest,
                expected_sha256,
                None,
                part,
                lambda size: None,
                60.0,
                MAX_INDEX_BYTES,
            )
            raw = part.read_bytes()
            index = parse_index(raw, f"peer {peer_id[-8:]}", expected_sha256)
        except DataError as e:
            tried.append(str(e))
            continue
        finally:
            remove_quietly(part)
        cache.put(raw, expected_sha256)
        logger.info(f"got the data's index from peer {peer_id[-8:]}")
        return index
    raise DataError(
        "cannot get the swarm's data index (" + "; ".join(t[:300] for t in tried[-4:]) + "): check that the data's "
        "URL is up, or join when a peer that holds the data is online; or run with --no-trainer to serve only"
    )
