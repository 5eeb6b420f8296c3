"""What a peer counts, as one snapshot per moment: its announcement, its status line and its metrics all read the
same StageStats and TrainerStats, so a figure is listed once and means the same everywhere. The Peer
(swarm/peer/peer.py) hands its status line and its metrics a PeerSnapshot: those of the moment, with its moves and
traffic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from swarm.dht.records import PeerState


@dataclass
class Traffic:
    """Bytes this peer moved over the network, by kind; shared by its stage servers (one after another, as it
    moves) and its trainer, and announced as totals."""

    activation_sent: int = 0  # activations and gradients between stages
    activation_received: int = 0
    averaging_sent: int = 0  # payload of averaging rounds
    averaging_received: int = 0


@dataclass(frozen=True)
class StageStats:
    """One moment of the stage this peer serves."""

    stage: int
    state: PeerState
    throughput: float  # samples/s it can serve: the lower of compute and network
    compute_throughput: float
    network_throughput: float
    delivered_throughput: float  # EMA of what it actually served
    samples_served: int
    outstanding: int  # requests accepted and not yet answered
    optimizer_steps: int
    recomputed_forwards: int
    bad_requests: int
    busy_replies: int
    banned_replies: int
    bans: int
    averaging_round: int  # number of the stage's next round
    round_samples: int  # samples served since that round's count began
    averaging_rounds: int  # rounds averaged with at least one other peer
    averaging_rounds_failed: int
    last_group_size: int
    checkpoints_saved: int
    activation_bytes_sent: int
    activation_bytes_received: int
    averaging_bytes_sent: int
    averaging_bytes_received: int
    forwarded: int = 0  # microbatches this peer passed on to the next stage and brought back
    rerouted: int = 0  # next hops that failed and were replaced by another peer of their stage
    too_late: int = 0  # gradients not applied: the hop's deadline had passed
    duplicates: int = 0  # microbatches refused because a later stage (or this one) had them already
    replayed: int = 0  # repeats of microbatches applied here already, answered with their first reply
    averaging_strikes: int = 0  # flags this peer gave partners whose round values were far off
    averaging_exclusions: int = 0  # partners it excluded from its rounds for that
    staleness_mean: float = 0.0  # weight versions between a forward here and its gradient's step (recent mean)
    staleness_max: int = 0  # ... and their recent maximum
    gate_waiting: int = 0  # microbatches waiting now for this stage's next step (server/step_gate.py)
    gate_waited: int = 0  # ... in all
    gate_expired: int = 0  # slots given up because their backward did not come
    memory_used: int = 0  # bytes the peer holds (GPU memory reserved, or its resident memory on a CPU)
    memory_available: int = 0  # bytes it may use (measured at start, or --max-memory); 0: not measured
    out_of_memory: int = 0  # requests that ran out of memory here (answered busy; the stage shed work)
    kept_microbatches: int = 0  # microbatches whose activations it keeps for backward now (shrinks on out of memory)
    steps_behind: int = 0  # optimizer steps the state it took over was behind the stage's last announced one (lost)

    def to_dict(self) -> dict[str, Any]:
        """As the status line prints it."""
        fields = {key: round(value, 3) if isinstance(value, float) else value for key, value in asdict(self).items()}
        return {**fields, "state": str(self.state)}


@dataclass(frozen=True)
class TrainerStats:
    """One moment of this peer's trainer."""

    loss: float  # mean over the last REPORT_WINDOW seconds; NaN before the first microbatch completes
    samples_per_second: float
    samples: int
    microbatches: int
    failed_microbatches: int
    unserved_stages: tuple[int, ...]  # stages with no online peer at the last look
    bytes_sent: int = 0  # to stage peers (tokens, and with the relay pipeline activations), not local calls
    bytes_received: int = 0
    window: int = 1  # microbatches it keeps in flight now (swarm/client/window.py)
    round_trip: float = 0.0  # recent seconds from sending a microbatch to its loss coming back
    checks: int = 0  # microbatches sent twice to compare two replicas (swarm/client/checks.py)
    check_disagreements: int = 0
    convicted: tuple[str, ...] = ()  # peers it caught computing wrong results

    def to_dict(self) -> dict[str, Any]:
        """As the status line prints it (JSON has no NaN: None until there is a loss)."""
        return {
            "trainer_loss": round(self.loss, 4) if self.loss == self.loss else None,
            "trainer_samples_per_second": round(self.samples_per_second, 2),
            "trainer_samples": self.samples,
            "trainer_failed_microbatches": self.failed_microbatches,
            "unserved_stages": list(self.unserved_stages),
            "trainer_bytes_sent": self.bytes_sent,
            "trainer_bytes_received": self.bytes_received,
            "trainer_window": self.window,
            "trainer_round_trip": round(self.round_trip, 4),
            "trainer_checks": self.checks,
            "trainer_check_disagreements": self.check_disagreements,
            "trainer_convicted": list(self.convicted),
        }


@dataclass(frozen=True)
class PeerSnapshot:
    """One moment of the whole peer: the stage it serves, its trainer, its moves and its traffic."""

    stage: StageStats | None  # None: no stage yet (choosing, measuring, taking the state over) or ever (trainer only)
    trainer: TrainerStats | None  # None: no trainer (yet)
    moves: int  # from one stage to another
    traffic: Traffic  # a copy: the figures of this moment
    span: tuple[int, int] | None = None  # the stages [start, end) it serves (`stage` is the first one's)
    stages: tuple[StageStats, ...] = ()  # every stage of the span, first to last
    data: dict | None = None  # its trainer's reading and fetching (swarm/dataset/stream.py, ChunkStream.stats)

    @classmethod
    def of(
        cls,
        stage: StageStats | None,
        trainer: TrainerStats | None,
        moves: int,
        traffic: Traffic,
        span: tuple[int, int] | None = None,
        stages: tuple[StageStats, ...] = (),
        data: dict | None = None,
    ) -> PeerSnapshot:
        return cls(stage, trainer, moves, replace(traffic), span, stages, data)

    @property
    def state(self) -> PeerState:
        """The served stage's state; joining while there is none."""
        return PeerState.JOINING if self.stage is None else self.stage.state
