"""Atomic file writes: a reader, or a crash, sees the old file or the new one, never half of one.

Every file Swarm writes for later (checkpoints, manifests, secrets, exports, the throughput cache) goes through
`atomic_write`: a temporary file in the same folder (so the rename cannot cross filesystems), flushed and
fsynced, renamed over the path, then the folder fsynced so that the rename itself survives a power loss.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

_ORDINARY_MODE = 0o666  # what open() gives a new file: the process's umask then takes its bits away


def atomic_write(path: Path | str, data: bytes | str | Callable[[Path], None], mode: int | None = None) -> None:
    """Replace `path` with `data` (a str is written as UTF-8) atomically and durably. `data` may also be a
    function that writes the temporary file at the path it is given (e.g. safetensors' save_file, which writes
    large tensors without building the whole file in memory first).

    mode: the file's permissions, exactly (the temporary file never has wider ones, so a secret is never
    readable by others, not even for a moment); None: those of a new ordinary file (0o666 less the umask).
    Any OSError is raised as it is, after the temporary file is removed; the old file, if any, is untouched."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    # pid and a random part: writers in other processes or threads never share a temporary file
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _ORDINARY_MODE if mode is None else mode)
    try:
        with os.fdopen(descriptor, "wb") as file:
            if mode is not None:
                os.fchmod(file.fileno(), mode)  # exactly `mode`, whatever the umask
            if callable(data):
                data(temporary)  # it replaces or rewrites the file: reopen it to fsync what it wrote
            else:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        if callable(data):
            with open(temporary, "rb+") as written:
                os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (the rename is an entry of the folder, not of the file)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def cache_root() -> Path:
    """Where Swarm keeps what it can make again: $SWARM_CACHE_DIR, or ~/.cache/swarm."""
    return Path(os.environ.get("SWARM_CACHE_DIR") or Path.home() / ".cache" / "swarm")
