"""Events a peer reports to its program: it moved, it took a stage's state, an averaging round's outcome, it ran
out of memory.

They are structured so that programs print them (`swarm-peer --json` prints each as one JSON line the moment it
happens) and benchmarks and tests read their fields, never the wording of log messages. The library only calls
the `on_event` callback it was given; what is done with an event is the program's business.

Fields, by kind (every event also has `event`, its kind, and `at`, the Unix time it happened):
- moved: `from_stage`, `to_stage`
- state_taken: `stage`, `source` (peer, checkpoint or fresh), `peer_id` (the source peer, or the peer whose checkpoint
  it was; "" for this peer's own), `steps_behind` (optimizer steps the state is behind the stage's last announced
  one: what was lost, where `online_peers`, the other online peers of the stage then, is 0), `optimizer_steps`,
  `averaging_round`, `seconds` (time the download took), `reason` (join, move, catch_up, or rebase: DiLoCo one round behind took the anchor and kept its local steps)
- averaging_round: `stage`, `round`, `outcome` (applied, skipped, dropped, alone or caught_up), `group_size`,
  `change` (relative change of the parameters, 0 unless applied), `matchmaking_seconds` and `allreduce_seconds`
  (how long finding the group and the all-reduce took; 0 unless applied)
- pausing: `stages`, `in_flight` (requests at its stages it waits for), `trainer_in_flight` (its trainer's
  microbatches it waits for), `reason`
- paused: `stages`, `seconds` (from the request to paused, drains included), `device_bytes_freed`, `trainer_drained`,
  `reason`
- leaving: `stages` (those only this peer serves), `start_within` (seconds it waits for a peer to take them)
- handed_over: `stages`, `taken` (by other peers), `left_behind` (nobody took them: their training since the last
  checkpoint stays on this machine), `seconds`, `hurried` (its owner asked to stop at once)
- out_of_memory: `stage`, `action` (smaller_window, shorter_span or busy: swarm/server/shedding.py),
  `kept_microbatches` (the window from now on), `out_of_memory` (such errors at this stage so far), `error` (one line)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class EventKind(StrEnum):
    MOVED = "moved"
    STATE_TAKEN = "state_taken"
    AVERAGING_ROUND = "averaging_round"
    OUT_OF_MEMORY = "out_of_memory"  # a request ran out of memory: it was answered busy, and the stage shed work
    PAUSING = "pausing"  # the owner asked for a pause: the peer drains what is in flight (said at once)
    PAUSED = "paused"  # the owner paused the peer: it drained, and its device memory is free
    RESUMED = "resumed"  # the owner resumed it: it caught up with its stage and serves again
    TRAINS_ONLY = "trains_only"  # a CPU peer that holds no stage, or too slowly to help, trains without serving
    LEAVING = "leaving"  # a stopping peer hands the stages only it serves over (server/handover.py)
    HANDED_OVER = "handed_over"  # ... and how that went


class StateSource(StrEnum):
    PEER = "peer"  # downloaded from an online peer of the stage
    CHECKPOINT = "checkpoint"  # this peer's own checkpoint of the stage
    FRESH = "fresh"  # nobody had it: the seed initialisation
    PRETRAINED = "pretrained"  # nobody had it: the swarm's pretrained model (swarm/hf/pretrained.py)
    OWN = "own"  # this peer's own state, kept while it was paused: nobody had gone further


class RoundOutcome(StrEnum):
    APPLIED = "applied"  # averaged with others, and the result applied
    SKIPPED = "skipped"  # no group formed, a peer left, a timeout: nothing changed
    DROPPED = "dropped"  # averaged, but the result failed its checks and was not applied
    ALONE = "alone"  # no other peer of the stage: DiLoCo applied its own outer step, the others nothing
    CAUGHT_UP = "caught_up"  # others averaged without this peer; it counts on from their round


@dataclass(frozen=True)
class Event:
    kind: EventKind
    fields: dict[str, Any]
    at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"event": str(self.kind), "at": round(self.at, 3), **self.fields}


OnEvent = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The default sink: a library user that does not care about events."""
