"""Atomic file writes: a reader, or a crash, sees the old file or the new one, never half of one.

Every file Swarm writes for later (checkpoints, manifests, secrets, identity keys, exports, tokenizers, token
shards and their index, the throughput and start-up caches) goes through this module: `atomic_write` for a file
written at once, `AtomicFile` for one written in pieces (a token shard). Both write a temporary file in the same
folder (so the rename cannot cross filesystems), flush and fsync it, rename it over the path, then fsync the folder
so that the rename itself survives a power loss. Lock files, logs and SQLite databases are not written this way:
they are not replaced whole.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

_ORDINARY_MODE = 0o666  # what open() gives a new file: the process's umask then takes its bits away


def temporary_path(path: Path) -> Path:
    """A temporary name next to `path`, hidden, with the pid and a random part: writers in other processes or
    threads never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


class AtomicFile:
    """A file written in pieces under a temporary name: `commit` puts it in place atomically and durably,
    `abort` drops it (the old file, if any, untouched either way).

    mode: the file's permissions, exactly (the temporary file never has wider ones, so a secret is never
    readable by others, not even for a moment); None: those of a new ordinary file (0o666 less the umask)."""

    def __init__(self, path: Path | str, mode: int | None = None):
        self.path = Path(path)
        self.temporary = temporary_path(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        descriptor = os.open(self.temporary, flags, _ORDINARY_MODE if mode is None else mode)
        self.file = os.fdopen(descriptor, "wb")
        self._rewritten = False
        try:
            if mode is not None:
                os.fchmod(self.file.fileno(), mode)  # exactly `mode`, whatever the umask
        except BaseException:
            self.abort()
            raise

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def write_with(self, writer: Callable[[Path], None]) -> None:
        """Let `writer` write the temporary file at the path it is given (e.g. safetensors' save_file, which
        writes large tensors without building the whole file in memory first)."""
        self._rewritten = True
        writer(self.temporary)

    def commit(self) -> None:
        """Make the written file durable and put it in place of `path`. Any OSError is raised as it is, after the
        temporary file is removed."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            if self._rewritten:  # the writer may have replaced or rewritten the file: fsync what it wrote
                with open(self.temporary, "rb+") as written:
                    os.fsync(written.fileno())
            os.replace(self.temporary, self.path)
        except BaseException:
            self.abort()
            raise
        _fsync_folder(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        self.temporary.unlink(missing_ok=True)


def atomic_write(path: Path | str, data: bytes | str | Callable[[Path], None], mode: int | None = None) -> None:
    """Replace `path` with `data` (a str is written as UTF-8) atomically and durably. `data` may also be a
    function that writes the temporary file at the path it is given (see AtomicFile.write_with).

    mode: as AtomicFile's. Any OSError is raised as it is, after the temporary file is removed; the old file, if
    any, is untouched."""
    target = AtomicFile(path, mode)
    try:
        if callable(data):
            target.write_with(data)
        else:
            target.write(data.encode("utf-8") if isinstance(data, str) else data)
    except BaseException:
        target.abort()
        raise
    target.commit()


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (the rename is an entry of the folder, not of the file)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def cache_root() -> Path:
    """Where Swarm keeps what it can make again: $SWARM_CACHE_DIR, or $XDG_CACHE_HOME/swarm, or ~/.cache/swarm."""
    if os.environ.get("SWARM_CACHE_DIR"):
        return Path(os.environ["SWARM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm"
