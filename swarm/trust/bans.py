"""Server-side bans of peers that keep sending bad requests (pure logic, no I/O).

One bad request is a mistake (an old view of the swarm, a version mismatch) and gets an error reply. A peer that
sends BAD_REQUESTS_BEFORE_BAN of them within BAD_REQUEST_WINDOW seconds is banned: its requests get a 'banned'
reply at once, without being read. The first ban lasts FIRST_BAN seconds and each further one twice as long as
the one before, up to MAX_BAN; a peer that stays clean for FORGIVE_AFTER seconds starts over. At most
MAX_TRACKED peers are remembered (the least recently seen go first), so that a flood of new identities cannot
grow the table without bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

BAD_REQUESTS_BEFORE_BAN = 20
BAD_REQUEST_WINDOW = 60.0
FIRST_BAN = 30.0
MAX_BAN = 3600.0
FORGIVE_AFTER = 3600.0
MAX_TRACKED = 10_000


@dataclass
class Offender:
    bad_times: list[float] = field(default_factory=list)  # of recent bad requests, within the window
    bans: int = 0  # bans so far (the next one lasts FIRST_BAN * 2**bans)
    banned_until: float = 0.0
    last_seen: float = 0.0


class Bans:
    """Bad-request counts and bans by peer id. Safe to use from the event loop and the worker thread at once."""

    def __init__(
        self,
        bad_before_ban: int = BAD_REQUESTS_BEFORE_BAN,
        window: float = BAD_REQUEST_WINDOW,
        first_ban: float = FIRST_BAN,
    ) -> None:
        # the defaults are those of stage requests; averaging's exclusions use their own
        # (swarm/averaging/robust_allreduce.py)
        self.bad_before_ban, self.window, self.first_ban = bad_before_ban, window, first_ban
        self._offenders: OrderedDict[str, Offender] = OrderedDict()
        self._lock = threading.Lock()
        self.total = 0  # bans given so far

    def record_bad_request(self, peer_id: str, now: float) -> float:
        """Count a bad request; the length of the ban it triggers in seconds, or 0.0 if none."""
        with self._lock:
            offender = self._offenders.get(peer_id)
            # forgiven after FORGIVE_AFTER clean seconds; time spent banned does not count as clean
            if offender is None or now - max(offender.last_seen, offender.banned_until) > FORGIVE_AFTER:
                offender = Offender()
            self._offenders[peer_id] = offender
            self._offenders.move_to_end(peer_id)
            while len(self._offenders) > MAX_TRACKED:
                self._offenders.popitem(last=False)
            offender.last_seen = now
            if offender.banned_until > now:  # already banned (a request that was in flight when the ban began)
                return 0.0
            offender.bad_times = [t for t in offender.bad_times if now - t < self.window] + [now]
            if len(offender.bad_times) < self.bad_before_ban:
                return 0.0
            length = min(self.first_ban * 2**offender.bans, MAX_BAN)
            offender.bans += 1
            offender.banned_until = now + length
            offender.bad_times = []
            self.total += 1
            return length

    def banned_for(self, peer_id: str, now: float) -> float:
        """Seconds left of the peer's ban; 0.0 if it is not banned."""
        offender = self._offenders.get(peer_id)
        return max(offender.banned_until - now, 0.0) if offender is not None else 0.0

    def banned_now(self, now: float) -> int:
        return sum(o.banned_until > now for o in list(self._offenders.values()))
