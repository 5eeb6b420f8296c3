"""Documents of a data source named by URL, for `swarm-data prepare`: .jsonl (or .jsonl.gz) and .parquet files on
the web (http, https) or at any URL fsspec opens (hf://datasets/..., s3://, gs://, file://, memory://). This module
owns what such a SOURCE means (`is_remote_source`, `remote_files`), reading its documents streamed
(`read_remote_documents`) and their sizes for the progress bar (`remote_total_bytes`); local sources are
documents.py's. Documents are named as documents.py names records, with the URL in place of the path:
"<url>:<line>" for a JSON line, "<url>:<row>" for a parquet row (both counted from 1).

A source is one URL, or several separated by commas. An http(s) URL must name a file: the web cannot be listed. A
URL of another scheme may also name a folder (all its .jsonl, .jsonl.gz and .parquet files, recursively, sorted) or
a glob (hf://datasets/user/repo/data/*.parquet).

Nothing is ever whole in memory: a JSON-lines file is read line by line from a streamed response, a parquet file
batch by batch, one row group at a time. http(s) is read with urllib, not with fsspec, whose HTTP filesystem needs
aiohttp (not a dependency of Swarm): every socket read waits at most TIMEOUT seconds, so a stalled server fails the
preparation instead of hanging it. pyarrow reads parquet by seeking, so a parquet file over http(s) is first
downloaded to an anonymous temporary file (in pieces of 1 MiB; the file is gone once closed, even after a crash):
the disk must hold one such file at a time. Other schemes go through fsspec and its backend (huggingface_hub, s3fs,
gcsfs), which reads parquet by range requests, with that backend's own timeouts.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import io
import json
import logging
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import IO, Any

from swarm import __version__
from swarm.dataset.documents import Document, Reading, _record_text
from swarm.errors import DataError

logger = logging.getLogger(__name__)

TIMEOUT = 30.0  # seconds one network read may wait for a byte before the source is given up
PIECE = 1 << 20  # bytes read at a time
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_WEB = ("http", "https")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_GLOB_CHARS = "*?["
_READ_ERRORS = (OSError, ValueError, EOFError, http.client.HTTPException)  # urllib, fsspec, gzip, pyarrow


def _scheme(url: str) -> str | None:
    match = _SCHEME.match(url.strip())
    return match.group(1).lower() if match else None


def _suffix(url: str) -> str | None:
    path = urllib.parse.urlsplit(url).path.lower()  # an http(s) URL may have a query after its path
    return next((suffix for suffix in SUFFIXES if path.endswith(suffix)), None)


def is_remote_source(source: str) -> bool:
    """Whether `source` is a URL (or URLs) for this module: http(s), or a scheme fsspec knows; not a local path."""
    scheme = _scheme(source)
    if scheme is None or scheme in _WEB:
        return scheme is not None
    try:
        import fsspec
    except ImportError:
        return True  # remote_files will say to install fsspec rather than call the URL a missing path
    return scheme in fsspec.available_protocols()


def _filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem of `url` and the path in it."""
    try:
        import fsspec
    except ImportError:
        raise DataError(f"reading {url} needs fsspec: pip install fsspec (http and https URLs do not)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # the scheme's backend: s3fs, gcsfs, huggingface_hub
        raise DataError(f"reading {url} needs a package that is not installed: {e}") from None
    except ValueError as e:
        raise DataError(f"cannot open {url}: {e}") from None


def remote_files(source: str) -> list[str]:
    """The URLs of the data files of a remote `source`: its comma-separated URLs, each of a file, or (for a scheme
    that can list: hf://, s3://, file://, ...) of a folder or a glob, whose data files are taken, sorted."""
    parts = [part.strip() for part in source.split(",") if part.strip()]
    if not parts:
        raise DataError(f"data source {source!r} names no URL: give the URL of a .jsonl or .parquet file")
    files: list[str] = []
    for part in parts:
        scheme = _scheme(part)
        if scheme is None:
            raise DataError(
                f"{part!r} in data source {source!r} is not a URL: several sources are URLs separated by commas, "
                f"each of a .jsonl, .jsonl.gz or .parquet file (or of a folder of them: hf://, s3://, file://, ...)"
            )
        if scheme in _WEB:
            if _suffix(part) is None:
                raise DataError(
                    f"{part} is not the URL of a .jsonl, .jsonl.gz or .parquet file, and a web server cannot be "
                    f"listed: give the files' URLs, separated by commas (or their folder as hf://, s3://, gs://)"
                )
            files.append(part)
        else:
            files += _listed(part)
    return files


def _listed(url: str) -> list[str]:
    """The data files at an fsspec URL: the file it names, or those of its folder or glob."""
    is_glob = any(char in url for char in _GLOB_CHARS)
    if _suffix(url) is not None and not is_glob:
        return [url]  # a file: any error comes when it is read
    fs, path = _filesystem(url)
    try:
        if is_glob:
            found = fs.glob(path)
        elif fs.isdir(path):
            found = fs.find(path)
        elif fs.exists(path):
            raise DataError(f"{url} is not a .jsonl, .jsonl.gz or .parquet file, nor a folder of them")
        else:
            raise DataError(f"there is no file or folder at {url}: check the URL")
    except _READ_ERRORS as e:
        raise _read_error(url, e) from None
    files = sorted(fs.unstrip_protocol(path) for path in found if _suffix(path) is not None)
    if not files:
        raise DataError(f"{url} holds no .jsonl, .jsonl.gz or .parquet file: give a folder or glob that does")
    return files


def _read_error(url: str, error: BaseException) -> DataError:
    """A DataError naming `url`, for what urllib, fsspec or a backend raised opening or reading it."""
    if isinstance(error, urllib.error.HTTPError):
        error.close()  # it holds the response
        hint = "it may need credentials" if error.code in (401, 403) else "check the URL"
        return DataError(f"{url} answered HTTP {error.code} ({error.reason}): {hint}")
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, OSError):
        error = error.reason  # a refused connection, an unknown host, a timeout while connecting
    if isinstance(error, TimeoutError):
        return DataError(f"{url} sent nothing for {TIMEOUT:g} s: its server stalls; retry later")
    if isinstance(error, FileNotFoundError):
        return DataError(f"there is no file at {url}: check the URL")
    if isinstance(error, ConnectionRefusedError):
        return DataError(f"{url} refused the connection: check the URL and that its server is up")
    reason = getattr(error, "reason", None) or error
    return DataError(f"cannot read {url}: {reason}; check the URL and the network")


