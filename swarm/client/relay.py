"""The relay pipeline: the trainer carries every activation and gradient between stages itself.

The protocol before stage-to-stage forwarding (swarm/server/forwarding.py), kept as `training.pipeline: relay` to
compare against (benchmarks/wan.py): for each stage in turn the trainer calls one peer (chosen by
swarm/routing.py's Router, retried on others until the microbatch's deadline), keeps each stage's inputs so that
a failed backward can be recomputed on another peer, and bans peers that fail. Its trainer link carries
4·(stages−1) activation-sized tensors per microbatch, against the forward pipeline's tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import torch

from swarm.client.pipeline import NO_PEER_WAIT, TrainerParts
from swarm.errors import MicrobatchFailedError, RemoteStageError
from swarm.wire.boundary import boundary_width, middle_extras, token_tensor
from swarm.wire.codes import ErrorCode
from swarm.wire.hops import RELAY_BLAMELESS, check_reply
from swarm.wire.messages import make_request


@dataclass
class _Hop:
    peer_id: str
    inputs: list[torch.Tensor]  # what its forward took: with the token window in a subspace swarm


class RelayedPipeline:
    """Runs microbatches through the stages one call at a time, for a Trainer (whose parts it uses)."""

    def __init__(self, parts: TrainerParts):
        self.parts, self.manifest = parts, parts.manifest
        self.max_elements = parts.max_elements

    async def microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        microbatch_id = uuid.uuid4().hex
        deadline = time.monotonic() + self.manifest.training.timeouts.microbatch
        last = self.manifest.num_stages - 1
        hidden = (*inputs.shape, boundary_width(self.manifest))  # shape of activations and their gradients
        samples = inputs.shape[0]
        tokens = token_tensor(self.manifest, inputs, targets)
        extras = middle_extras(self.manifest, tokens)
        hops: list[_Hop] = []
        done_by: list[str] = []  # the peers that ran this microbatch's forward, stage by stage
        try:
            x = inputs
            for stage in range(last):
                # the peer's work on this microbatch counts as outstanding until its backward is done
                sent = [x, *extras] if stage else [x]
                peer_id, (x_next,) = await self.call(
                    stage, "forward", microbatch_id, sent, [hidden], deadline, hold=True
                )
                hops.append(_Hop(peer_id, sent))
                done_by.append(peer_id)
                x = x_next
            expect = [(), hidden] if last else [()]  # the loss, and the gradient of the last stage's inputs
            last_peer, outputs = await self.call(last, "forward", microbatch_id, [x, tokens], expect, deadline)
            loss, grad = float(outputs[0]), outputs[-1]
            for stage in reversed(range(last)):
                grad = await self._backward(stage, hops[stage], microbatch_id, grad, hidden, deadline)
                self.parts.router.finished(hops.pop().peer_id, samples)
            self.parts.served.update(dict.fromkeys([*done_by, last_peer], samples))
        finally:
            for hop in hops:
                self.parts.router.finished(hop.peer_id, samples)
        return loss, samples

    async def _backward(
        self, stage: int, hop: _Hop, microbatch_id: str, grad: torch.Tensor, hidden: tuple[int, ...], deadline: float
    ) -> torch.Tensor | None:
        """Backward of one stage: to the peer that ran forward, else recomputed from the inputs on any peer."""
        expect = [] if stage == 0 else [hidden]
        begin = time.monotonic()
        try:
            # the peer that ran forward still holds the activations: send only the gradient
            outputs = await self._call_peer(stage, hop.peer_id, "backward", microbatch_id, [grad], expect, deadline)
        except RemoteStageError as e:
            if e.code not in (ErrorCode.UNKNOWN_MICROBATCH, *RELAY_BLAMELESS):
                self.parts.ban(hop.peer_id, f"backward on stage {stage}: {e}")
            # the peer lost the activations (or is busy): let it, or another peer, recompute from the inputs
            prefer = hop.peer_id if e.code in (ErrorCode.UNKNOWN_MICROBATCH, ErrorCode.BUSY) else None
            _, outputs = await self.call(
                stage, "backward", microbatch_id, [grad, *hop.inputs], expect, deadline, prefer=prefer
            )
        except Exception as e:  # timeout or connection failure: the peer may still be working on it
            wasted = time.monotonic() - begin
            self.parts.ban(hop.peer_id, f"backward on stage {stage} failed: {type(e).__name__}: {e}", wasted)
            _, outputs = await self.call(stage, "backward", microbatch_id, [grad, *hop.inputs], expect, deadline)
        return outputs[0] if expect else None

    async def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, deadline: float) -> float:
        """The loss of one batch, forward only."""
        microbatch_id = uuid.uuid4().hex
        hidden = (*inputs.shape, boundary_width(self.manifest))
        last = self.manifest.num_stages - 1
        tokens = token_tensor(self.manifest, inputs, targets)
        extras = middle_extras(self.manifest, tokens)
        x = inputs
        for stage in range(last):
            sent = [x, *extras] if stage else [x]
            _, (x,) = await self.call(stage, "forward", microbatch_id, sent, [hidden], deadline, train=False)
        _, (loss,) = await self.call(last, "forward", microbatch_id, [x, tokens], [()], deadline, train=False)
        return float(loss)

    async def call(
        self,
        stage: int,
        kind: str,
        microbatch_id: str,
        tensors: list[torch.Tensor],
        expect: list[tuple[int, ...]],
        deadline: float,
        train: bool = True,
        prefer: str | None = None,
        hold: bool = False,
    ) -> tuple[str, list[torch.Tensor]]:
        """Call some online peer of `stage` (`prefer` first), retrying on other peers until the deadline.

        The samples count as outstanding at the chosen peer during the call and, with `hold`, after a success
        too (the caller then calls router.finished)."""
        tried: set[str] = set()
        last_error: Exception | None = None
        samples = tensors[0].shape[0]
        while time.monotonic() < deadline:
            if prefer is not None and prefer not in tried:
                peer_id = prefer
            else:
                peer_id = await self._pick(stage, tried, samples)
            if peer_id is None:
                tried.clear()  # every peer failed once: let them be tried again after a pause
                await asyncio.sleep(NO_PEER_WAIT)
                continue
            tried.add(peer_id)
            self.parts.router.started(peer_id, samples)
            succeeded = False
            try:
                begin = time.monotonic()
                outputs = await self._call_peer(stage, peer_id, kind, microbatch_id, tensors, expect, deadline, train)
                succeeded = True
                if kind == "forward":
                    self.parts.router.observed(peer_id, samples, time.monotonic() - begin)
                return peer_id, outputs
            except RemoteStageError as e:
                last_error = e
                if e.code not in RELAY_BLAMELESS:  # a peer that moved did nothing wrong
                    self.parts.ban(peer_id, f"{kind} on stage {stage}: {e}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # timeouts, connection errors
                last_error = e
                wasted = time.monotonic() - begin
                self.parts.ban(peer_id, f"{kind} on stage {stage} failed: {type(e).__name__}: {e}", wasted)
            finally:
                if not (succeeded and hold):
                    self.parts.router.finished(peer_id, samples)
        raise MicrobatchFailedError(
            f"stage {stage} {kind} did not succeed before the deadline (last error: {last_error!r})"
        )

    async def _call_peer(
        self,
        stage: int,
        peer_id: str,
        kind: str,
        microbatch_id: str,
        tensors: list[torch.Tensor],
        expect: list[tuple[int, ...]],
        deadline: float,
        train: bool = True,
    ) -> list[torch.Tensor]:
        """One call to one peer; the reply must hold float32 tensors of exactly the `expect`ed shapes."""
        timeouts = self.manifest.training.timeouts
        timeout = min(
            timeouts.forward if kind == "forward" else timeouts.backward, max(deadline - time.monotonic(), 0.1)
        )
        request = make_request(self.manifest, stage, microbatch_id, tensors, train=train, proof=self.parts.proof)
        return check_reply(await self.parts.send(peer_id, kind, request, timeout), expect, self.max_elements)

    async def _pick(self, stage: int, tried: set[str], samples: int) -> str | None:
        parts = self.parts
        online = await parts.online(stage)
        chosen = parts.router.choose(online, samples, time.monotonic(), parts.rng, exclude=tried)
        if chosen is None:  # peers may have joined since the last look
            online = await parts.online(stage, force=True)
            chosen = parts.router.choose(online, samples, time.monotonic(), parts.rng, exclude=tried)
        parts.note_online(stage, bool(online))
        return None if chosen is None else chosen.peer_id
