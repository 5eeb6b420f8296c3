"""Who may hand a served stage work, and how much at once.

A request gets a prompt refusal instead of work when its sender is banned (it sent too many bad requests), when
the stage is not online, when too many requests are in flight (in all, or from this one caller), or when the
expected wait in the queue would eat most of the forward timeout; in a private swarm, a request without a valid
proof of membership is refused before any other work. Refusals are error replies with a code
(swarm/wire/codes.py), never exceptions. Runs on the event loop only.
"""

from __future__ import annotations

import logging
import time

from hivemind.proto import runtime_pb2

from swarm.dht.records import PeerState
from swarm.errors import BadRequestError
from swarm.manifests.manifest import Manifest
from swarm.trust.bans import Bans
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import make_error_reply
from swarm.wire.validation import decode_metadata

logger = logging.getLogger(__name__)

MAX_PENDING_REQUESTS = 64  # requests in flight (queued or running) before new ones get a prompt 'busy' reply
MAX_PENDING_PER_CALLER = 16  # so that one caller (or a flood from one peer) cannot take every slot
# A slow peer takes fewer: past this share of the forward timeout of expected queueing (requests in flight x
# seconds per request), a new request would likely time out in the queue, so the caller is better off elsewhere.
MAX_QUEUE_WAIT_SHARE = 0.5


class Admission:
    def __init__(self, manifest: Manifest, peer_id: str):
        self.manifest, self.peer_id = manifest, peer_id
        self.bans = Bans()  # peers that keep sending bad requests
        self.pending = 0  # requests in flight: queued in the worker, running, or arriving by stream
        self._pending_by_caller: dict[str, int] = {}
        self.bad_requests = 0
        self.busy_replies = 0  # requests refused because too many were in flight (or the peer was not online)
        self.banned_replies = 0  # requests refused unread because their sender is banned

    def banned(self, caller: str) -> bool:
        return self.bans.banned_for(caller, time.monotonic()) > 0

    def ban_refusal(self, caller: str) -> runtime_pb2.ExpertResponse | None:
        seconds = self.bans.banned_for(caller, time.monotonic())
        if seconds <= 0:
            return None
        self.banned_replies += 1
        return make_error_reply(
            f"this peer bans you for {seconds:.0f} more seconds: you sent too many bad requests", ErrorCode.BANNED
        )

    def refusal(self, caller: str, state: PeerState, seconds_per_request: float) -> runtime_pb2.ExpertResponse | None:
        """A prompt reply instead of work: the caller is banned, this peer is not online, or too busy."""
        if (refusal := self.ban_refusal(caller)) is not None:
            return refusal
        reason = None
        if state != PeerState.ONLINE:
            reason = f"this peer is {state}; try another peer"
        elif self.pending >= MAX_PENDING_REQUESTS:
            reason = "too many requests in flight; try another peer"
        elif self.pending * seconds_per_request > MAX_QUEUE_WAIT_SHARE * self.manifest.training.timeouts.forward:
            reason = f"a queue of about {self.pending * seconds_per_request:.1f} s here; try another peer"
        elif caller != self.peer_id and self._pending_by_caller.get(caller, 0) >= MAX_PENDING_PER_CALLER:
            reason = f"you have {MAX_PENDING_PER_CALLER} requests in flight here already; try another peer"
        if reason is None:
            return None
        return self.busy(reason)

    def busy(self, reason: str) -> runtime_pb2.ExpertResponse:
        self.busy_replies += 1
        return make_error_reply(reason, ErrorCode.BUSY)

    def outsider_refusal(self, metadata: bytes, caller: str) -> runtime_pb2.ExpertResponse | None:
        """In a private swarm, refuse a request whose metadata does not prove membership, before any other work."""
        if not self.manifest.private:
            return None
        try:
            decode_metadata(runtime_pb2.ExpertRequest(metadata=metadata), self.manifest, caller)
        except BadRequestError as e:
            return self.bad_request(caller, str(e))
        return None

    def bad_request(self, caller: str, message: str) -> runtime_pb2.ExpertResponse:
        """Count a bad request against its sender (banning it if it keeps sending them) and answer it."""
        self.bad_requests += 1
        ban = self.bans.record_bad_request(caller, time.monotonic())
        if ban:
            logger.warning(f"banning peer {caller[-8:]} for {ban:.0f}s: too many bad requests (last: {message[:200]})")
        return make_error_reply(message, ErrorCode.BAD_REQUEST)

    def take_slot(self, caller: str) -> None:
        self.pending += 1
        self._pending_by_caller[caller] = self._pending_by_caller.get(caller, 0) + 1

    def release_slot(self, caller: str) -> None:
        self.pending -= 1
        left = self._pending_by_caller.get(caller, 1) - 1
        if left > 0:
            self._pending_by_caller[caller] = left
        else:
            self._pending_by_caller.pop(caller, None)
