"""Data preparation: a corpus tokenized once into token chunks, which trainers then read memory-mapped (shards.py).

Each document of the source (see documents.py: a text file, a JSON line, a parquet row) is tokenized and followed
by the tokenizer's end-of-document token (the byte vocabulary has none: a newline then), into the held-out part
or the train part by the hash of its name. The held-out part is never empty (nor the train part) when there are
two documents or more; a corpus of one document gives the end of it to the held-out part.

The output folder holds the train part in chunks of `chunk_tokens` tokens (`chunk-00000.bin`, ...: raw
little-endian tokens, a document may span two; the last chunk smaller), the held-out part in chunks of the same size
(`heldout-00000.bin`, ...) and `index.json`, which names every chunk with its token count, byte size and SHA-256 and
is written last: a folder with an index is complete. The index is deterministic (same inputs, same bytes), so its
hash names the prepared data. Chunks are what a volunteer downloads, verifies and caches (swarm/dataset/fetching.py):
at the default 4 Mi tokens (8 MiB of uint16), one takes under 2 s at 50 Mbit/s, so a trainer's first microbatch
waits for one chunk, and a 20 GB corpus is about 2,500 of them. Documents and tokens are streamed:
the corpus is never in memory whole. `ensure_prepared` does all this once per raw source, into a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout

from swarm.dataset.documents import (
    RECORD_SUFFIXES,
    RESOLUTION,
    STDLIB,
    Document,
    ProgressCallback,
    Reading,
    corpus_files,
    heldout_bucket,
    read_documents,
)
from swarm.dataset.index import HELDOUT_PREFIX, MAX_CHUNK_TOKENS, MAX_CHUNKS, TRAIN_PREFIX, token_dtype
from swarm.dataset.remote_documents import is_remote_source, read_remote_documents, remote_files, remote_total_bytes
from swarm.dataset.tokenizer import Tokenizer
from swarm.errors import DataError
from swarm.files import AtomicFile, atomic_write, cache_root, temporary_path

logger = logging.getLogger(__name__)

FORMAT = 2
INDEX_FILE = "index.json"
DEFAULT_CHUNK_TOKENS = 1 << 22
_BATCH_CHARS = 4 << 20  # texts tokenized together, at most
_BATCH_TEXTS = 1024
_COPY_TOKENS = 1 << 24


def index_sha256(path: Path | str) -> str:
    """The SHA-256 of the index file's bytes: the name of the prepared data (a folder: its index.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / INDEX_FILE
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise DataError(f"cannot read the data index {path}: {e.strerror}; prepare the data with swarm-data") from None


# ------------------------------------------------------------------------------------------------ writing


class _TokenFile:
    """One output file of tokens, written incrementally (atomically: swarm/files.py) and hashed as it is written."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = path
        self.dtype = dtype
        self.file = AtomicFile(path)
        self.digest = hashlib.sha256()
        self.tokens = 0

    def write(self, tokens: np.ndarray) -> None:
        data = tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.tokens += len(tokens)

    def commit(self) -> dict:
        """Put the file in place; its entry in the index."""
        self.file.commit()
        size = self.tokens * self.dtype.itemsize
        return {"file": self.path.name, "tokens": self.tokens, "size": size, "sha256": self.digest.hexdigest()}

    def abort(self) -> None:
        self.file.abort()


def chunk_file(prefix: str, number: int) -> str:
    """The name of a chunk's file: chunk-00000.bin (train), heldout-00000.bin (held out)."""
    return f"{prefix}-{number:05d}.bin"


