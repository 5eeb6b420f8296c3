"""A peer's identity: the private key behind its peer id, kept in a file so that the id survives restarts.

Two running peers must never share an identity: libp2p would route each one's traffic to the other at random.
A peer therefore locks its identity file while it runs (a second peer on the same machine fails at once, and
the lock goes away with the process, even after SIGKILL), and before it starts it asks the swarm whether a
peer with that id is already connected (hivemind's check, run here so that its answer becomes a clear error).
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path
from typing import IO

from hivemind.p2p import P2P, PeerID

from swarm.errors import PeerStartError

logger = logging.getLogger(__name__)


def claim_identity(path: Path) -> tuple[str, IO[bytes]]:
    """Load the private key at `path` (creating it if the file does not exist) and lock it for this process.

    Returns the peer id and the locked file, which must stay open while the peer runs."""
    path = path.expanduser()
    if not path.exists():
        if not path.parent.is_dir():
            raise PeerStartError(f"--identity {path}: the folder {path.parent} does not exist")
        try:
            P2P.generate_identity(str(path))  # an RSA key, readable by this user only
        except OSError as e:
            raise PeerStartError(f"--identity {path}: cannot write a new identity there ({e.strerror})") from None
        logger.info(f"created a new identity in {path}")
    try:
        handle = open(path, "rb")  # noqa: SIM115 (held open: the lock lives as long as the file is open)
    except OSError as e:
        raise PeerStartError(f"--identity {path}: cannot read it ({e.strerror})") from None
    try:
        peer_id = str(PeerID.from_identity(handle.read()))
    except Exception:
        handle.close()
        raise PeerStartError(
            f"--identity {path} is not an identity file (a libp2p private key, as swarm-peer writes one); "
            "point --identity at a new path to create one"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise PeerStartError(
            f"--identity {path} is in use by another peer on this machine (peer id {peer_id}); two peers cannot "
            "share an identity: give each its own file"
        ) from None
    return peer_id, handle


async def identity_taken(path: Path, initial_peers: list[str]) -> bool:
    """Whether a peer with this identity is connected to the swarm already (asked through `initial_peers`)."""
    if not initial_peers:
        return False
    try:
        return await P2P.is_identity_taken(
            str(path.expanduser()),
            initial_peers=initial_peers,
            tls=True,
            use_auto_relay=False,
            use_ipfs=False,
            use_relay=True,
        )
    except Exception as e:  # no initial peer answers: joining the DHT will fail next, with its own clear error
        logger.info(f"could not check whether the identity is in use: {e!r}")
        return False


def without_own_address(initial_peers: list[str], peer_id: str) -> list[str]:
    """The initial peers other than this peer itself (a restarted peer may find its own address in the manifest;
    libp2p cannot dial itself)."""
    return [addr for addr in initial_peers if not addr.rstrip("/").endswith(f"/p2p/{peer_id}")]
