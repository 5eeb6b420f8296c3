"""The clock check of a starting peer: its clock against its initial peers', from their DHT pings.

Records carry their writer's clock: each expires a lifetime after it was written, by the writer's time. A peer whose
clock is off by more than a record's lifetime writes records the others drop as expired at once (or that outlive
it), and reads theirs as expired: it would serve where nobody routes to it, or see an empty swarm and serve
alone, silently. hivemind's DHT is stricter still: it refuses to bootstrap from peers more than 3 s off (the join's
error is explained by swarm/dht/node.py's clock_refusal). A peer that joined through one peer within that may still
be off against the others: it refuses to start past 3 s against the median, and warns past 1 s. The verdict is the
preflight's (swarm/preflight/swarm_checks.py's clock_check); the pings are its probes, with their deadlines.
"""

from __future__ import annotations

import logging

from hivemind.p2p import P2P

from swarm.dht.records import announcement_lifetime
from swarm.errors import PeerStartError
from swarm.manifests.manifest import Manifest
from swarm.preflight.checks import Check, Status
from swarm.preflight.probes import ping_initial_peers
from swarm.preflight.swarm_checks import clock_check

logger = logging.getLogger(__name__)

PINGED_PEERS = 3  # initial peers asked for their time: the median of their offsets counts


async def check_clock(p2p: P2P, manifest: Manifest, own_peer_id: str) -> Check | None:
    """The clock verdict against up to PINGED_PEERS initial peers (None: no other initial peer told its time, as
    for the first peer of a swarm). Raises PeerStartError, with the offset and the remedy, when this clock is off
    by more than the DHT allows (3 s)."""
    addresses = [address for address in manifest.initial_peers if not address.endswith(f"/p2p/{own_peer_id}")]
    if not addresses:
        return None
    secret = manifest.secret
    answers = await ping_initial_peers(p2p, addresses[:PINGED_PEERS], secret.authorizer() if secret else None)
    offsets = [answer.clock_offset for answer in answers if answer.clock_offset is not None]
    if not offsets:
        logger.info(f"clock not checked: no initial peer told its time ({[a.error for a in answers]})")
        return None
    verdict = clock_check(offsets, [], announcement_lifetime(manifest.network.announce_period))
    if verdict.status == Status.FAIL:
        raise PeerStartError(f"{verdict.detail}; {verdict.remedy}, then start again")
    return verdict
