"""Answers of start-up checks that a restart on the same machine can reuse, so that a restarted peer serves again in
seconds (docs/RELIABILITY.md, "Restarts"):

- **reachability**: whether others could dial this peer, for the same listening and announced addresses (fixed
  ports only: a new random port may be blocked where the old one was open), for REACHABILITY_TTL seconds;
- **identity**: that this identity file was last run on this machine; then its twin check (does a peer with this
  id already run elsewhere?) is skipped. The lock on the file already rules out a twin on this machine; a copy of
  the file started on another machine still checks when it starts there, since its own record names this one.

Both live in $SWARM_CACHE_DIR/startup.json (or ~/.cache/swarm/startup.json). A damaged or foreign file is ignored
(the checks then simply run).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from swarm.files import atomic_write, cache_root

logger = logging.getLogger(__name__)

REACHABILITY_TTL = 3600.0
IDENTITY_TTL = 7 * 86400.0
MAX_ENTRIES = 64


def default_path() -> Path:
    return cache_root() / "startup.json"


def machine_id() -> str:
    """This machine, as well as it can be told apart from others (systemd's machine id, else the host name)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()


def reachability_key(host_maddrs: list[str], announce_maddrs: list[str] | None) -> str | None:
    """What a reachability verdict depends on; None when it cannot be reused (a random port)."""
    addresses = list(host_maddrs) + list(announce_maddrs or [])
    if not addresses or any(address.rstrip("/").endswith("/tcp/0") for address in addresses):
        return None
    return "reachability:" + hashlib.sha256(json.dumps(addresses).encode()).hexdigest()[:24]


def identity_key(identity_path: Path) -> str:
    return "identity:" + hashlib.sha256(str(identity_path.resolve()).encode()).hexdigest()[:24]


class StartupCache:
    def __init__(self, path: Path | None = None):
        self.path = path or default_path()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, key: str, value: dict[str, Any]) -> None:
        # Peers started together on one machine write at once: the read-modify-write holds a lock (else one
        # peer's entry is lost and its restart checks again); the file itself is replaced atomically.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(self.path.with_name(self.path.name + ".lock")):
                data = self._read()
                data[key] = {**value, "time": time.time()}
                if len(data) > MAX_ENTRIES:  # the oldest go first
                    data = dict(sorted(data.items(), key=lambda item: _age_key(item[1]))[-MAX_ENTRIES:])
                atomic_write(self.path, json.dumps(data), mode=0o600)  # it names this machine and its identities
        except OSError as e:
            logger.info(f"could not write {self.path}: {e}")

    def _fresh(self, key: str, ttl: float) -> dict[str, Any] | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("time"), (int, float)):
            return None
        return entry if 0 <= time.time() - entry["time"] <= ttl else None

    def reachability(self, key: str | None) -> tuple[bool, str] | None:
        """A verdict found within REACHABILITY_TTL for these addresses: (reachable, detail)."""
        entry = self._fresh(key, REACHABILITY_TTL) if key is not None else None
        if entry is None or not isinstance(entry.get("reachable"), bool) or not isinstance(entry.get("detail"), str):
            return None
        return entry["reachable"], entry["detail"][:200]

    def remember_reachability(self, key: str | None, reachable: bool, detail: str) -> None:
        if key is not None:
            self._write(key, {"reachable": reachable, "detail": detail[:200]})

    def identity_ran_here(self, identity_path: Path) -> bool:
        entry = self._fresh(identity_key(identity_path), IDENTITY_TTL)
        return entry is not None and entry.get("machine") == machine_id()

    def remember_identity(self, identity_path: Path) -> None:
        self._write(identity_key(identity_path), {"machine": machine_id()})


def _age_key(entry: Any) -> float:
    return (
        float(entry.get("time", 0.0))
        if isinstance(entry, dict) and isinstance(entry.get("time"), (int, float))
        else 0.0
    )
