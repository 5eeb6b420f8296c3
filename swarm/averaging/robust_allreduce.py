"""hivemind's butterfly all-reduce, made robust to a replica that sends plausible but wrong values.

In a butterfly all-reduce each peer reduces one part of the averaged vector: it receives that part from every
member and sends back the result. Two things can go wrong with a dishonest member, and both are handled here:

- **as a sender**, it contributes a bad part: every reducer aggregates with CenteredClip instead of the mean
  (swarm/averaging/robust_aggregation.py), which bounds what one contribution can do, and flags a contribution far
  from the result;
- **as a reducer**, it sends back a bad result for its part: every peer compares each result it receives with its
  own part, against how far its own part was from the aggregates it computed itself; a result too far away fails
  the round at this peer (nothing is applied) and flags the reducer.

A flagged peer gets a strike (`AveragingExclusions`); STRIKES_TO_EXCLUDE strikes within STRIKE_WINDOW seconds
exclude it from this peer's rounds for FIRST_EXCLUSION seconds, twice as long each further time: a group this
peer leads does not admit it, and in a group someone else leads this peer's reducer leaves its contributions out
(still measuring them, so that a repeat offender stays excluded). Leaving a peer out after its first strike was
tried and dropped: one false flag then pulled the honest replicas apart, which made more flags
(benchmarks/poisoning.py, docs/BENCHMARKS.md). Excluded peers are decided by each peer alone, from what it saw
itself: nobody can get an honest peer excluded by saying so.

Only hivemind 1.1.12's reducer accumulation and the containers' result registration change here; matchmaking,
streaming, timeouts and the banning of senders that fail to send are hivemind's.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer, TensorPartReducer

from swarm.averaging.robust_aggregation import OUTLIER_FACTOR, capped_weights, rms, robust_aggregate, suspicious_result
from swarm.trust.bans import Bans

logger = logging.getLogger(__name__)

STRIKES_TO_EXCLUDE = 2  # flagged in this many rounds within STRIKE_WINDOW: excluded (one flag may be bad luck)
STRIKE_WINDOW = 1800.0
FIRST_EXCLUSION = 120.0  # seconds; doubled for each further exclusion, up to an hour (swarm/trust/bans.py)


class AveragingExclusions(Bans):
    """Strikes and exclusions of a stage's averaging partners, as this peer saw them (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(bad_before_ban=STRIKES_TO_EXCLUDE, window=STRIKE_WINDOW, first_ban=FIRST_EXCLUSION)
        self.strikes = 0

    def strike(self, peer_id: str, reason: str) -> None:
        self.strikes += 1
        length = self.record_bad_request(peer_id, time.monotonic())
        if length:
            logger.warning(f"excluding peer {peer_id[-8:]} from this stage's averaging for {length:.0f}s: {reason}")
        else:
            logger.warning(f"averaging partner {peer_id[-8:]} flagged: {reason}")

    def excluded(self, peer_id: str) -> bool:
        return self.banned_for(peer_id, time.monotonic()) > 0


class RobustReducer(TensorPartReducer):
    """hivemind's reducer, aggregating each part with CenteredClip over all contributions (instead of a running
    sum), dropping those of excluded senders. It keeps each part's aggregate (`means`), the senders it flagged, and
    how far apart the contributions were (a reference for judging other reducers' results)."""

    def __init__(self, part_shapes, num_senders: int, own_sender: int | None, excluded_senders: set[int]):
        self.contributions: list[tuple[int, torch.Tensor, float]] = []
        super().__init__(part_shapes, num_senders)
        self.own_sender, self.excluded_senders = own_sender, excluded_senders
        self.means: dict[int, torch.Tensor] = {}
        self.flagged: dict[int, float] = {}  # sender index -> its largest distance, in median distances
        self.spreads: list[float] = []  # per part it reduced: the farthest contribution it did not flag

    def reset_accumulators(self) -> None:
        self.contributions = []
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        # hivemind 1.1.12's method, except that the part is kept (not added to a sum) for check_current_part_finished
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.contributions.append((sender_index, tensor_part, float(weight)))
            self.current_part_accumulated_from += 1
            self.denominator += weight
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from != self.num_current_senders:
            return
        used = [c for c in self.contributions if c[0] not in self.excluded_senders] or self.contributions
        # weights are capped against every contribution's (with excluded ones left out, two may remain, one of them
        # claiming a million)
        weights = capped_weights([weight for _, _, weight in self.contributions]).tolist()
        if len(self.contributions) <= 2:
            weights = [weight for _, _, weight in self.contributions]
        by_sender = {c[0]: w for c, w in zip(self.contributions, weights)}
        verdict = robust_aggregate([part for _, part, _ in used], [by_sender[sender] for sender, _, _ in used])
        for position in verdict.outliers:
            sender = used[position][0]
            ratio = verdict.distances[position] / max(verdict.median_distance, 1e-30)
            self.flagged[sender] = max(self.flagged.get(sender, 0.0), ratio)
        for sender, part, _ in self.contributions:  # left out, but still judged: a repeat offender is excluded
            if (sender, part) not in [(c[0], c[1]) for c in used] and len(used) >= 2:
                ratio = rms(part.float() - verdict.aggregate) / max(verdict.median_distance, 1e-30)
                if not ratio <= OUTLIER_FACTOR:
                    self.flagged[sender] = max(self.flagged.get(sender, 0.0), ratio)
        if len(used) >= 2:  # a part only this peer contributed to says nothing of how far replicas are apart
            # the farthest contribution not flagged: an honest reducer's aggregate lies among the contributions, so
            # no farther from ours than about twice this (a median could be 0 when two contributions coincide)
            self.spreads.append(max(d for i, d in enumerate(verdict.distances) if i not in verdict.outliers))
        else:
            logger.debug(f"part {self.current_part_index} had {len(used)} contribution(s) of {self.num_senders}")
        self.means[self.current_part_index] = verdict.aggregate
        self.current_part_future.set_result(verdict.aggregate)
        self.reset_accumulators()

    def reference_distance(self) -> float | None:
        """How far the contributions it did not flag were from the aggregates it computed, at most; None if it
        reduced nothing with others (it cannot judge others' results then)."""
        return max(self.spreads) if self.spreads else None


