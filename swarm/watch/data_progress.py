"""The swarm's reading of its data, as peer-status and swarm-monitor show it: a pure summary of the trainers'
reader records (swarm/dataset/progress.py; read from the DHT by swarm/watch/reader.py).

Each trainer's record states its epoch, the chunks of that epoch the swarm has finished as far as it knows (a bitmap
merged from everyone's), the chunks it reads or fetches now (with the windows read of each) and its counters. The
swarm's epoch is the highest a record states; how much of it is read is the union of the `finished` bitmaps of the
records at that epoch, the chunks they have begun counting half (as a trainer counts it itself:
swarm/dataset/reading_order.py's `epoch_coverage`). The counters are sums over the live records: what a trainer that
left had read leaves with it.

A swarm that reads a prepared folder names its data in the manifest (the index's hash): only records of that data
count. A raw source has no hash in the manifest (each trainer tokenizes it itself), so the records are grouped by the
data they name and the most common group is shown; the records of other data are only counted (`other_readers`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from swarm.dataset.progress import ReaderRecord
from swarm.dataset.reading_order import epoch_coverage, from_bitmap
from swarm.watch.status import short_id


def shown_data(records: list[ReaderRecord], data: str = "") -> str:
    """The data to show: `data` (the manifest's index hash) if given, else the one most records name (on a tie, the
    one with the most tokens read); "" if there is no record."""
    if data or not records:
        return data
    readers = Counter(record.data for record in records)
    tokens = Counter()
    for record in records:
        tokens[record.data] += record.tokens
    return max(readers, key=lambda name: (readers[name], tokens[name], name))


def data_progress(records: Iterable[ReaderRecord], data: str = "") -> dict[str, Any]:
    """The swarm's reading of `data` (see the module's docstring), as one JSON-compatible dict."""
    records = list(records)
    data = shown_data(records, data)
    mine = sorted((record for record in records if record.data == data), key=lambda record: record.peer_id)
    sizes = Counter(record.chunks for record in mine)
    chunks = max(sizes, key=lambda size: (sizes[size], size)) if sizes else 0  # records of one data agree on it
    epoch = max((record.epoch for record in mine), default=0)
    current = [record for record in mine if record.epoch == epoch]
    finished = set().union(*(from_bitmap(record.finished, chunks) for record in current))
    # chunks begun (windows read): a chunk only queued or being fetched is not yet being read
    reading = {chunk for record in current for chunk, done in record.reading if chunk < chunks and done} - finished
    return {
        "data": data,
        "chunks": chunks,
        "epoch": epoch,
        "epoch_read": round(epoch_coverage(finished, reading, chunks), 4),
        "chunks_finished": len(finished),  # in `epoch`, by the swarm as its trainers know it
        "chunks_reading": len(reading),  # in `epoch`, now
        "readers": len(mine),
        "other_readers": len(records) - len(mine),  # records of other data (a raw source tokenized differently)
        "tokens_read": sum(record.tokens for record in mine),
        "chunks_read": sum(record.chunks_read for record in mine),
        "duplicates": sum(record.duplicates for record in mine),  # chunks read again in an epoch that had them
        "bytes_fetched": sum(record.bytes_fetched for record in mine),
        "trainers": [trainer_row(record, chunks) for record in mine],
    }


def trainer_row(record: ReaderRecord, chunks: int) -> dict[str, Any]:
    """One trainer's reading: the chunk it reads first of those it names, and the windows it has read of it."""
    chunk, windows = record.reading[0] if record.reading else (None, 0)
    return {
        "peer_id": record.peer_id,
        "short_id": short_id(record.peer_id),
        "epoch": record.epoch,
        "chunk": chunk,
        "windows": windows,
        "tokens_read": record.tokens,
        "chunks_read": record.chunks_read,
        "duplicates": record.duplicates,
        "bytes_fetched": record.bytes_fetched,
        "cache_bytes": record.cache_bytes,
        "cache_cap": record.cache_cap,
        "chunks_held": len(from_bitmap(record.held, chunks)),
    }
