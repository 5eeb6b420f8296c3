"""A stage's averager: what this peer contributes to a round, how a result is checked and applied (the delta
rule; DiLoCo's outer step), and hivemind's DecentralizedAverager that does the network part. The math (when a
round is due, the outer step, timeouts, payloads) is swarm/averaging/rules.py's; when a stage averages,
swarm/server/rounds.py's. The modes, and why this is built on DecentralizedAverager rather than hivemind.Optimizer,
are in docs/AVERAGING.md.

Thread model: begin_round() and finish_round() touch the model and run in the stage's worker thread
(swarm/server/compute.py), between two requests; run_round() blocks on the network and runs in a thread of its
own. Creating a StageAverager forks hivemind's averager process (which ignores Ctrl-C: the peer stops it).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from typing import AsyncIterator  # noqa: UP035 (hivemind detects streams by typing.AsyncIterator only)

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from swarm.averaging.identical_allreduce import IdenticalResultAllReduce
from swarm.averaging.robust_allreduce import AveragingExclusions, RobustAllReduce, judge_round
from swarm.averaging.rules import (
    MAX_ROUND_CHANGE,
    PART_SIZE_BYTES,
    POLL_SECONDS,
    ROUND_SLACK,
    RoundTiming,
    averaging_compression,
    averaging_prefix,
    gathered_proof,
    outer_step,
    round_change,
    round_payload_bytes,
)
from swarm.errors import AveragingError, IncompleteRoundError
from swarm.manifests.manifest import AveragingConfig, Manifest
from swarm.trust.secret import SwarmSecret

logger = logging.getLogger(__name__)


class _Averager(DecentralizedAverager):
    """hivemind's averager, which also closes its own connection to the p2p daemon when it stops (1.1.12 leaves
    that connection's socket file behind in the temporary folder), and which, in a private swarm, lets into
    the groups it leads only peers that prove they hold the swarm's secret."""

    def __init__(self, *args, swarm_secret: SwarmSecret | None = None, identical_results: bool = False, **kwargs):
        self.swarm_secret = swarm_secret  # set before the averager's process starts: it checks join requests
        # every peer ends with the same mean (swarm/averaging/identical_allreduce.py)
        self.identical_results = identical_results
        # partners this peer caught sending bad values (swarm/averaging/robust_allreduce.py); lives in the averager's
        # process, which tells the peer's process how many strikes and exclusions it gave through shared memory
        self.exclusions = AveragingExclusions()
        self.shared_strikes = mp.Value("i", 0, lock=False)
        self.shared_exclusions = mp.Value("i", 0, lock=False)
        # the all-reduce timeout lives in shared memory: it adapts to measured rounds after the process forked
        self._shared_allreduce_timeout = mp.Value("d", 0.0, lock=False)
        super().__init__(*args, **kwargs)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind's, without its SIGINT 'ignore' in the calling process (set to make the child deaf to Ctrl-C, and
        never restored: a Ctrl-C in the seconds the averager takes to start was lost, and the peer went on). Here
        SIGINT is only held back while the process forks: the child ignores it before it can arrive (run), and the
        caller receives one that came meanwhile as soon as the fork is done."""
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the peer, which stops this process
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        super().run()

    @property
    def _allreduce_timeout(self) -> float | None:  # read by hivemind's _step, in the averager's process
        value = self._shared_allreduce_timeout.value
        return value if value > 0 else None

    @_allreduce_timeout.setter
    def _allreduce_timeout(self, value: float | None) -> None:
        self._shared_allreduce_timeout.value = float(value or 0.0)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.swarm_secret is not None and not self.swarm_secret.check(
            str(context.remote_id), gathered_proof(request.gather)
        ):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if self.exclusions.excluded(str(context.remote_id)):  # it sent bad values to our recent rounds
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs) -> None:
        # hivemind 1.1.12's method, with three changes: a robust all-reduce (swarm/averaging/robust_allreduce.py), in
        # diloco mode one whose result is the same at every peer, and a round whose result is incomplete or poisoned
        # fails instead of being applied (hivemind keeps this peer's own values for the parts whose reducer was too slow
        # or left, logs "received 72.6% results" and reports success: replicas then differ, and DiLoCo's anchors
        # would stay apart for good)
        group_id = group_info.group_id if group_id is None else group_id
        runner_type = IdenticalResultAllReduce if self.identical_results else RobustAllReduce
        runner = runner_type(
            exclusions=self.exclusions,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        async for tensor, result in azip(as_aiter(*tensors), runner):
            if self.identical_results:
                tensor.copy_(result)  # the mean itself: the same bits at every peer
            else:
                tensor.add_(result)  # the difference to the mean (averaging_alpha is 1: it is never set)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        verdict = judge_round(runner, self.exclusions)
        self.shared_strikes.value, self.shared_exclusions.value = self.exclusions.strikes, self.exclusions.total
        if verdict is not None:
            raise AveragingError(verdict)
        container = runner.tensor_part_container
        if container.failed_size:
            received = 1.0 - container.failed_size / max(container.total_size, 1)
            raise IncompleteRoundError(
                f"only {received:.0%} of the round's result arrived (a peer of the group was too slow or left)"
            )

    async def _shutdown(self, timeout: float | None) -> None:
        try:
            await super()._shutdown(timeout)
        except Exception as e:  # the daemon may be gone already (Ctrl-C reaches the whole process group)
            logger.debug(f"averager shutdown: {e!r}")
        try:
            await self._p2p.shutdown()
        except Exception as e:
            logger.debug(f"averager p2p shutdown: {e!r}")


class StageAverager:
    """Rounds of one stage for one peer: what is averaged, how the result is applied, and the hivemind averager
    that does the network part (a process of its own, sharing the averaged buffers with this one)."""

    def __init__(
        self,
        manifest: Manifest,
        stage: int,
        dht: DHT,
        names: list[str],
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
    ):
        self.config: AveragingConfig = manifest.averaging
        assert self.config.mode in ("parameters", "diloco"), "mode 'none' has no averager"
        self.names, self.params, self.optimizer = names, params, optimizer
        self.diloco = self.config.mode == "diloco"
        if self.diloco:  # the parameters of the last round, and the outer optimizer's momentum
            self.anchor = [p.detach().float().cpu().clone() for p in params]
            self.momentum = [torch.zeros_like(a) for a in self.anchor]
        elif self.config.optimizer_state:
            _initialize_optimizer_state(params, optimizer)
        self._start: list[torch.Tensor] | None = None  # the averaged quantities as they were when the round began
        self.last_change = 0.0  # how far the last applied round moved the parameters, relative to their norm
        buffers = [torch.zeros(tuple(q.shape), dtype=torch.float32) for q in self._quantities()]
        self.numels = [b.numel() for b in buffers]
        payload = round_payload_bytes(self.numels, self.config.compression, 2)
        self.timing = RoundTiming(self.config.matchmaking_time, self.config.timeout, payload)
        self.last_matchmaking_seconds = self.last_allreduce_seconds = 0.0
        self.secret = manifest.secret  # a private swarm's rounds admit only peers that prove they hold it
        self._proof = manifest.proof(str(dht.peer_id))
        self._averager = _Averager(
            buffers,
            dht,
            swarm_secret=manifest.secret,
            identical_results=self.diloco,  # the replicas keep one anchor
            start=True,
            prefix=averaging_prefix(manifest, stage),
            min_group_size=2,
            min_matchmaking_time=self.config.matchmaking_time,
            request_timeout=max(1.0, self.config.matchmaking_time / 2),
            allreduce_timeout=self.timing.allreduce_timeout(),
            next_chunk_timeout=self.config.timeout / 2,
            compression=averaging_compression(self.config.compression),
            part_size_bytes=PART_SIZE_BYTES,
            allow_state_sharing=False,  # joiners take the state from the stage server (rpc_download_state)
            shutdown_timeout=5,
        )

    def _quantities(self) -> list[torch.Tensor]:
        """The live tensors whose values take part in a round (parameters; with optimizer_state, statistics)."""
        quantities: list[torch.Tensor] = list(self.params)
        if not self.diloco and self.config.optimizer_state:
            for p in self.params:
                state = self.optimizer.state.get(p, {})
                quantities += [state[key] for key in ("exp_avg", "exp_avg_sq", "momentum_buffer") if key in state]
        return quantities

    # worker thread ----------------------------------------------------------------------------------

    @torch.no_grad()
    def begin_round(self) -> None:
        """Put this peer's contribution into the averager's buffers and remember where the round started."""
        current = [q.detach().float().cpu().clone() for q in self._quantities()]
        if len(current) != len(self.numels):
            raise AveragingError("the optimizer's statistics changed shape since averaging started")
        self._start = current
        with self._averager.get_tensors() as buffers:
            for i, (buffer, value) in enumerate(zip(buffers, current)):
                buffer.copy_(self.anchor[i] - value if self.diloco else value)

    @torch.no_grad()
    def finish_round(self, averaged: bool, alone: bool = False) -> bool:
        """Apply a round's result (`averaged`); True if the model changed.

        A peer `alone` in its stage applies, in diloco mode, the outer step to its own pseudo-gradient (the outer
        step is part of the method even without others). After a failed round nothing changes: in diloco mode the
        replicas must keep one anchor, so a peer whose round failed while others' succeeded takes the stage's
        state again (the stage server sees that it fell behind by the round numbers)."""
        assert self._start is not None, "finish_round without begin_round"
        start, self._start = self._start, None
        if averaged:
            with self._averager.get_tensors() as buffers:
                result = [b.clone() for b in buffers]
            if not all(torch.isfinite(r).all() for r in result):
                raise AveragingError("the round's result holds NaN or Inf (a peer contributed them); it was dropped")
            params = len(self.params)
            change = round_change(start[:params], result[:params], self.diloco, self.anchor if self.diloco else [])
            # the optimizer's statistics too, when they are averaged (a huge or vanishing second moment would make
            # the next steps huge); a new optimizer's statistics (all zero) have no scale to compare with
            statistics = round_change(start[params:], result[params:], False, []) if start[params:] else 0.0
            statistics_norm = sum(float(s.double().square().sum()) for s in start[params:])
            self.last_change = change
            if not change <= MAX_ROUND_CHANGE or (statistics_norm > 0 and not statistics <= MAX_ROUND_CHANGE):
                raise AveragingError(
                    f"the round's result would move the parameters by {change:.3g} of their norm and the optimizer's "
                    f"statistics by {statistics:.3g} (at most {MAX_ROUND_CHANGE:g} is plausible: a peer contributed "
                    "absurd values); it was dropped"
                )
        elif self.diloco and alone:
            result = [a - s for a, s in zip(self.anchor, start)]
        else:
            return False
        quantities = self._quantities()
        if self.diloco:
            outer_step(self.anchor, self.momentum, result, self.config.outer_learning_rate, self.config.outer_momentum)
            for p, a, s in zip(quantities, self.anchor, start):
                local = p.detach().float().cpu() - s  # local steps taken while the round ran
                p.copy_((a + local).to(p.device, p.dtype))
        else:
            for q, r, s in zip(quantities, result, start):
                q.add_((r - s).to(q.device, q.dtype))
            _clamp_non_negative_statistics(self.params, self.optimizer)
        return True

    # network thread ---------------------------------------------------------------------------------

    def run_round(self, weight: float, timeout: float | None = None) -> int:
        """Find a group (within `timeout` seconds, by default RoundTiming's) and all-reduce the buffers; the
        group's size. Raises AveragingError on failure. How long the matchmaking and the all-reduce took sets the
        next rounds' timeouts."""
        find_timeout = timeout if timeout is not None else self.timing.find_timeout()
        self._averager._allreduce_timeout = self.timing.allreduce_timeout()
        begin = time.monotonic()
        grouped_at = None
        try:
            control = self._averager.step(
                weight=max(float(weight), 1.0),
                timeout=find_timeout,
                allow_retries=False,
                gather={"proof": self._proof},
                wait=False,
            )
            # hivemind resolves `control` from its averager's process: if that process died (out of memory, or
            # stopped at shutdown), nothing would, so the round has a deadline of its own
            deadline = begin + find_timeout + self._averager._allreduce_timeout + ROUND_SLACK
            while not control.done():
                if grouped_at is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                    grouped_at = time.monotonic()
                alive = self._averager.is_alive()
                if time.monotonic() > deadline or not alive:
                    control.cancel()
                    gone = "" if alive else " (the averager's process is gone)"
                    raise TimeoutError(f"no result in {time.monotonic() - begin:.0f} s{gone}")
                time.sleep(POLL_SECONDS)
            gathered = control.result()
        except Exception as e:  # hivemind raises several types for a round that fell through
            self.timing.failed(found_group=grouped_at is not None)
            raise AveragingError(f"the round failed: {type(e).__name__}: {e}") from None
        if not gathered:
            self.timing.failed(found_group=grouped_at is not None)
            raise AveragingError(
                f"could not find a group within {find_timeout:.0f}s (the stage's other peers did not join in time)"
            )
        end = time.monotonic()
        grouped_at = grouped_at if grouped_at is not None else end
        self.last_matchmaking_seconds, self.last_allreduce_seconds = grouped_at - begin, end - grouped_at
        self.timing.succeeded(self.last_matchmaking_seconds, self.last_allreduce_seconds)
        if self.secret is not None:  # a group led by an outsider: its result must not be applied
            for peer_id, data in gathered.items():
                if not self.secret.check(str(peer_id), data.get("proof") if isinstance(data, dict) else None):
                    raise AveragingError(f"peer {str(peer_id)[-8:]} took part without the swarm's secret; dropped")
        return len(gathered)

    # state ------------------------------------------------------------------------------------------

    def outer_state(self) -> list[tuple[str, torch.Tensor]]:
        """DiLoCo's anchor and outer momentum by name, to hand over with the stage's state (empty otherwise)."""
        if not self.diloco:
            return []
        return [(f"outer/{n}/anchor", a.clone()) for n, a in zip(self.names, self.anchor)] + [
            (f"outer/{n}/momentum", m.clone()) for n, m in zip(self.names, self.momentum)
        ]

    @torch.no_grad()
    def load_outer_state(self, items: dict[str, torch.Tensor]) -> None:
        """Take over the anchor and momentum (already checked for names, shapes and finite values); without
        them (a state saved in parameters mode) the anchor is the current parameters."""
        if not self.diloco:
            return
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            anchor = items.get(f"outer/{name}/anchor")
            self.anchor[i] = (anchor if anchor is not None else p.detach().float().cpu()).clone()
            momentum = items.get(f"outer/{name}/momentum")
            self.momentum[i] = momentum.clone() if momentum is not None else torch.zeros_like(self.anchor[i])

    @torch.no_grad()
    def rebase(self, items: dict[str, torch.Tensor]) -> None:
        """DiLoCo, one round behind: take the stage's new anchor and outer momentum (already checked) and keep this
        peer's local progress on top of it (parameters = new anchor + (parameters - own anchor)). The steps taken
        since the round this peer missed are not dropped: they go into its next pseudo-gradient."""
        assert self.diloco, "only DiLoCo replicas share an anchor"
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            anchor, momentum = items[f"outer/{name}/anchor"], items[f"outer/{name}/momentum"]
            local = p.detach().float().cpu() - self.anchor[i]
            p.copy_((anchor + local).to(p.device, p.dtype))
            self.anchor[i], self.momentum[i] = anchor.clone(), momentum.clone()

    @property
    def strikes(self) -> int:
        """Flags this peer gave its partners for bad values (swarm/averaging/robust_allreduce.py)."""
        return self._averager.shared_strikes.value

    @property
    def exclusions(self) -> int:
        """Partners this peer excluded from its rounds for repeated bad values."""
        return self._averager.shared_exclusions.value

    def shutdown(self) -> None:
        try:
            self._averager.shutdown()
        except Exception as e:  # its process may already be gone
            logger.warning(f"stopping the averager failed: {e!r}")


def _initialize_optimizer_state(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's statistics before the first step, so that every round averages the same tensors."""
    with torch.no_grad():
        for p in params:
            state = optimizer.state[p]
            if len(state):
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("momentum", 0):
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _clamp_non_negative_statistics(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """The delta rule may push a mean of squares slightly below zero (compression error): Adam would take its
    square root."""
    for p in params:
        value = optimizer.state.get(p, {}).get("exp_avg_sq")
        if value is not None:
            value.clamp_(min=0.0)
