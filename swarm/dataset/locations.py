"""Where a prepared corpus is published, and reading its index and chunks from there.

The manifest's `data.source` (and each of `data.mirrors`) names a folder that `swarm-data prepare` wrote: a path on
this machine, an http(s) URL, or any URL fsspec can open (`hf://datasets/<user>/<repo>/<folder>` with
huggingface_hub, `s3://bucket/prefix` with s3fs, `gs://`, `file://`). A relative path is relative to where the
manifest came from: its folder, or for a manifest fetched by URL the URL next to it, so that a creator publishes the
manifest and the prepared folder side by side and volunteers need nothing else.

Every download has the project's deadlines: a stall limit (no byte for that long: given up) and a deadline for the
whole chunk, scaled to its size; a broken download resumes where it stopped (an HTTP range request, where the
server supports them; a server that ignores the range sends the whole chunk again, and that still works). What a
location sends is not trusted: the caller verifies every chunk's SHA-256 (swarm/dataset/fetching.py).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swarm import __version__
from swarm.dataset.cache import full_disk_error
from swarm.dataset.index import MAX_INDEX_BYTES, Chunk
from swarm.errors import ChunkError, DataError
from swarm.manifests.loading import confined

PIECE = 1 << 20  # bytes read at a time: the clock is looked at between two reads
STALL_LIMIT = 30.0  # seconds without a byte before a download is given up
MIN_RATE = 256 * 1024  # bytes per second a chunk's deadline assumes at the least (2 Mbit/s): 8 MiB in 32 s
INDEX_TIMEOUT = 30.0

OnBytes = Callable[[int], None]  # told of every piece received (the fetcher counts bytes and rate)


def chunk_deadline(size: int) -> float:
    """Seconds a chunk of `size` bytes may take in all, from one place."""
    return STALL_LIMIT + size / MIN_RATE


class Location:
    """A place the prepared folder is published. `name` is how messages and status show it."""

    name: str = ""
    kind: str = ""  # "folder" (on this machine), "web" (http, https) or "store" (another fsspec URL)

    def read_index(self) -> bytes:
        raise NotImplementedError

    def local_path(self, chunk: Chunk) -> Path | None:
        """The chunk's file on this machine, read in place (a folder location); None: it must be downloaded."""
        return None

    def download(self, chunk: Chunk, part: Path, on_bytes: OnBytes) -> None:
        """Write the chunk's bytes into `part`, continuing after the bytes it holds already (a broken download
        resumes). ChunkError if this location cannot give them (the caller tries another); never more than
        chunk.size bytes are written."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


@dataclass
class FolderLocation(Location):
    folder: Path

    def __post_init__(self) -> None:
        self.name, self.kind = str(self.folder), "folder"

    def read_index(self) -> bytes:
        path = self.folder / "index.json"
        try:
            if path.stat().st_size > MAX_INDEX_BYTES:
                raise ChunkError(f"{path} is larger than {MAX_INDEX_BYTES:,} bytes: not a data index")
            return path.read_bytes()
        except OSError as e:
            raise ChunkError(f"cannot read {path}: {e.strerror or e}") from None

    def local_path(self, chunk: Chunk) -> Path | None:
        path = self.folder / chunk.file
        return path if path.is_file() else None

    def download(self, chunk: Chunk, part: Path, on_bytes: OnBytes) -> None:
        path = self.local_path(chunk)
        if path is None:
            raise ChunkError(f"{self.folder / chunk.file} does not exist")
        _copy_stream(lambda: open(path, "rb"), chunk, part, on_bytes, f"{path}")


@dataclass
class WebLocation(Location):
    base: str  # ends with "/"

    def __post_init__(self) -> None:
        self.name, self.kind = self.base, "web"

    def read_index(self) -> bytes:
        url = self.base + "index.json"
        body = bytearray()
        deadline = time.monotonic() + INDEX_TIMEOUT
        with _open_url(url, 0) as response:
            while piece := response.read1(PIECE):
                body += piece
                if len(body) > MAX_INDEX_BYTES:
                    raise ChunkError(f"{url} sent more than {MAX_INDEX_BYTES:,} bytes: not a data index")
                if time.monotonic() > deadline:
                    raise ChunkError(f"{url} did not send the index within {INDEX_TIMEOUT:g} s")
        return bytes(body)

    def download(self, chunk: Chunk, part: Path, on_bytes: OnBytes) -> None:
        url = self.base + chunk.file
        have = part.stat().st_size if part.exists() else 0
        if have >= chunk.size:
            have = 0  # a part that is complete yet failed its check, or is too long: start over
        response = _open_url(url, have)
        with response:
            if have and response.status != 206:  # the server ignored the range: the whole chunk again
                have = 0
            _write_body(response.read1, chunk, part, have, on_bytes, url)


@dataclass
class StoreLocation(Location):
    """A folder behind an fsspec URL (hf://, s3://, gs://, file://...): fsspec does the protocol."""

    base: str  # ends with "/"

    def __post_init__(self) -> None:
        self.name, self.kind = self.base, "store"

    def _open(self, name: str, offset: int = 0):
        try:
            import fsspec

            options = {"anon": True} if self.base.startswith(("s3://", "gs://", "gcs://")) else {}
            file = fsspec.open(self.base + name, "rb", **options).open()
            if offset:
                file.seek(offset)
            return file
        except ImportError as e:
            raise DataError(
                f"reading {self.base} needs the Python package {e.name!r}: pip install {_package(self.base)}"
            ) from None
        except FileNotFoundError:
            raise ChunkError(f"{self.base + name} does not exist") from None
        except Exception as e:  # each fsspec backend raises its own types
            raise ChunkError(f"cannot open {self.base + name}: {str(e)[:200]}") from None

    def read_index(self) -> bytes:
        with self._open("index.json") as file:
            body = _read_all(file.read, MAX_INDEX_BYTES, self.base + "index.json")
        return body

    def download(self, chunk: Chunk, part: Path, on_bytes: OnBytes) -> None:
        have = part.stat().st_size if part.exists() else 0
        have = have if have < chunk.size else 0
        file = self._open(chunk.file, have)
        with file:
            _write_body(lambda n: file.read(n), chunk, part, have, on_bytes, self.base + chunk.file)


def _package(url: str) -> str:
    scheme = url.split("://", 1)[0]
    return {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub", "http": "aiohttp"}.get(
        scheme, f"the fsspec backend of {scheme}://"
    )


def _read_all(read: Callable[[int], bytes], limit: int, where: str) -> bytes:
    body = bytearray()
    try:
        while piece := read(PIECE):
            body += piece
            if len(body) > limit:
                raise ChunkError(f"{where} holds more than {limit:,} bytes: not a data index")
    except OSError as e:
        raise ChunkError(f"reading {where} failed: {str(e)[:200]}") from None
    return bytes(body)


def _open_url(url: str, offset: int):
    headers = {"User-Agent": f"swarm/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=STALL_LIMIT)
    except urllib.error.HTTPError as e:
        raise ChunkError(f"{url} answered HTTP {e.code} ({e.reason})") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ChunkError(f"{url} could not be reached: {getattr(e, 'reason', e)}") from None


def _copy_stream(opener, chunk: Chunk, part: Path, on_bytes: OnBytes, where: str) -> None:
    have = part.stat().st_size if part.exists() else 0
    have = have if have < chunk.size else 0
    try:
        file = opener()
        file.seek(have)
    except OSError as e:
        raise ChunkError(f"reading {where} failed: {e.strerror or e}") from None

    def read(size: int) -> bytes:
        try:
            return file.read(size)
        except OSError as e:  # the source's fault, not this machine's disk
            raise ChunkError(f"reading {where} failed: {e.strerror or e}") from None

    with file:
        _write_body(read, chunk, part, have, on_bytes, where)


def _write_body(
    read: Callable[[int], bytes], chunk: Chunk, part: Path, have: int, on_bytes: OnBytes, where: str
) -> None:
    """Append what `read` gives to `part` (from byte `have`) until chunk.size bytes, within the chunk's deadline.
    A stall, a body that ends early or one that runs past the size is a ChunkError (what arrived stays in `part`
    for the next try to resume from, unless it ran past the size)."""
    deadline = time.monotonic() + chunk_deadline(chunk.size - have)
    try:
        out = open(part, "r+b" if have and part.exists() else "wb")
        out.seek(have)
        out.truncate()
    except OSError as e:
        raise full_disk_error(part.parent, e) from None
    with out:
        done = have
        while done < chunk.size:
            if time.monotonic() > deadline:
                raise ChunkError(
                    f"{where} sent {done - have:,} bytes in {chunk_deadline(chunk.size - have):.0f} s: too slow"
                )
            try:
                piece = read(min(PIECE, chunk.size - done + 1))
            except ChunkError:
                raise
            except (TimeoutError, OSError) as e:  # a stall: no byte within STALL_LIMIT
                raise ChunkError(f"{where} stopped sending after {done:,} of {chunk.size:,} bytes ({e})") from None
            except Exception as e:  # http.client.IncompleteRead and the like: the body ended early
                raise ChunkError(
                    f"{where} broke off after {done:,} of {chunk.size:,} bytes ({type(e).__name__})"
                ) from None
            if not piece:
                raise ChunkError(f"{where} sent {done:,} of {chunk.size:,} bytes and ended: truncated")
            if done + len(piece) > chunk.size:
                out.truncate(have)
                raise ChunkError(f"{where} sent more than the chunk's {chunk.size:,} bytes: not this chunk")
            try:
                out.write(piece)
                out.flush()  # a full disk shows here, not at some later close
            except OSError as e:
                raise full_disk_error(part.parent, e) from None
            done += len(piece)
            on_bytes(len(piece))


def is_url(text: str) -> bool:
    return "://" in text and text.split("://", 1)[0].isascii() and text.split("://", 1)[0].isalnum()


def location_of(name: str, origin: str) -> Location:
    """The location `name` (data.source or a mirror) means for a manifest from `origin` (a URL, a folder, or ""
    for one handed out by a peer). DataError if a manifest from the network names a path outside its folder."""
    name = name.strip()
    if name.endswith("index.json"):
        name = name[: -len("index.json")]
    if is_url(name):
        base = name if name.endswith("/") else name + "/"
        scheme = base.split("://", 1)[0].lower()
        return WebLocation(base) if scheme in ("http", "https") else StoreLocation(base)
    if is_url(origin) or not origin:
        if not confined(name):
            raise DataError(
                f"the data source {name[:200]!r} of a manifest from {origin or 'a peer'} is not a folder next to the "
                "manifest: a manifest from the network may name only such folders, or URLs"
            )
        if not origin:
            return FolderLocation(Path.cwd() / name)
        base = urllib.parse.urljoin(origin, name.rstrip("/") + "/") if name not in ("", ".") else origin
        base = base if base.endswith("/") else base.rsplit("/", 1)[0] + "/"
        scheme = base.split("://", 1)[0].lower()
        return WebLocation(base) if scheme in ("http", "https") else StoreLocation(base)
    return FolderLocation(Path(origin) / Path(name).expanduser())


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
