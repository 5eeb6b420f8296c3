"""The preflight's measurements of the swarm's training data (their verdicts are swarm/preflight/data_checks.py's).

The data's index is read from every place the manifest publishes it (data.source and data.mirrors, all at once;
relative to where the manifest came from: swarm/dataset/opening.py's `data_locations`) and checked against the
manifest's pin; the first train chunk is fetched through a ChunkFetcher from the first of them that served the
index (the next one if it fails) and verified, the time it took giving the link's rate; and the free space where
the data cache lives ($SWARM_CACHE_DIR/chunks) is read, with what the cache holds already. Data on this machine (a
raw source, or --data) is checked for being there; a prepared folder's first chunk is hashed in place.

The chunk goes into a temporary cache, removed afterwards, not into the user's: the preflight writes no lasting
file, and a chunk found in the cache would measure no link (the one the real peer downloads takes the same time
again, once). Every wait has a deadline, the locations' own stall limits within it: INDEX_DEADLINE for the index,
DATA_DEADLINE in all. Reads run in daemon threads that nothing waits for, so a server that stops answering in the
middle of a chunk holds neither the preflight nor the program's exit past the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from swarm.dataset.cache import ChunkCache, default_folder
from swarm.dataset.documents import STDLIB
from swarm.dataset.fetching import ChunkFetcher
from swarm.dataset.index import Chunk, DataIndex, parse_index
from swarm.dataset.locations import FolderLocation, Location
from swarm.dataset.opening import check_fits, data_locations
from swarm.dataset.shards import prepared_index
from swarm.errors import DataError
from swarm.manifests.manifest import Manifest
from swarm.preflight.data_checks import DataFindings
from swarm.preflight.probes import free_bytes

INDEX_DEADLINE = 20.0  # seconds for the index, from every location at once
DATA_DEADLINE = 60.0  # seconds for the whole data check: the index, then one chunk
_CACHED = re.compile(r"[0-9a-f]{64}\.bin")  # a verified file of the data cache (swarm/dataset/cache.py)


def probe_data(
    manifest: Manifest, own_source: str | None, cap: int, progress: Callable[[str], None] = lambda _: None
) -> DataFindings:
    """What a trainer of this machine would read (the manifest's data, or `own_source`: --data), checked within
    DATA_DEADLINE; `cap`: --data-cache in bytes. Call it outside an event loop."""
    config = manifest.data
    pinned = own_source is None and bool(config.index_sha256)
    found = DataFindings(own_source if own_source is not None else config.source, pinned, cap=cap)
    measure_cache_disk(found)
    asyncio.run(_probe(manifest, found, progress))
    return found


def measure_cache_disk(found: DataFindings) -> None:
    folder = default_folder()
    found.cache_folder, found.cache_free = str(folder), free_bytes(folder)[1]
    if folder.is_dir():
        for path in folder.iterdir():
            if _CACHED.fullmatch(path.name):
                with contextlib.suppress(OSError):
                    found.cache_held += path.stat().st_size


async def _probe(manifest: Manifest, found: DataFindings, progress: Callable[[str], None]) -> None:
    asyncio.get_running_loop().set_default_executor(DaemonThreads())
    deadline = time.monotonic() + DATA_DEADLINE
    if found.pinned:
        try:
            locations = data_locations(manifest)
        except DataError as e:  # a manifest from the network that names a folder outside its own
            found.error = str(e)
            return
        progress(f"reading the data's index from {', '.join(location.name for location in locations)}")
        answers = await asyncio.gather(*[read_index(location, manifest.data.index_sha256) for location in locations])
        found.answers = [(where, error) for where, error, _ in answers]
        served = [(location, index) for location, (_, _, index) in zip(locations, answers) if index is not None]
        if not served:
            return
        found.index, locations = served[0][1], [location for location, _ in served]
        where = next(where for where, error in found.answers if not error)
    else:
        index_path = prepared_index(found.source)
        if index_path is None:  # raw text, tokenized at the trainer's start (swarm/dataset/opening.py)
            found.raw = True
            if found.source != STDLIB and not Path(found.source).expanduser().exists():
                found.error = (
                    f"data source {found.source!r} is neither 'stdlib', a file nor a folder on this machine: check "
                    "the path"
                )
            return
        where, error, found.index = await read_index(FolderLocation(index_path.parent), "")
        found.answers = [(where, error)]
        locations = [FolderLocation(index_path.parent)]
    try:
        if found.index is not None:
            check_fits(found.index, manifest, None, where)
    except DataError as e:  # another tokenizer, or more ids than the model's vocabulary
        found.error = str(e)
        return
    if found.chunk is not None:
        progress(f"fetching data chunk {found.chunk.file} ({found.chunk.size:,} bytes) and verifying it")
        await fetch_chunk(found, locations, deadline)


async def read_index(location: Location, pin: str) -> tuple[str, str, DataIndex | None]:
    """(where the index was read, the error; "" if none, the index checked against `pin` if it is not "")."""
    where = location.name + "index.json" if location.kind != "folder" else str(Path(location.name, "index.json"))
    try:
        raw = await asyncio.wait_for(asyncio.to_thread(location.read_index), INDEX_DEADLINE)
        return where, "", parse_index(raw, where, pin)
    except TimeoutError:
        return where, f"{where} sent no index within {INDEX_DEADLINE:g} s", None
    except DataError as e:  # unreachable, HTTP errors, not the pinned index, invalid
        return where, str(e), None
    except Exception as e:  # an fsspec backend's own errors
        return where, f"reading {where} failed: {type(e).__name__}: {str(e)[:200]}", None


async def fetch_chunk(found: DataFindings, locations: list[Location], deadline: float) -> None:
    """The first train chunk through a ChunkFetcher with a temporary cache, from each location in turn until one
    gives it verified; what happened goes into `found`."""
    chunk = found.chunk
    assert chunk is not None and found.index is not None
    with tempfile.TemporaryDirectory(prefix="swarm-check-", ignore_cleanup_errors=True) as folder:
        cache = ChunkCache(Path(folder), cap_bytes=2 * chunk.size)
        for location in locations:
            left = deadline - time.monotonic()
            if left < 1:
                found.chunk_errors.append(f"{location.name} not tried: the check's {DATA_DEADLINE:g} s were spent")
                return
            fetcher = ChunkFetcher(found.index, [location], cache)
            begin = time.monotonic()
            try:
                tokens = await asyncio.wait_for(fetcher.get(chunk), left)
                del tokens  # a memory map of the temporary file
            except TimeoutError:
                found.timed_out = True
                found.chunk_bytes, found.chunk_seconds = fetcher.stats.downloaded, time.monotonic() - begin
                found.chunk_errors.append(f"{location.name}{chunk.file} did not come within {left:.0f} s")
                return
            except DataError as e:  # ChunkError: down, HTTP errors, wrong bytes; DataError: cannot write it
                found.chunk_errors.append(chunk_error(location, chunk, fetcher, e))
                continue
            found.chunk_seconds = time.monotonic() - begin
            found.chunk_bytes, found.chunk_from = fetcher.stats.downloaded, location.name
            found.in_place = location.kind == "folder"
            return


def chunk_error(location: Location, chunk: Chunk, fetcher: ChunkFetcher, error: DataError) -> str:
    """What failed, said for this one location (the fetcher's own message is about all of its places)."""
    if location.kind == "folder":
        path = Path(location.name, chunk.file)
        if fetcher.stats.refused["wrong hash"]:
            return f"{path} does not have the SHA-256 its index states"
        return f"{path} is missing or unreadable"
    return str(error).split(" could not be fetched: ", 1)[-1]


class DaemonThreads(ThreadPoolExecutor):
    """An executor that runs each call in a daemon thread of its own and never waits for them: a read stuck past
    the check's deadline ends with the program (a ThreadPoolExecutor's threads are joined at exit, which would hold
    the program up until the location's stall limit)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to whoever awaits the future
                future.set_exception(e)

        threading.Thread(target=run, name="preflight-data", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # nothing to wait for: see the class's docstring