class _ChunkWriter:
    """One part (train or held out): chunks of `chunk_tokens` tokens each (the last one smaller); a document may
    span two."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, chunk_tokens: int):
        self.folder, self.prefix, self.dtype, self.chunk_tokens = folder, prefix, dtype, chunk_tokens
        self.entries: list[dict] = []
        self.current: _TokenFile | None = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.current is None:
                self.current = _TokenFile(self.folder / chunk_file(self.prefix, len(self.entries)), self.dtype)
            room = self.chunk_tokens - self.current.tokens
            self.current.write(tokens[:room])
            tokens = tokens[room:]
            if self.current.tokens >= self.chunk_tokens:
                self.entries.append(self.current.commit())
                self.current = None

    def finish(self) -> list[dict]:
        if self.current is not None:
            self.entries.append(self.current.commit())
            self.current = None
        return self.entries

    def abort(self) -> None:
        if self.current is not None:
            self.current.abort()


@dataclass
class _Pass:
    """What one pass over the documents wrote, and what it saw of the split."""

    chunks: list[dict]
    heldout: list[dict]
    documents: int = 0
    heldout_documents: int = 0
    first_train: tuple[int, str] | None = None  # the train document that is the nearest to being held out
    last_heldout: tuple[int, str] | None = None  # the held-out document that is the nearest to being train


def _items(
    documents: Iterable[Document], fraction: float, forced: dict[str, bool], tail: bool, result: _Pass
) -> Iterator[tuple[str | None, bool]]:
    """(text, held out) pieces in order, and (None, held out) at the end of each document."""
    for document in documents:
        result.documents += 1
        if tail:  # one document: its last `fraction` of characters is held out
            total = sum(len(piece) for piece in document.pieces())
            cut, seen = int(total * (1 - fraction)), 0
            for piece in document.pieces():
                if seen < cut < seen + len(piece):
                    yield piece[: cut - seen], False
                    yield None, False
                    yield piece[cut - seen :], True
                else:
                    yield piece, seen >= cut
                    if seen + len(piece) == cut:
                        yield None, False
                seen += len(piece)
            yield None, True
            continue
        bucket = heldout_bucket(document.name)
        heldout = forced.get(document.name, bucket < fraction * RESOLUTION)
        if heldout:
            result.heldout_documents += 1
            result.last_heldout = max(result.last_heldout or (bucket, document.name), (bucket, document.name))
        else:
            result.first_train = min(result.first_train or (bucket, document.name), (bucket, document.name))
        for piece in document.pieces():
            yield piece, heldout
        yield None, heldout


def _batches(items: Iterator[tuple[str | None, bool]]) -> Iterator[list[tuple[str | None, bool]]]:
    batch, chars = [], 0
    for item in items:
        batch.append(item)
        chars += len(item[0] or "")
        if chars >= _BATCH_CHARS or len(batch) >= _BATCH_TEXTS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_pass(
    documents: Iterable[Document],
    out_dir: Path,
    tokenizer: Tokenizer,
    chunk_tokens: int,
    fraction: float,
    forced: dict[str, bool],
    tail: bool,
) -> tuple[_Pass, int]:
    """Tokenize and write every document; returns what was written and the held-out part's UTF-8 bytes."""
    dtype = token_dtype(tokenizer.vocab_size)
    # the end of a document: the tokenizer's end token, else a newline (for bytes, and tokenizers without one)
    end = np.array([tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n"), dtype=np.int64)
    train = _ChunkWriter(out_dir, TRAIN_PREFIX, dtype, chunk_tokens)
    heldout = _ChunkWriter(out_dir, HELDOUT_PREFIX, dtype, chunk_tokens)
    result = _Pass(chunks=[], heldout=[])
    heldout_bytes = 0
    try:
        for batch in _batches(_items(documents, fraction, forced, tail, result)):
            texts = [text for text, _ in batch if text is not None]
            if tokenizer.is_bytes:
                encoded = iter([np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts])
            else:
                encoded = iter([np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)])
            parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
            for text, is_heldout in batch:
                parts[is_heldout].append(end if text is None else next(encoded))
                if is_heldout and text is not None:
                    heldout_bytes += len(text.encode("utf-8"))
            if parts[False]:
                train.write(np.concatenate(parts[False]))
            if parts[True]:
                heldout.write(np.concatenate(parts[True]))
        result.chunks = train.finish()
        result.heldout = heldout.finish()
    except BaseException:
        train.abort()
        heldout.abort()
        raise
    return result, heldout_bytes


def _split_chunks(out_dir: Path, chunks: list[dict], dtype: np.dtype, count: int) -> list[dict]:
    """The train part (in one chunk) rewritten as `count` chunks of equal size (the last one smaller)."""
    # the new chunk-00000.bin replaces the old one's name only: the memmap keeps reading the old file
    whole = np.memmap(out_dir / chunks[0]["file"], dtype=dtype.newbyteorder("<"), mode="r")
    count = max(1, min(count, len(whole)))
    size = math.ceil(len(whole) / count)
    entries = []
    for k in range(count):
        output = _TokenFile(out_dir / chunk_file(TRAIN_PREFIX, k), dtype)
        for start in range(k * size, min(len(whole), (k + 1) * size), _COPY_TOKENS):
            output.write(np.asarray(whole[start : min(start + _COPY_TOKENS, (k + 1) * size)]))
        entries.append(output.commit())
    del whole
    return entries


def prepare_corpus(
    source: str,
    out_dir: Path | str,
    tokenizer: Tokenizer,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    heldout_fraction: float = 0.05,
    on_progress: ProgressCallback | None = None,
    text_key: str = "text",
    chunk_count: int | None = None,
) -> Path:
    """Tokenize `source` into `out_dir` (see the module's docstring); returns the path of its index.json.

    on_progress(bytes read, bytes in all) is called as the source files are read. chunk_count: make exactly that
    many train chunks (fewer if there are fewer train tokens) instead of chunks of `chunk_tokens`."""
    if not 0 < heldout_fraction < 1:
        raise DataError(f"heldout_fraction {heldout_fraction} must be between 0 and 1 (e.g. 0.05)")
    if not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise DataError(f"chunk_tokens {chunk_tokens} must be between 1 and {MAX_CHUNK_TOKENS:,}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / INDEX_FILE).unlink(missing_ok=True)  # the folder is incomplete until the new index is written
    if is_remote_source(source):  # files on the web or in a store, streamed (each pass reads them again)
        urls = remote_files(source)
        reading = Reading(total_bytes=remote_total_bytes(urls), on_progress=on_progress)
        tail = False  # records, never one text file
        read = lambda: read_remote_documents(urls, text_key, reading)  # noqa: E731
    else:
        root, files = corpus_files(source, exclude=out_dir)
        reading = Reading(total_bytes=sum(f.stat().st_size for f in files), on_progress=on_progress)
        tail = len(files) == 1 and files[0].suffix.lower() not in RECORD_SUFFIXES  # one text file: one document
        read = lambda: read_documents(root, files, text_key, reading)  # noqa: E731
    size = chunk_tokens if chunk_count is None else 1 << 62
    forced: dict[str, bool] = {}
    while True:
        reading.done_bytes = reading.skipped = 0
        reading.skipped_examples.clear()
        documents = read()
        result, heldout_bytes = _write_pass(documents, out_dir, tokenizer, size, heldout_fraction, forced, tail)
        if result.documents == 0:
            raise DataError(f"data source {source!r} has no usable document ({reading.skipped} skipped)")
        if result.documents == 1 and not tail:
            tail = True  # one document: hold out its end
        elif not tail and result.heldout_documents == 0:
            forced = {result.first_train[1]: True}  # hold out at least one document
        elif not tail and result.heldout_documents == result.documents:
            forced = {result.last_heldout[1]: False}  # train on at least one document
        else:
            break
        logger.info("data source %r: writing its chunks again to correct the held-out split", source)
    dtype = token_dtype(tokenizer.vocab_size)
    chunks = result.chunks
    if chunk_count is not None and chunks:
        chunks = _split_chunks(out_dir, chunks, dtype, chunk_count)
    if len(chunks) + len(result.heldout) > MAX_CHUNKS:
        raise DataError(
            f"{len(chunks) + len(result.heldout):,} chunks is more than the {MAX_CHUNKS:,} an index may name: "
            "prepare it with larger chunks (--chunk-tokens)"
        )
    names = {entry["file"] for entry in [*chunks, *result.heldout]}
    for pattern in ("shard-*.bin", "heldout*.bin", f"{TRAIN_PREFIX}-*.bin"):  # left by an earlier preparation
        for stale in out_dir.glob(pattern):
            if stale.name not in names:
                stale.unlink()
    if reading.skipped:
        logger.warning(
            "data source %r: skipped %d records (%s)", source, reading.skipped, "; ".join(reading.skipped_examples)
        )
    index = {
        "format": FORMAT,
        "source": source,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "heldout_fraction": heldout_fraction,
        "documents": result.documents,
        "skipped": reading.skipped,
        # with chunk_count, the held-out part is one chunk: the size bound is the largest chunk of either part
        "chunk_tokens": chunk_tokens
        if chunk_count is None
        else max((c["tokens"] for c in [*chunks, *result.heldout]), default=1),
        "chunks": chunks,
        "heldout": {"chunks": result.heldout, "text_bytes": heldout_bytes},
    }
    index_path = out_dir / INDEX_FILE
    atomic_write(index_path, json.dumps(index, sort_keys=True, indent=1, separators=(",", ": ")) + "\n")
    if on_progress is not None:
        on_progress(reading.total_bytes, reading.total_bytes)
    train_tokens = sum(entry["tokens"] for entry in chunks)
    logger.info(
        "prepared %r into %s: %d documents, %d train tokens in %d chunks, %d held-out tokens",
        source,
        out_dir,
        result.documents,
        train_tokens,
        len(chunks),
        sum(entry["tokens"] for entry in result.heldout),
    )
    return index_path


# ------------------------------------------------------------------------------------------------ the cache


def default_cache_dir() -> Path:
    """$SWARM_CACHE_DIR/data, or ~/.cache/swarm/data."""
    return cache_root() / "data"


def _cache_key(source: str, tokenizer: Tokenizer, chunks: int, heldout_fraction: float) -> str:
    if source == STDLIB:
        where, fingerprint = sysconfig.get_paths()["stdlib"], ""  # one Python version's standard library
    else:  # local files change: their names, sizes and times are part of the key
        root, files = corpus_files(source)
        where = str(Path(source).expanduser().resolve())
        stats = [(f.relative_to(root).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        fingerprint = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    key = [FORMAT, where, fingerprint, tokenizer.sha256 or "bytes", chunks, heldout_fraction]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]


PROGRESS_EVERY = 15.0  # seconds between the progress lines of a long preparation


def _progress_logger(what: str) -> ProgressCallback:
    """A progress callback that logs at most every PROGRESS_EVERY seconds: a large source takes minutes."""
    begin = said = time.monotonic()

    def on_progress(done: int, total: int) -> None:
        nonlocal said
        now = time.monotonic()
        if now - said >= PROGRESS_EVERY and total > 0:
            said = now
            logger.info(f"{what}: {done / 2**20:.0f} of {total / 2**20:.0f} MiB read in {now - begin:.0f} s")

    return on_progress


def ensure_prepared(
    source: str,
    tokenizer: Tokenizer,
    cache_dir: Path | str | None = None,
    chunks: int = 1,
    heldout_fraction: float = 0.05,
) -> Path:
    """The index of `source` prepared into `chunks` train chunks in the cache: prepared on first use, then reused.

    Peer processes may call this at once for the same data: one prepares it (into a temporary folder, renamed
    when complete) while the others wait for it, under a lock file, then use what it wrote."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = _cache_key(source, tokenizer, chunks, heldout_fraction)
    final = cache_dir / key
    if (final / INDEX_FILE).is_file():
        return final / INDEX_FILE
    lock = FileLock(cache_dir / f"{key}.lock")  # released on leaving, or when the process dies
    try:
        held = lock.acquire(timeout=0)
    except Timeout:  # another process prepares it: say so, then wait (no deadline: it is working)
        logger.info("another process on this machine prepares data source %r; waiting for it", source)
        held = lock.acquire()
    with held:
        if (final / INDEX_FILE).is_file():
            return final / INDEX_FILE  # another process prepared it while this one waited
        if final.exists():
            raise DataError(f"the data cache folder {final} is incomplete (no {INDEX_FILE}): delete it and retry")
        for leftover in cache_dir.glob(f".{key}.*.tmp"):  # of a process that died while preparing
            shutil.rmtree(leftover, ignore_errors=True)
        temporary = temporary_path(final)  # a folder, renamed when complete
        logger.info("preparing data source %r into the cache %s (once)", source, final)
        try:
            progress = _progress_logger(f"preparing data source {source!r}")
            prepare_corpus(
                source,
                temporary,
                tokenizer,
                heldout_fraction=heldout_fraction,
                on_progress=progress,
                chunk_count=chunks,
            )
            with contextlib.suppress(OSError):  # a folder there already (written without the lock): use it
                os.rename(temporary, final)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
    if not (final / INDEX_FILE).is_file():
        raise DataError(f"preparing data source {source!r} into {final} left no {INDEX_FILE}: delete it and retry")
    return final / INDEX_FILE
