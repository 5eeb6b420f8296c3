"""A peer's start-up before its DHT node runs: its identity, whether others can dial it, and the manifest a new
swarm's first peer publishes.

These run outside any event loop, before the DHT node forks its process (hivemind's DHT must start before any
thread exists), and each may wait on the network for a few seconds: they ask other peers. They decide and return;
the program (peers/swarm_peer.py) prints what they found and starts the DHT node (swarm/dht/node.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from swarm.dht import node
from swarm.errors import PeerStartError
from swarm.manifests.loading import write_manifest
from swarm.manifests.manifest import Manifest
from swarm.network.startup_cache import StartupCache, reachability_key
from swarm.server.reachability import Verdict, check_reachability
from swarm.trust.identity import claim_identity, identity_taken, without_own_address
from swarm.trust.signing import IdentityKey

CACHED_REACHABILITY = "as found by a start within the last hour with these addresses"


@dataclass
class PeerIdentity:
    """The key this peer signs its records with and, with --identity, its file and the lock on that file (two peers
    must never share an identity): `release()` it when the peer has stopped."""

    key: IdentityKey
    path: Path | None = None  # None: a new identity for this run only
    lock: FileLock | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim_peer_identity(
    path: Path | None, initial_peers: list[str], startup: StartupCache
) -> tuple[PeerIdentity, list[str]]:
    """This peer's identity: kept in `path` (created if missing, locked while the peer runs), else a new one; and
    the initial peers to join through, without this peer's own address (a restart finds it in the manifest, where
    nobody answers). Raises PeerStartError if the file is unusable, or a peer with its id is in the swarm already."""
    if path is None:
        return PeerIdentity(IdentityKey.generate()), initial_peers
    own_id, lock = claim_identity(path)
    try:
        # asked with its own address among the initial peers: a live peer there with this id is a twin (not asked
        # when this identity last ran on this machine: the lock rules out a twin here)
        if not startup.identity_ran_here(path) and asyncio.run(identity_taken(path, initial_peers)):
            raise PeerStartError(
                f"--identity {path}: a peer with this id ({own_id}) is already in the swarm; two peers cannot share "
                "an identity: stop the other one, or give this peer its own file"
            )
        key = IdentityKey.from_file(path)
    except BaseException:
        lock.release()
        raise
    return PeerIdentity(key, path, lock), without_own_address(initial_peers, own_id)


def find_reachability(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None,
    manifest: Manifest | None,
    startup: StartupCache,
) -> tuple[Verdict, str]:
    """Whether other peers can dial this one, and how that was found out: a few of them are asked to dial it back,
    unless a start within the last hour with the same fixed addresses found out already (swarm/network/
    startup_cache.py). A verdict of None: nobody could be asked, or nobody answered."""
    key = reachability_key(host_maddrs, announce_maddrs)
    cached = startup.reachability(key) if initial_peers else None
    if cached is not None:
        return Verdict(*cached), CACHED_REACHABILITY
    started = time.monotonic()
    verdict = asyncio.run(check_reachability(initial_peers, host_maddrs, announce_maddrs, manifest))
    took = f"checked in {time.monotonic() - started:.1f} s"
    if verdict.reachable is not None:
        startup.remember_reachability(key, verdict.reachable, verdict.detail)
    return verdict, took


def publish_addresses(manifest: Manifest, addrs: list[str], path: Path, new_swarm: bool) -> None:
    """Write the manifest to `path` with this peer's addresses first among its initial peers (of a new swarm: only
    they), ready for the swarm's creator to publish. Raises ManifestError if it cannot be written."""
    own = node.publishable_maddrs(addrs)
    others = [] if new_swarm else [a for a in manifest.initial_peers if a not in own]
    write_manifest(manifest.with_initial_peers(own + others), path)
