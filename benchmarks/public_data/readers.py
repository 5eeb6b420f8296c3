"""The reading half of the public data benchmark (__main__.py): trainers' data layers alone (no model), reading
one epoch of a published corpus as fast as their links allow, each with its own DHT node, cache and emulated link
to the web server, handing chunks to each other over real hivemind P2P. What it measures is the data layer's own
figures: the first batch's wait, bytes downloaded per token read, and duplicates over an epoch with no coordinator.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from hivemind import DHT

from swarm.dataset.cache import ChunkCache
from swarm.dataset.fetching import ChunkFetcher, PeerSource, fetch_index
from swarm.dataset.locations import location_of
from swarm.dataset.sharing import DataService
from swarm.dataset.stream import ChunkStream
from swarm.manifests.manifest import Manifest

BATCH, LENGTH = 8, 1023  # a reader's batch: 8 windows of 1,024 tokens


class Reader:
    """One trainer's data layer: a DHT node, a DataService, a ChunkStream reading through `url`."""

    def __init__(self, name: str, manifest: Manifest, url: str, cache: Path, initial_peers: list[str]):
        self.name, self.manifest, self.url, self.cache_folder = name, manifest, url, cache
        self.dht = DHT(start=True, initial_peers=initial_peers)
        self.stream: ChunkStream | None = None
        self.first_batch: float | None = None
        self.tokens = 0
        self.longest_wait = 0.0

    async def open(self, started: float) -> None:
        p2p = await self.dht.replicate_p2p()
        service = DataService(self.manifest)
        await service.add_p2p_handlers(p2p, namespace=DataService.NAMESPACE)
        peers = PeerSource(
            p2p,
            self.manifest,
            holders=lambda chunk: self.stream.holders(chunk) if self.stream is not None else [],
            anyone=lambda: [],
        )
        cache = ChunkCache(self.cache_folder, 4 * 10**9)
        index = await fetch_index([location_of(self.url, "")], self.manifest.data.index_sha256, cache, peers)
        fetcher = ChunkFetcher(index, [location_of(self.url, "")], cache, peers)
        service.holdings = fetcher.holdings
        self.stream = ChunkStream(fetcher, str(self.dht.peer_id), self.manifest.swarm_id, self.dht, announce_period=1.0)
        await self.stream.next_batch(BATCH, LENGTH)
        self.first_batch = time.monotonic() - started
        self.tokens += BATCH * (LENGTH + 1)

    async def read_until(self, stop: asyncio.Event, epochs: int, rate: float) -> None:
        """Read batches at `rate` tokens per second (a GPU trainer's pace) until this reader's epoch is `epochs`."""
        begin = time.monotonic()
        while not stop.is_set() and self.stream.epoch < epochs:
            asked = time.monotonic()
            await self.stream.next_batch(BATCH, LENGTH)
            self.longest_wait = max(self.longest_wait, time.monotonic() - asked)
            self.tokens += BATCH * (LENGTH + 1)
            await asyncio.sleep(max(0.0, begin + self.tokens / rate - time.monotonic()))

    def figures(self) -> dict:
        stats = self.stream.fetcher.stats
        return {
            "first_batch_s": round(self.first_batch or -1, 2),
            "tokens_read": self.tokens,
            "bytes_downloaded": stats.downloaded,
            "bytes_from": dict(stats.bytes_from),
            "refused": dict(stats.refused),
            "chunks_read": self.stream.place.chunks_read,
            "duplicates": self.stream.place.duplicates,
            "longest_wait_s": round(self.longest_wait, 2),
            "others_seen": len(self.stream.records),
            "prefetch": self.stream.prefetch,
        }

    def close(self) -> None:
        self.dht.shutdown()


async def read_one_epoch(
    manifest: Manifest, urls: list[str], work: Path, token_bytes: int, rate: float, timeout: float
) -> dict:
    """Readers (one per URL, each URL behind its own link) read at `rate` tokens/s each until the swarm finished
    epoch 0; figures. Chunks read twice are counted exactly, from what every reader finished."""
    first = DHT(start=True)
    initial = [str(a) for a in first.get_visible_maddrs()]
    readers = [Reader(f"r{k}", manifest, url, work / f"cache{k}", initial) for k, url in enumerate(urls)]
    try:
        started = time.monotonic()
        await asyncio.gather(*(reader.open(started) for reader in readers))
        for _ in range(60):  # every reader must see the others' records (a DHT node that did not join reads alone)
            for reader in readers:
                await reader.stream._look(force=True)
            if all(len(reader.stream.records) == len(readers) - 1 for reader in readers):
                break
            await asyncio.sleep(0.5)
        isolated = sum(len(reader.stream.records) < len(readers) - 1 for reader in readers)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(reader.read_until(stop, 1, rate)) for reader in readers]
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.ALL_COMPLETED)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        seconds = time.monotonic() - started
        per_reader = [reader.figures() for reader in readers]
        chunks = readers[0].stream.count
        history = [entry for reader in readers for entry in reader.stream.history if entry[0] == 0]
        finished = [chunk for _, chunk, read, windows in history if read == windows]
        reads, duplicates = len(finished), len(finished) - len(set(finished))
        read_windows: dict[int, int] = {}
        windows_in: dict[int, int] = {}
        for _, chunk, read, windows in history:
            read_windows[chunk] = read_windows.get(chunk, 0) + read
            windows_in[chunk] = windows
        twice = sum(max(0, read_windows[c] - windows_in[c]) for c in read_windows)
        return {
            "seconds": round(seconds, 1),
            "epoch_done": len(done) == len(readers),
            "readers_not_seeing_all_others_at_start": isolated,
            "chunks_never_read": chunks - len(set(finished)),
            "duplicates_seen_by_readers": sum(f["duplicates"] for f in per_reader),
            "chunks": chunks,
            "chunk_reads": reads,
            "duplicate_chunk_reads": duplicates,
            "duplicate_fraction": round(duplicates / max(reads, 1), 4),
            # windows read by more than one reader (chunks left to another reader count too), of all windows read
            "duplicate_token_fraction": round(twice / max(sum(read_windows.values()), 1), 4),
            "bytes_per_token_read": round(
                sum(f["bytes_downloaded"] for f in per_reader)
                / max(sum(f["tokens_read"] for f in per_reader), 1)
                / token_bytes,
                3,
            ),
            "first_batch_s": [f["first_batch_s"] for f in per_reader],
            "readers": per_reader,
        }
    finally:
        for reader in readers:
            reader.close()
        first.shutdown()
