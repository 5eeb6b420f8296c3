"""What a trainer reads: windows of the chunks it chooses (reading_order.py), fetched verified (fetching.py), one or
two chunks ahead of the one it trains on, while it tells the swarm how far it has read (progress.py).

`ChunkStream.next_batch` hands out microbatches. When a chunk is done, the trainer marks it finished, chooses the
next chunk by what the swarm has read, and starts fetching the ones after it. A chunk that cannot be fetched (every
place failed) is avoided for a while and another is chosen; if nothing new can be fetched at all, the trainer
re-reads a chunk it holds (counted as a duplicate) rather than stop training. Its place is kept on disk after every
few batches, so a restarted trainer with the same identity resumes it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from hivemind import DHT

from swarm.dataset.fetching import ChunkFetcher
from swarm.dataset.progress import ReaderPlace, ReaderRecord, fetch_reader_records, store_reader_record
from swarm.dataset.reading_order import (
    choose_chunk,
    epoch_coverage,
    from_bitmap,
    keeps_claim,
    to_bitmap,
    window_starts,
)
from swarm.errors import ChunkError, DataError

logger = logging.getLogger(__name__)

PREFETCH = 2  # chunks fetched ahead of the one being read, at most
WAITED = 0.5  # seconds of waiting for a chunk fetched ahead that make the reader fetch further ahead
AVOID_FOR = 60.0  # seconds a chunk that could not be fetched is not chosen again
SAVE_PERIOD = 5.0  # seconds between two saves of the place on disk
NOTHING_WAIT = 10.0  # seconds between two tries when no chunk can be had at all
HISTORY = 100_000  # chunks finished (or left to another trainer) last, kept for benchmarks


@dataclass
class Reading:
    """The chunk being read: its number, tokens, the order of its windows and how many are done."""

    chunk: int
    tokens: np.ndarray
    starts: np.ndarray
    done: int
    prefetched: bool = False  # the chunks after it are being fetched


class ChunkStream:
    """A trainer's reading of the data `fetcher` gets; `dht` and `swarm_id` (optional) share its progress."""

    def __init__(
        self,
        fetcher: ChunkFetcher,
        peer_id: str,
        swarm_id: str,
        dht: DHT | None = None,
        seed: int = 0,
        announce_period: float = 5.0,
    ):
        self.fetcher, self.index = fetcher, fetcher.index
        self.peer_id, self.swarm_id, self.dht = peer_id, swarm_id, dht
        self.reader = peer_id if not seed else f"{peer_id}/{seed}"  # whose order of chunks and windows
        self.count = len(self.index.chunks)
        if self.count == 0:
            raise DataError("the training data has no train chunks: prepare more data")
        self.announce_period = announce_period
        # chunks fetched ahead: as many as the cache holds beside the one read (at least two chunks fit: cache.py)
        largest = max(chunk.size for chunk in self.index.chunks)
        self.max_prefetch = max(0, min(PREFETCH, fetcher.cache.cap_bytes // max(largest, 1) - 1))
        # one ahead while that keeps up (a chunk downloads far faster than it is read on a home link), from the
        # middle of the current chunk; two, at once, once the reader had to wait for a chunk it had fetched ahead
        self.prefetch = min(1, self.max_prefetch)
        self.place_path = ReaderPlace.path(swarm_id, self.index.sha256, self.reader)
        self.place = ReaderPlace.load(self.place_path, self.count)
        self.epoch = self.place.epoch
        self.mine = set(self.place.finished)  # finished by this trainer in this epoch
        self.swarm = set()  # finished by others in this epoch, as their records say
        self.taken: set[int] = set()  # read or fetched by others now
        self.records: list[ReaderRecord] = []
        # (epoch, chunk, windows read, windows in it) of the chunks finished or left to another trainer, last first
        self.history: collections.deque[tuple[int, int, int, int]] = collections.deque(maxlen=HISTORY)
        self.avoid: dict[int, float] = {}
        self.queue: list[tuple[int, int]] = [(chunk, done) for chunk, done in self.place.reading]
        self.current: Reading | None = None
        self.window = 0
        self._seen_at = 0.0
        self._saved_at = 0.0
        self._background: asyncio.Task | None = None
        self._claiming: asyncio.Future | None = None
        self.first_look = True  # the epoch is checked against the swarm's at the first look
        self.ahead = 0  # the epoch other trainers have moved on to, if later than this one's

    # ------------------------------------------------------------------------------------------- batches

    async def next_batch(self, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs [batch_size, length] and their next-token targets, as int64."""
        window = length + 1
        if window != self.window:
            self.window, self.current = window, None
        rows = []
        while len(rows) < batch_size:
            if self.current is None or self.current.done >= len(self.current.starts):
                await self._next_chunk()
            reading = self.current
            start = int(reading.starts[reading.done])
            rows.append(np.asarray(reading.tokens[start : start + window]))
            reading.done += 1
            if not reading.prefetched and reading.done >= len(reading.starts) // 2:
                self._prefetch()  # by now the others have seen this trainer's claims: no download for nothing
        self.place.tokens += batch_size * window
        self._housekeeping()
        tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]

    async def first_chunk(self) -> None:
        """Fetch the first chunk this trainer will read, now: a peer that cannot get its data says so before it
        takes over a stage (DataError with the reason)."""
        await self._look(force=True)
        chunk, _ = self._upcoming()[0]
        try:
            await self.fetcher.get(self.index.chunks[chunk])
        except ChunkError as e:
            raise DataError(
                f"{e}. This peer cannot get the swarm's training data: check the data's URL, your network and disk, "
                "or run with --no-trainer to serve a stage only"
            ) from None

    # ------------------------------------------------------------------------------------------- choosing

    def _finished(self) -> set[int]:
        return self.mine | self.swarm

    def _upcoming(self) -> list[tuple[int, int]]:
        """The queue filled up to 1 + self.prefetch chunks (chunk, windows already read), moving to the next epoch when
        this one has nothing left that is not finished or taken."""
        now = time.monotonic()
        avoid = {chunk for chunk, until in self.avoid.items() if until > now}
        if self.ahead > self.epoch:  # read what it took of this epoch, choose nothing new in it, then follow
            if self.queue:
                return self.queue
            self._new_epoch(self.ahead)
        while len(self.queue) < 1 + self.prefetch:
            queued = {chunk for chunk, _ in self.queue}
            current = {self.current.chunk} if self.current is not None else set()
            chunk = choose_chunk(
                self.index.sha256,
                self.epoch,
                self.count,
                self.reader,
                self._finished() | current,
                self.taken | queued,
                avoid,
            )
            if chunk is not None:
                self.queue.append((chunk, 0))
                continue
            everything_else = choose_chunk(
                self.index.sha256, self.epoch, self.count, self.reader, self._finished() | current, self.taken | queued
            )
            if everything_else is not None or self.queue:
                break  # what is left cannot be fetched now (or is queued already): no new epoch for that
            self._new_epoch()
        if not self.queue:  # nothing new can be fetched: read again what this machine holds
            held = sorted(self.fetcher.held_numbers())
            if held:
                self.queue.append((held[int(np.random.default_rng().integers(len(held)))], 0))
        return self.queue

    def _new_epoch(self, epoch: int | None = None) -> None:
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self.mine, self.swarm, self.taken = set(), set(), set()
        logger.info(f"data: epoch {self.epoch} begins (every chunk of the last one was read or is being read)")

    async def _next_chunk(self) -> None:
        if self.current is not None:
            self._finish(self.current.chunk)
            self.current = None
        await self._look()
        while True:
            upcoming = self._upcoming()
            if not upcoming:
                logger.warning(
                    f"data: no chunk can be fetched now and none is held here; trying again in {NOTHING_WAIT:g} s"
                )
                await asyncio.sleep(NOTHING_WAIT)
                await self._look(force=True)
                continue
            chunk, done = upcoming.pop(0)
            self._claim()
            asked = time.monotonic()
            try:
                tokens = await self.fetcher.get(self.index.chunks[chunk])
                if time.monotonic() - asked > WAITED and self.place.chunks_read and self.prefetch < self.max_prefetch:
                    self.prefetch += 1
                    logger.info(
                        f"data: waited {time.monotonic() - asked:.1f} s for a chunk: fetching {self.prefetch} ahead"
                    )
            except ChunkError as e:
                self.avoid[chunk] = time.monotonic() + AVOID_FOR
                logger.warning(f"data: {e}; reading another chunk")
                continue
            self.fetcher.cache.pin(self.index.chunks[chunk].sha256)
            starts = window_starts(self.index.sha256, self.epoch, chunk, self.reader, len(tokens), self.window)
            self.current = Reading(chunk, tokens, starts, min(done, len(starts)))
            if self.prefetch > 1:  # downloads have been slow: fetch ahead at once
                self._prefetch()
            if self.current.done >= len(starts):  # smaller than one window, or read to its end before a restart
                self._finish(chunk)
                self.current = None
                continue
            return

    def _prefetch(self) -> None:
        """Start fetching the chunks queued after the current one (one ahead, two once downloads were slow)."""
        if self.current is not None:
            self.current.prefetched = True
        for following, _ in self.queue[: self.prefetch]:
            self.fetcher.prefetch(self.index.chunks[following])

    def _finish(self, chunk: int) -> None:
        if chunk in self.swarm or chunk in self.mine:
            self.place.duplicates += 1
        windows = len(self.current.starts) if self.current is not None else 0
        self.history.append((self.epoch, chunk, windows, windows))
        self.mine.add(chunk)
        self.place.chunks_read += 1
        self.fetcher.cache.unpin(self.index.chunks[chunk].sha256)
        self._save()

    def _abandon(self) -> None:
        """Leave the chunk being read to the trainer that has it first (its windows read here were read for
        nothing more than training: they are not marked finished)."""
        reading = self.current
        self.history.append((self.epoch, reading.chunk, reading.done, len(reading.starts)))
        self.fetcher.cache.unpin(self.index.chunks[reading.chunk].sha256)
        self.current = None
        logger.debug(f"data: chunk {reading.chunk} is another trainer's too; reading another")

    # ------------------------------------------------------------------------------------------- the swarm

    async def _look(self, force: bool = False) -> None:
        """Read the other trainers' records (at most every announce period, unless forced) and publish ours."""
        if self.dht is None or (not force and time.monotonic() - self._seen_at < self.announce_period):
            return
        self._seen_at = time.monotonic()
        try:
            records = await fetch_reader_records(self.dht, self.swarm_id, self.index.sha256, self.count)
        except Exception as e:  # a DHT timeout: read on with what is known
            logger.debug(f"data: reading the swarm's progress failed: {e!r}")
            return
        self.records = [record for record in records if record.peer_id != self.peer_id]
        if self.first_look and self.records:  # a new or returning trainer joins the epoch the swarm reads
            swarm_epoch = min(record.epoch for record in self.records)
            if swarm_epoch > self.epoch:
                self.epoch, self.mine, self.queue = swarm_epoch, set(), []
        self.first_look = False
        # what the swarm finished in an epoch only grows: merged, never rebuilt (a trainer that moved on to the next
        # epoch no longer states what it knew of this one)
        claimants: dict[int, list[str]] = {}
        later = max((record.epoch for record in self.records), default=self.epoch)
        if later > self.epoch:  # the others found nothing left in this epoch: follow them once its chunks are read
            self.ahead = later
        for record in self.records:
            if record.epoch == self.epoch:
                self.swarm |= from_bitmap(record.finished, self.count)
                for chunk, _ in record.reading:
                    claimants.setdefault(chunk, []).append(record.peer_id)
        self.taken = set(claimants)

        def keep(chunk: int) -> bool:
            return keeps_claim(self.index.sha256, self.epoch, chunk, self.peer_id, claimants.get(chunk, []))

        # chunks another trainer chose in the same moment, or has finished since: one of the two goes on
        self.queue = [(chunk, done) for chunk, done in self.queue if keep(chunk) and chunk not in self.swarm]
        if self.current is not None and (not keep(self.current.chunk) or self.current.chunk in self.swarm):
            self._abandon()
        await self._publish()

    def record(self) -> ReaderRecord:
        reading = ([(self.current.chunk, self.current.done)] if self.current is not None else []) + self.queue
        cache = self.fetcher.cache
        return ReaderRecord(
            peer_id=self.peer_id,
            data=self.index.sha256,
            chunks=self.count,
            epoch=self.epoch,
            finished=to_bitmap(self._finished(), self.count),
            held=to_bitmap(self.fetcher.held_numbers(), self.count),
            reading=tuple(reading[:8]),
            tokens=self.place.tokens,
            chunks_read=self.place.chunks_read,
            duplicates=self.place.duplicates,
            cache_bytes=cache.used_bytes,
            cache_cap=cache.cap_bytes,
            bytes_fetched=self.fetcher.stats.downloaded,
        )

    def _claim(self) -> None:
        """Tell the swarm now which chunks this trainer takes (not at the next look): fewer trainers choose the
        same chunk in the same moment."""
        if self.dht is not None and (self._claiming is None or self._claiming.done()):
            self._claiming = asyncio.ensure_future(self._publish())

    async def _publish(self) -> None:
        try:
            await store_reader_record(self.dht, self.swarm_id, self.record())
        except Exception as e:
            logger.debug(f"data: publishing this trainer's progress failed: {e!r}")

    def holders(self, chunk: int) -> list[str]:
        """Peers whose records say they hold train chunk `chunk` (for the fetcher's peer source)."""
        return [record.peer_id for record in self.records if chunk in from_bitmap(record.held, self.count)]

    def readers(self) -> list[str]:
        return [record.peer_id for record in self.records]

    def coverage(self) -> float:
        """The fraction of this epoch's chunks the swarm has read, as far as this trainer knows."""
        reading = {
            chunk for record in self.records if record.epoch == self.epoch for chunk, done in record.reading if done
        }
        return epoch_coverage(self._finished(), reading, self.count)

    def stats(self) -> dict:
        """This trainer's reading and fetching, for its status line and metrics."""
        fetched = self.fetcher.stats
        return {
            "epoch": self.epoch,
            "epoch_read": round(self.coverage(), 4),
            "chunk": self.current.chunk if self.current is not None else None,
            "chunks": self.count,
            "chunks_read": self.place.chunks_read,
            "duplicates": self.place.duplicates,
            "tokens_read": self.place.tokens,
            "bytes_from": dict(fetched.bytes_from),
            "refused": dict(fetched.refused),
            "download_rate": round(fetched.rate()),
            "cache_bytes": self.fetcher.cache.used_bytes,
            "cache_cap": self.fetcher.cache.cap_bytes,
            "readers": len(self.records) + 1,
        }

    # ------------------------------------------------------------------------------------------- housekeeping

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._saved_at >= SAVE_PERIOD:
            self._save()
        if self.dht is not None and now - self._seen_at >= self.announce_period:
            if self._background is None or self._background.done():
                self._background = asyncio.ensure_future(self._look())

    def _save(self) -> None:
        self._saved_at = time.monotonic()
        self.place.epoch = self.epoch
        self.place.finished = sorted(self.mine)
        reading = [(self.current.chunk, self.current.done)] if self.current is not None else []
        self.place.reading = [list(item) for item in reading + [q for q in self.queue if q[1] > 0]]
        self.place.save(self.place_path)

    async def close(self) -> None:
        """Keep the place and stop the background look."""
        self._save()
        for task in (self._background, self._claiming):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def describe_reading(stats: dict) -> str:
    """A trainer's reading (ChunkStream.stats) as the text of its status line."""
    fetched = sum(size for kind, size in stats["bytes_from"].items() if kind != "folder")
    text = (
        f"epoch {stats['epoch']} {100 * stats['epoch_read']:.1f}% read by {stats['readers']} trainers, "
        f"{stats['chunks_read']} chunks here ({stats['duplicates']} twice), {fetched / 2**20:.0f} MiB fetched"
    )
    if stats["download_rate"]:
        text += f" at {stats['download_rate'] * 8 / 1e6:.1f} Mbit/s"
    if stats["refused"]:
        text += f", refused {sum(stats['refused'].values())} copies"
    return text