@contextlib.contextmanager
def _opened(url: str) -> Iterator[IO[bytes]]:
    """`url`'s bytes as a file, streamed; any failure to open or read it (in the with block too) is a DataError."""
    try:
        if _scheme(url) in _WEB:
            request = urllib.request.Request(url, headers={"User-Agent": f"swarm/{__version__}"})
            file = urllib.request.urlopen(request, timeout=TIMEOUT)
        else:
            fs, path = _filesystem(url)
            file = fs.open(path, "rb")
        with file:
            yield file
    except _READ_ERRORS as e:
        raise _read_error(url, e) from None


class _Counted(io.RawIOBase):
    """A byte stream that tells `reading` of every byte it passes on: progress in bytes as stored (compressed)."""

    def __init__(self, file: IO[bytes], reading: Reading):
        self.file, self.reading = file, reading

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.file.read(len(buffer))
        buffer[: len(data)] = data
        self.reading.advance(len(data))
        return len(data)


def read_remote_documents(urls: list[str], text_key: str, reading: Reading) -> Iterator[Document]:
    """The documents of `urls` (from `remote_files`), in order, streamed; bad records are skipped and counted in
    `reading`, as documents.py does for local files. Network failures are DataErrors naming the URL."""
    for url in urls:
        if _suffix(url) == ".parquet":
            yield from _parquet_documents(url, text_key, reading)
        else:
            yield from _jsonl_documents(url, text_key, reading)


def _jsonl_documents(url: str, text_key: str, reading: Reading) -> Iterator[Document]:
    usable = 0
    with _opened(url) as file:
        lines: IO[bytes] = io.BufferedReader(_Counted(file, reading), PIECE)
        if _suffix(url) == ".jsonl.gz":
            lines = gzip.GzipFile(fileobj=lines)
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                text = _record_text(json.loads(line), text_key)
            except ValueError as e:  # bad JSON or bad UTF-8
                reading.skip(f"{url}:{number}", f"not JSON ({e})")
                continue
            if text is None:
                reading.skip(f"{url}:{number}", f"no non-empty string under key {text_key!r}")
                continue
            usable += 1
            yield Document(f"{url}:{number}", lambda text=text: iter((text,)))
    if not usable:
        raise DataError(
            f"{url} has no usable line: each line must be a JSON object with a non-empty string under "
            f"{text_key!r} (give another key with --text-key)"
        )


def _parquet_documents(url: str, text_key: str, reading: Reading) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{url} is a parquet file, and reading parquet needs pyarrow: pip install pyarrow") from None
    if _scheme(url) not in _WEB:
        with _opened(url) as file:  # fsspec's file reads the byte ranges pyarrow seeks to
            size = file.seek(0, os.SEEK_END)
            file.seek(0)
            yield from _parquet_rows(pq, file, url, text_key, reading, size)
        return
    with tempfile.TemporaryFile(suffix=".parquet") as local:  # pyarrow seeks: plain HTTP is downloaded first
        logger.info("downloading %s to a temporary file to read it as parquet", url)
        with _opened(url) as file:
            shutil.copyfileobj(_Counted(file, reading), local, PIECE)  # the download is the progress
        local.seek(0)
        yield from _parquet_rows(pq, local, url, text_key, reading, 0)


def _parquet_rows(pq: Any, file: IO[bytes], url: str, text_key: str, reading: Reading, size: int) -> Iterator[Document]:
    """The rows of a parquet file as documents; `size`: the bytes to advance the progress by as rows are read."""
    import pyarrow

    try:
        table = pq.ParquetFile(file)
        columns = table.schema_arrow.names
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        raise DataError(f"cannot read {url} as parquet: {e}") from None
    if text_key not in columns:
        raise DataError(f"{url} has no column {text_key!r} (it has {', '.join(columns)}); choose one with --text-key")
    rows = max(1, table.metadata.num_rows)
    number = 0
    for batch in table.iter_batches(batch_size=1024, columns=[text_key]):  # reads one row group at a time
        for value in batch.column(0).to_pylist():
            number += 1
            if not isinstance(value, str) or not value:
                reading.skip(f"{url}:{number}", f"no non-empty string in column {text_key!r}")
                continue
            yield Document(f"{url}:{number}", lambda value=value: iter((value,)))
        reading.advance(size * batch.num_rows // rows)


def remote_total_bytes(urls: list[str]) -> int:
    """The bytes of `urls` in all, for the progress bar: what each server tells (Content-Length, fsspec's info),
    0 for a file whose size it does not tell (or that cannot be reached: reading it will say why)."""
    return sum(_size(url) for url in urls)


def _size(url: str) -> int:
    try:
        if _scheme(url) in _WEB:
            request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": f"swarm/{__version__}"})
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                return int(response.headers.get("Content-Length") or 0)
        fs, path = _filesystem(url)
        return int(fs.info(path).get("size") or 0)
    except Exception as e:  # any backend's error: a size is only for progress, and reading reports the failure
        logger.debug("no size for %s: %s", url, e)
        return 0
