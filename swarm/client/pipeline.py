"""What a trainer's two pipelines share: the trainer's own parts that they work with.

A trainer (swarm/client/trainer.py) pushes each microbatch through one of two pipelines, as the manifest's
`training.pipeline` says: `forward` (swarm/client/forwarded.py: the stages pass the microbatch on to each other)
or `relay` (swarm/client/relay.py: the trainer carries every activation and gradient itself). Both call peers
through the trainer's `send` (this peer's own stage server directly, other peers over the network), choose peers
with the trainer's router from its view of the swarm, ban peers through it, and note what the trainer reports:
the stages that have no online peer, and the samples each peer trained for it. `TrainerParts` holds those parts;
the pipelines keep no knowledge of peers of their own.
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import Announcement
from swarm.manifests.manifest import Manifest
from swarm.routing import Router, online_peers
from swarm.wire.validation import max_request_elements

logger = logging.getLogger(__name__)

NO_PEER_WAIT = 0.5  # seconds to wait when every peer of a stage failed once, before trying them again

# one call: (peer id, "forward" | "backward" | "train", request, timeout) -> the reply
Send = Callable[[str, str, runtime_pb2.ExpertRequest, float], Awaitable[runtime_pb2.ExpertResponse]]


class LocalStage(Protocol):
    """This peer's own stage server (swarm/server/stage.py's StageServer), which its trainer calls directly:
    libp2p cannot dial itself."""

    async def handle(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str
    ) -> runtime_pb2.ExpertResponse: ...


@dataclass
class TrainerParts:
    """The parts of a trainer that its pipelines use: they belong to the trainer, which reads them for its stats
    and reports."""

    manifest: Manifest
    router: Router
    view: AnnouncementCache
    rng: random.Random
    send: Send
    ban: Callable[..., None]  # (peer id, why, seconds wasted=0): leave a peer that failed out of routes for a while
    proof: str | None  # of membership in a private swarm, sent with every request
    unserved_stages: set[int] = field(default_factory=set)  # stages with no online peer at the last look
    served: collections.Counter[str] = field(default_factory=collections.Counter)  # samples each peer trained

    @property
    def max_elements(self) -> int:
        """The largest tensor a valid reply holds."""
        return max_request_elements(self.manifest)

    async def online(self, stage: int, force: bool = False) -> list[Announcement]:
        """The online peers of `stage` in the view (`force`: read the DHT again now)."""
        return online_peers(await self.view.stage(stage, force=force), get_dht_time())

    def note_online(self, stage: int, online: bool) -> None:
        """Note whether `stage` has an online peer now; say so once when it has none (the trainer waits)."""
        if online:
            self.unserved_stages.discard(stage)
        elif stage not in self.unserved_stages:
            self.unserved_stages.add(stage)
            logger.warning(f"no online peer serves stage {stage}; waiting for one to join")
