"""A peer's identity: the private key behind its peer id, kept in a file so that the id survives restarts.

Two running peers must never share an identity: libp2p would route each one's traffic to the other at random.
A peer therefore locks its identity file while it runs (a second peer on the same machine fails at once, and
the lock goes away with the process, even after SIGKILL), and before it starts it asks the swarm whether a
peer with that id is already connected (hivemind's check, run here so that its answer becomes a clear error).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from filelock import FileLock, Timeout
from hivemind.p2p import P2P, PeerID

from swarm.errors import PeerStartError
from swarm.trust.signing import IdentityKey

logger = logging.getLogger(__name__)


def claim_identity(path: Path) -> tuple[str, FileLock]:
    """Lock the identity at `path` for this process, then load its private key (creating it if the file does not
    exist). Returns the peer id and the lock, to be released when the peer has stopped (or its process ends)."""
    path = path.expanduser()
    if not path.parent.is_dir():
        raise PeerStartError(f"--identity {path}: the folder {path.parent} does not exist")
    # The lock is on a file beside the key, taken before the key is read or created: two peers started at once
    # with a new path cannot both create a key (one would overwrite the other's).
    lock_path = path.with_name(path.name + ".lock")
    lock = FileLock(lock_path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:  # (an OSError too: caught first)
        raise PeerStartError(
            f"--identity {path} is in use by another peer on this machine; two peers cannot share an identity: "
            "give each its own file"
        ) from None
    except OSError as e:
        raise PeerStartError(f"--identity {path}: cannot create {lock_path} ({e.strerror})") from None
    try:
        return _read_identity(path), lock
    except PeerStartError:
        lock.release()
        raise


def _read_identity(path: Path) -> str:
    """The peer id of the key in `path`, creating the key if the file does not exist."""
    if not path.exists():
        try:
            IdentityKey.generate().write(path)  # an RSA key, as hivemind makes one, readable by this user only
        except OSError as e:
            raise PeerStartError(f"--identity {path}: cannot write a new identity there ({e.strerror})") from None
        logger.info(f"created a new identity in {path}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PeerStartError(f"--identity {path}: cannot read it ({e.strerror})") from None
    try:
        return str(PeerID.from_identity(data))
    except Exception:
        raise PeerStartError(
            f"--identity {path} is not an identity file (a libp2p private key, as swarm-peer writes one); "
            "point --identity at a new path to create one"
        ) from None


IDENTITY_CHECK_TIMEOUT = 30.0  # seconds: a daemon's start, dials to the initial peers, and its stop


async def identity_taken(path: Path, initial_peers: list[str]) -> bool:
    """Whether a peer with this identity is connected to the swarm already (asked through `initial_peers`)."""
    if not initial_peers:
        return False
    try:  # hivemind's check sets no deadline of its own (its daemon dials and stops unbounded)
        check = P2P.is_identity_taken(
            str(path.expanduser()),
            initial_peers=initial_peers,
            tls=True,
            use_auto_relay=False,
            use_ipfs=False,
            use_relay=True,
        )
        return await asyncio.wait_for(check, timeout=IDENTITY_CHECK_TIMEOUT)
    except Exception as e:  # no initial peer answers: joining the DHT will fail next, with its own clear error
        logger.info(f"could not check whether the identity is in use: {e!r}")
        return False


def without_own_address(initial_peers: list[str], peer_id: str) -> list[str]:
    """The initial peers other than this peer itself (a restarted peer may find its own address in the manifest;
    libp2p cannot dial itself)."""
    return [addr for addr in initial_peers if not addr.rstrip("/").endswith(f"/p2p/{peer_id}")]
