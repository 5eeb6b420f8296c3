"""Joining a swarm through what --join names: a manifest's path or URL, or a running peer's multiaddr (which hands
out the manifest). Starting the DHT node that joins is swarm/dht/node.py's."""

from __future__ import annotations

from pathlib import Path

from hivemind.p2p import P2P

from swarm.client.rpc import manifest_from_peer
from swarm.errors import ManifestError
from swarm.manifests.loading import load_manifest
from swarm.manifests.manifest import Manifest


def read_join(join: str) -> Manifest | None:
    """The manifest that --join names; None when it names a running peer (see `manifest_through_peer`)."""
    return None if is_peer_multiaddr(join) else load_manifest(join)


def reader_join(join: str) -> tuple[Manifest | None, list[str]]:
    """What a reader of a swarm (peer-status, swarm-monitor) joins through: (the manifest --join names, or None
    when it names a peer; the peers to bootstrap from). ManifestError if there is nobody to reach."""
    manifest = read_join(join)
    initial_peers = bootstrap_peers(join, manifest)
    if not initial_peers:
        raise ManifestError(
            "the manifest lists no initial peers, so there is no swarm to reach; use the manifest that the "
            "swarm's first peer wrote (swarm-peer --new-swarm), or --join the multiaddr of a running peer"
        )
    return manifest, initial_peers


def bootstrap_peers(join: str, manifest: Manifest | None) -> list[str]:
    """Whom the DHT bootstraps through: the peer --join names, or the manifest's initial peers."""
    return [join] if manifest is None else list(manifest.initial_peers)


async def manifest_through_peer(p2p: P2P, join: str, manifest: Manifest | None) -> Manifest:
    """`manifest`, or when --join named a peer, the manifest that peer hands out.

    `p2p` must be the replica the program keeps using: a second replica, shut down after the call, made
    later calls to the same peer time out (docs/AVERAGING.md)."""
    if manifest is not None:
        return manifest
    return await manifest_from_peer(p2p, join)


def is_peer_multiaddr(text: str) -> bool:
    """Whether --join names a peer (a multiaddr with /p2p/<id>) rather than a manifest file or URL."""
    return text.startswith("/") and "/p2p/" in text and not Path(text).exists()
