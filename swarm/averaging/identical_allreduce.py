"""An all-reduce whose result is the same, bit for bit, at every peer of the group (for DiLoCo's shared anchor).

hivemind's butterfly all-reduce gives each peer its own part plus the compressed difference between the mean and
that part: with a lossy codec every peer ends with a slightly different mean (its reducer's own part is exact,
the others carry the codec's error on their difference). Parameter averaging does not mind (the next round averages
the parameters again, so the errors do not add up), but DiLoCo's replicas apply an outer step to the mean and keep
the result as their anchor: different means leave the anchors apart, and nothing ever pulls them together again.
Measured at 4 bits: two replicas' anchors 0.2 of an outer step apart after one round, and the gap grows with
every round.

Here the reducer of a part sends the compressed mean itself, and every peer, the reducer included, takes the
decoded mean as its result: all peers decode the same bytes (the codecs are deterministic), so all end with the
same mean. The codec's error is then common to all replicas instead of different at each. Only the lines of
hivemind 1.1.12 that send and take the result are replaced (RUNNER_ARGUMENTS and the streaming loop below follow
its code); everything else (matchmaking, timeouts, banning of failed senders) is hivemind's. A part whose reducer
failed keeps the peer's own value, as in hivemind; such a peer fails its round (swarm/averaging/averager.py refuses
incomplete results) and, one round behind, rebases on the stage's anchor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from swarm.averaging.robust_aggregation import rms
from swarm.averaging.robust_allreduce import (
    RUNNER_ARGUMENTS,
    AveragingExclusions,
    ResultDistances,
    RobustReducer,
    install_robust_parts,
)


class _MeanResultContainer(TensorPartContainer, ResultDistances):
    """Holds the decoded means as the results (not deltas: original + (mean - original) is not always the mean in
    floating point), the mean of this peer's own parts passed through the codec like the ones it sends."""

    own_index: int = -1
    reducer: RobustReducer | None = None

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        original, info = self._input_parts_by_peer[peer_index][part_index]
        if peer_index == self.own_index:  # `part` is the exact mean minus the local part: use the decoded mean
            assert self.reducer is not None
            part = deserialize_torch_tensor(self.compression.compress(self.reducer.means[part_index], info))
        self.record_result(peer_index, rms(part.float() - original.float()))
        super().register_processed_part(peer_index, part_index, part.to(original.dtype))


class IdenticalResultAllReduce(AllReduceRunner):
    """hivemind's AllReduceRunner whose reducers send the compressed mean rather than the difference to it; it
    yields the mean of each tensor (hivemind's yields the difference to add)."""

    def __init__(self, exclusions: AveragingExclusions, **kwargs):
        super().__init__(**kwargs)
        container_arguments = {k: v for k, v in kwargs.items() if k not in RUNNER_ARGUMENTS}
        # results are the means; a part whose reducer failed keeps this peer's own value
        container = _MeanResultContainer(
            kwargs["tensors"], kwargs["peer_fractions"], return_deltas=False, **container_arguments
        )
        container.own_index = self.ordered_peer_ids.index(self.peer_id)
        install_robust_parts(self, container, exclusions)  # CenteredClip, and a check of every reducer's results
        assert isinstance(self.tensor_part_reducer, RobustReducer)
        container.reducer = self.tensor_part_reducer

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # hivemind 1.1.12's loop, except that the reply carries the mean itself (its line: averaged_part - tensor_part)
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    mean = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was banned: its parts are no longer needed
                serialized = await loop.run_in_executor(
                    None,
                    lambda: serialize_torch_tensor(mean, part_compression),  # noqa: B023 (awaited at once)
                )
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