class ResultDistances:
    """Mixed into a result container: the largest RMS distance, per reducing peer, between the results it sent and
    this peer's own parts (what a dishonest reducer would give away)."""

    def record_result(self, peer_index: int, distance: float) -> None:
        distances: dict[int, float] = self.__dict__.setdefault("result_distances", {})
        distances[peer_index] = max(distances.get(peer_index, 0.0), distance)


class _DeltaContainer(TensorPartContainer, ResultDistances):
    """hivemind's container whose results are differences to this peer's own parts: their size is the distance."""

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        self.record_result(peer_index, rms(part))
        super().register_processed_part(peer_index, part_index, part)


class RobustAllReduce(AllReduceRunner):
    """hivemind's AllReduceRunner with the RobustReducer and a container that measures every reducer's results."""

    def __init__(self, exclusions: AveragingExclusions, **kwargs):
        super().__init__(**kwargs)
        container_arguments = {k: v for k, v in kwargs.items() if k not in RUNNER_ARGUMENTS}
        container = _DeltaContainer(
            kwargs["tensors"], kwargs["peer_fractions"], return_deltas=True, **container_arguments
        )
        install_robust_parts(self, container, exclusions)


# AllReduceRunner's own keyword arguments; the rest go to its TensorPartContainer
RUNNER_ARGUMENTS = frozenset(
    {
        "p2p",
        "servicer_type",
        "prefix",
        "group_id",
        "tensors",
        "weight",
        "ordered_peer_ids",
        "peer_fractions",
        "modes",
        "sender_timeout",
        "reducer_timeout",
    }
)


def install_robust_parts(
    runner: AllReduceRunner, container: TensorPartContainer, exclusions: AveragingExclusions
) -> None:
    """Give `runner` the container and a RobustReducer (dropping the senders `exclusions` holds)."""
    runner.tensor_part_container = container
    own_index = runner.ordered_peer_ids.index(runner.peer_id)
    runner.parts_for_local_averaging = container.get_raw_input_parts(own_index)
    senders = [str(peer_id) for peer_id in runner.sender_peer_ids]
    own_sender = senders.index(str(runner.peer_id)) if str(runner.peer_id) in senders else None
    excluded = {index for index, peer_id in enumerate(senders) if exclusions.excluded(peer_id)}
    runner.tensor_part_reducer = RobustReducer(
        tuple(part.shape for part in runner.parts_for_local_averaging), len(senders), own_sender, excluded
    )


def judge_round(runner: AllReduceRunner, exclusions: AveragingExclusions) -> str | None:
    """After a round: strike the senders this peer's reducer flagged and the reducers whose results lie too far
    from this peer's parts; the reason the round must not be applied here (a bad result), or None."""
    reducer = runner.tensor_part_reducer
    assert isinstance(reducer, RobustReducer)
    senders = [str(peer_id) for peer_id in runner.sender_peer_ids]
    for sender, ratio in reducer.flagged.items():
        exclusions.strike(senders[sender], f"its contribution was {ratio:.1f} median distances from the aggregate")
    reference = reducer.reference_distance()
    if reference is None:
        return None
    own_index = runner.ordered_peer_ids.index(runner.peer_id)
    distances: dict[int, float] = getattr(runner.tensor_part_container, "result_distances", {})
    verdict = None
    for peer_index, distance in distances.items():
        if peer_index != own_index and suspicious_result(distance, reference):
            peer_id = str(runner.ordered_peer_ids[peer_index])
            reason = f"the part it reduced lay {distance / max(reference, 1e-30):.1f} reference distances from ours"
            exclusions.strike(peer_id, reason)
            verdict = f"peer {peer_id[-8:]} sent back a result far from every replica's ({reason}); dropped"
    return verdict
