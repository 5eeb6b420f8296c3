"""The peer-wide context: what belongs to the peer as a whole, not to the stage it serves now nor to its trainer.

The Peer (swarm/peer/peer.py) makes one when it starts and hands it to the rebalancer (and through it to each
StageServer the peer serves in turn, and their averaging rounds); the trainer, the pinger and the reverse connector
get the fields they use. What the parts share through it:

- identity: the peer id, and the device it computes on; with the swarm's manifest and the peer's DHT and p2p
  handles, which every part calls through;
- view: the peer's one cached view of the stages' announcements (swarm/dht/announcement_cache.py), so that all
  parts together read the DHT once per announce period;
- traffic: the bytes it moved (swarm/watch/stats.py), counted by its successive stage servers and its trainer and
  announced as totals;
- position: its network coordinate (swarm/network/coordinates.py), kept by the pinger (swarm/client/pinger.py),
  announced by its stage servers and used by its trainer's routes;
- started: when the peer started (time.monotonic()): its uptime in announcements and metrics, across moves;
- stages: the RPC handlers of the stages it serves (swarm/server/dispatch.py), registered once: each stage server
  adds its service while it serves, the trainer and the hops of its span call them directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from swarm.dht.announcement_cache import AnnouncementCache
from swarm.manifests.manifest import Manifest
from swarm.network.coordinates import Vivaldi
from swarm.server.dispatch import StageDispatcher
from swarm.watch.stats import Traffic


@dataclass(frozen=True)
class PeerContext:
    """See the module's docstring. Frozen: the parts share these objects, and none may swap one for its own."""

    manifest: Manifest
    dht: DHT
    p2p: P2P
    peer_id: str
    device: torch.device
    view: AnnouncementCache
    stages: StageDispatcher
    traffic: Traffic = field(default_factory=Traffic)
    position: Vivaldi = field(default_factory=Vivaldi)
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def create(cls, manifest: Manifest, dht: DHT, p2p: P2P, peer_id: str, device: torch.device) -> PeerContext:
        """A new peer's context: an empty view (read on first use), zero traffic, the starting coordinate, now."""
        view = AnnouncementCache(dht, manifest.swarm_id, manifest.num_stages, max_age=manifest.network.announce_period)
        return cls(manifest, dht, p2p, peer_id, device, view, StageDispatcher(manifest))
