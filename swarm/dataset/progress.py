"""The swarm's reading of its corpus, as its trainers announce it in the DHT, and a trainer's own place on disk.

Each trainer keeps one record under `<swarm id>.data` (subkey: its peer id, signed like every record): the data it
reads (the index's hash), its epoch, the chunks of that epoch the swarm has finished as far as it knows (a bitmap,
merged from every record it read), the chunks it reads or fetches now with how many windows it has read of each,
the chunks its cache holds (so that others can fetch them from it), and its counters. Bitmaps keep a record at
about 2 x 8 kB for the largest index (65,536 chunks), far below the DHT's 64 kB.

`ReaderPlace` is the same trainer's place kept on its own disk, so that a restarted trainer with the same identity
neither re-reads the chunks it finished nor starts its current chunk again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hivemind import DHT

from swarm.dataset.index import MAX_CHUNKS
from swarm.dht.records import MAX_COUNT, PEER_ID_PATTERN, data_key, fetch_subkeyed, store_subkeyed
from swarm.files import atomic_write, cache_root

logger = logging.getLogger(__name__)

MAX_READING = 8  # chunks a record may say it reads or fetches at once
RECORD_LIFETIME = 120.0  # seconds; refreshed every few seconds while the trainer reads


@dataclass(frozen=True)
class ReaderRecord:
    """What one trainer says about its reading (see the module's docstring)."""

    peer_id: str
    data: str  # the index's SHA-256
    chunks: int  # train chunks of that index (so that a reader without the index can read the bitmaps)
    epoch: int
    finished: bytes  # bitmap of the train chunks finished in `epoch`, by the swarm as this trainer knows it
    held: bytes  # bitmap of the train chunks in its cache
    reading: tuple[tuple[int, int], ...] = ()  # (chunk, windows read) of the chunks it reads or fetches now
    tokens: int = 0  # tokens it has read since it started (all epochs)
    chunks_read: int = 0  # chunks it finished
    duplicates: int = 0  # chunks it finished that the swarm had finished already in that epoch
    cache_bytes: int = 0
    cache_cap: int = 0
    bytes_fetched: int = 0  # chunk bytes it downloaded (from anywhere)
    expiration: float = 0.0

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("expiration")
        record["reading"] = [list(item) for item in self.reading]
        return record


def parse_reader_record(subkey: Any, value: Any, expiration: float, count: int | None) -> ReaderRecord | None:
    """One record read from the DHT, checked (for data of `count` train chunks; None: the count the record
    states, up to MAX_CHUNKS); None if it is malformed."""
    try:
        if not isinstance(value, dict) or not isinstance(subkey, str) or not PEER_ID_PATTERN.fullmatch(subkey):
            return None
        chunks = value["chunks"]
        if not _is_count(chunks) or not 0 < chunks <= MAX_CHUNKS or (count is not None and chunks != count):
            return None
        count = chunks
        size = (count + 7) // 8
        finished, held = value["finished"], value["held"]
        if not isinstance(finished, bytes) or not isinstance(held, bytes) or len(finished) > size or len(held) > size:
            return None
        reading = value["reading"]
        if not isinstance(reading, list) or len(reading) > MAX_READING:
            return None
        pairs = []
        for item in reading:
            if not (isinstance(item, list) and len(item) == 2 and all(_is_count(x) for x in item) and item[0] < count):
                return None
            pairs.append((item[0], item[1]))
        counters = {name: value.get(name, 0) for name in ReaderRecord.__dataclass_fields__ if name in _COUNTERS}
        if not all(_is_count(number) for number in counters.values()) or not _is_count(value["epoch"]):
            return None
        if value["peer_id"] != subkey or not isinstance(value["data"], str) or len(value["data"]) != 64:
            return None
        return ReaderRecord(
            subkey,
            value["data"],
            chunks,
            value["epoch"],
            finished,
            held,
            tuple(pairs),
            expiration=expiration,
            **counters,
        )
    except (KeyError, TypeError):
        return None


_COUNTERS = ("tokens", "chunks_read", "duplicates", "cache_bytes", "cache_cap", "bytes_fetched")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


async def store_reader_record(dht: DHT, swarm_id: str, record: ReaderRecord) -> bool:
    return await store_subkeyed(dht, data_key(swarm_id), record.peer_id, record.to_record(), RECORD_LIFETIME)


async def fetch_reader_records(dht: DHT, swarm_id: str, data: str | None, count: int | None) -> list[ReaderRecord]:
    """Every valid, unexpired record of trainers reading the data whose index hashes to `data` (None: any data;
    `count` None: each record's own count of chunks)."""
    entries = await fetch_subkeyed(dht, data_key(swarm_id))
    records = [parse_reader_record(subkey, item.value, item.expiration_time, count) for subkey, item in entries]
    return [record for record in records if record is not None and data in (None, record.data)]


# ------------------------------------------------------------------------------------------------ on this disk


@dataclass
class ReaderPlace:
    """Where a trainer is in its reading: kept in `$SWARM_CACHE_DIR/reading/<swarm>-<data>-<peer>.json`."""

    epoch: int = 0
    finished: list[int] = field(default_factory=list)  # chunks it finished in `epoch`
    reading: list[list[int]] = field(default_factory=list)  # [chunk, windows read] of chunks begun
    tokens: int = 0
    chunks_read: int = 0
    duplicates: int = 0

    @staticmethod
    def path(swarm_id: str, data: str, peer_id: str) -> Path:
        return cache_root() / "reading" / f"{swarm_id}-{data[:16]}-{peer_id[-16:]}.json"

    @classmethod
    def load(cls, path: Path, count: int) -> ReaderPlace:
        """The place kept at `path`, or a new one if there is none or it is unusable (said in the log)."""
        try:
            value = json.loads(path.read_text())
            place = cls(**{name: value[name] for name in cls.__dataclass_fields__})
            ok = (
                _is_count(place.epoch)
                and all(_is_count(k) and k < count for k in place.finished)
                and all(
                    len(item) == 2 and _is_count(item[0]) and item[0] < count and _is_count(item[1])
                    for item in place.reading
                )
                and all(_is_count(n) for n in (place.tokens, place.chunks_read, place.duplicates))
            )
            if ok:
                return place
            logger.warning(f"the reading place in {path} is not valid; starting the data afresh")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning(f"cannot read the reading place in {path} ({e}); starting the data afresh")
        return cls()

    def save(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(asdict(self)))
        except OSError as e:  # a full disk must not stop training: the place is only a convenience
            logger.warning(f"cannot keep the reading place in {path}: {e.strerror or e}")
