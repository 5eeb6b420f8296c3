"""This machine's cache of verified data chunks, with a cap: the least recently used chunks go first.

A chunk lives at `<folder>/<sha256>.bin` only once its bytes hash to its name, so a file there is a verified chunk
(a data index is kept the same way, by its own hash). A download in progress is `<sha256>.part`, under an exclusive
lock, so that two peer processes on one machine never write the same file and a broken download resumes from it.
Chunks being read or about to be read are pinned: eviction never takes them. The cap must hold at least two chunks
(the one read and the next one); a smaller one is refused when the peer starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import threading
from pathlib import Path

from swarm.errors import DataError
from swarm.files import cache_root

logger = logging.getLogger(__name__)

DEFAULT_CAP = 4 * 1024**3  # --data-cache's default: 500 chunks of 8 MiB, a fifth of a 20 GB corpus
_BLOB = re.compile(r"[0-9a-f]{64}\.bin")


def default_folder() -> Path:
    """$SWARM_CACHE_DIR/chunks, or ~/.cache/swarm/chunks."""
    return cache_root() / "chunks"


def parse_size(text: str) -> int:
    """'4GB', '500MiB', '2g', '1000000' -> bytes (DataError if it is none of these)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise DataError(f"{text!r} is not a size: give bytes, or a number with KB, MB, GB or TB (e.g. 4GB)")
    number, unit, _ = match.groups()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit]
    if "i" in match.group(3):
        scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    return int(float(number) * scale)


class ChunkCache:
    """The cache folder and its cap in bytes. Thread-safe: downloads finish in worker threads."""

    def __init__(self, folder: Path | None = None, cap_bytes: int = DEFAULT_CAP):
        self.folder = Path(folder) if folder is not None else default_folder()
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        self._pinned: dict[str, int] = {}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cannot create the data cache folder {self.folder}: {e.strerror or e}; set SWARM_CACHE_DIR to a "
                "folder this user can write"
            ) from None
        self._sizes: dict[str, int] = {}
        for path in self.folder.iterdir():
            if _BLOB.fullmatch(path.name):
                with contextlib.suppress(OSError):
                    self._sizes[path.name[:64]] = path.stat().st_size

    def check_cap(self, largest_chunk: int) -> None:
        """DataError if the cap cannot hold two chunks of `largest_chunk` bytes (one read, the next fetched)."""
        if self.cap_bytes < 2 * largest_chunk:
            raise DataError(
                f"the data cache's cap of {self.cap_bytes:,} bytes is smaller than two of this swarm's chunks "
                f"({largest_chunk:,} bytes each): give --data-cache {_mib(2 * largest_chunk)} or more"
            )

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def held(self) -> set[str]:
        with self._lock:
            return set(self._sizes)

    def path(self, sha256: str) -> Path:
        return self.folder / f"{sha256}.bin"

    def part_path(self, sha256: str) -> Path:
        return self.folder / f"{sha256}.part"

    def has(self, sha256: str) -> bool:
        with self._lock:
            known = sha256 in self._sizes
        if known and not self.path(sha256).is_file():  # another process evicted it
            with self._lock:
                self._sizes.pop(sha256, None)
            return False
        if not known and self.path(sha256).is_file():  # another process put it there
            with self._lock:
                self._sizes[sha256] = self.path(sha256).stat().st_size
            return True
        return known

    def touch(self, sha256: str) -> None:
        """Mark a chunk used now (least recently used go first)."""
        with contextlib.suppress(OSError):
            os.utime(self.path(sha256))

    def pin(self, sha256: str) -> None:
        with self._lock:
            self._pinned[sha256] = self._pinned.get(sha256, 0) + 1

    def unpin(self, sha256: str) -> None:
        with self._lock:
            count = self._pinned.get(sha256, 0) - 1
            if count > 0:
                self._pinned[sha256] = count
            else:
                self._pinned.pop(sha256, None)

    def make_room(self, size: int) -> None:
        """Evict unpinned chunks, least recently used first, until `size` more bytes fit under the cap; DataError
        if the pinned chunks alone leave no room."""
        with self._lock:
            if sum(self._sizes.values()) + size <= self.cap_bytes:
                return
            candidates = []
            for sha256 in self._sizes:
                if sha256 not in self._pinned:
                    with contextlib.suppress(OSError):
                        candidates.append((self.path(sha256).stat().st_mtime, sha256))
            for _, sha256 in sorted(candidates):
                if sum(self._sizes.values()) + size <= self.cap_bytes:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(self.path(sha256))
                self._sizes.pop(sha256, None)
                logger.debug(f"data cache: evicted chunk {sha256[:12]}")
            if sum(self._sizes.values()) + size > self.cap_bytes:
                raise DataError(
                    f"the data cache {self.folder} is full of chunks in use ({sum(self._sizes.values()):,} of "
                    f"{self.cap_bytes:,} bytes): give a larger --data-cache"
                )

    def commit(self, part: Path, sha256: str) -> Path:
        """Put a verified download in place (it is pinned: its reader holds it); its path. Downloads that made
        room at once may overshoot the cap together: the least recently used others go now."""
        final = self.path(sha256)
        os.replace(part, final)
        with self._lock:
            self._sizes[sha256] = final.stat().st_size
            self._pinned[sha256] = self._pinned.get(sha256, 0)  # not evicted by the line below
        try:
            self.make_room(0)
        except DataError:
            pass  # every other chunk is in use: the cap is exceeded until one is released
        finally:
            with self._lock:
                if not self._pinned.get(sha256):
                    self._pinned.pop(sha256, None)
        return final

    def put(self, data: bytes, sha256: str) -> Path:
        """Keep small verified bytes (a data index) in the cache."""
        part = self.folder / f"{sha256}.{os.getpid()}.tmp"
        try:
            part.write_bytes(data)
        except OSError as e:
            part.unlink(missing_ok=True)
            raise full_disk_error(self.folder, e) from None
        return self.commit(part, sha256)

    @contextlib.contextmanager
    def download_lock(self, sha256: str):
        """Exclusive right to write `<sha256>.part` among this machine's processes (blocks until it is free)."""
        with open(self.folder / f"{sha256}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def full_disk_error(folder: Path, error: OSError) -> DataError:
    if error.errno == errno.ENOSPC:
        return DataError(
            f"the disk of the data cache {folder} is full: free space there, give a smaller --data-cache, or put "
            "the cache on another disk (SWARM_CACHE_DIR)"
        )
    return DataError(
        f"cannot write to the data cache {folder}: {error.strerror or error}; give SWARM_CACHE_DIR a folder this "
        "user can write, on a disk with room"
    )


def _mib(size: int) -> str:
    return f"{-(-size // 2**20)}MiB"
