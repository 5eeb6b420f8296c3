"""The served stage's model and everything that changes with it, owned by one worker thread.

`StageCompute` holds the model, its optimizer, the weight stash, the activation cache, gradient accumulation
and, when the stage averages, the StageAverager's local part (which reads and writes the same tensors).
`StageWorker` (swarm/server/worker.py) owns a StageCompute and the single thread that may touch it: the only way in is
`await worker.run(fn)`, which runs `fn(compute)` in that thread, between two requests. So requests never race
on the weights, a state snapshot's parameters and statistics always match, and the event loop stays free.

The counters others read while the worker runs (samples served, optimizer steps, ...) are in `ComputeCounters`,
an object of its own: the worker writes them, anyone may read them (a read may be one request old).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TypeVar

import torch

from swarm.architectures.model import StageModel
from swarm.averaging.averager import StageAverager
from swarm.errors import (
    BadRequestError,
    DuplicateMicrobatchError,
    GradientOverflowError,
    TooLateError,
    UnknownMicrobatchError,
    WrongStageError,
)
from swarm.manifests.manifest import Manifest
from swarm.server.activation_cache import ActivationCache, CachedForward
from swarm.server.offload import OffloadedStatistics
from swarm.server.precision import LossScaler
from swarm.server.staleness import StalenessControl
from swarm.throughput import FORWARD_SHARE, SimulatedSpeed
from swarm.wire.boundary import boundary_width, check_token_tensor, sends_window, split_window
from swarm.wire.messages import StageRequest
from swarm.wire.state import (
    load_state_tensors,
    make_optimizer,
    outer_state_shapes,
    state_tensors,
    trainable_parameters,
)
from swarm.wire.tensors import all_finite
from swarm.wire.validation import check_grad, check_inputs

MAX_LEDGER = 200_000  # forwarded microbatch ids remembered (about 100 bytes each)
REPLY_CACHE_BYTES = 1 << 26  # replies of applied forwarded microbatches kept to answer a repeat (see replay)
STALENESS_WINDOW = 256  # gradients over which the staleness figures are taken
T = TypeVar("T")


@dataclass
class ComputeCounters:
    """Written by the worker thread only; read by anyone (announcements, status lines, metrics, rounds)."""

    samples_served: int = 0
    optimizer_steps: int = 0
    recomputed_forwards: int = 0  # backward passes that had to recompute forward (no usable activations)
    # versions of the weights (optimizer steps, averaging rounds, loaded states) between a microbatch's forward and
    # the weights its gradient was applied to, over the last STALENESS_WINDOW gradients: 0 under a step gate
    staleness_mean: float = 0.0
    staleness_max: int = 0
    averaging_round: int = 0  # number of the stage's next round; travels with the state (see server/rounds.py)


class StageCompute:
    def __init__(
        self,
        manifest: Manifest,
        stage: int,
        model: StageModel,
        device: torch.device,
        simulated: SimulatedSpeed | None = None,
        kept_microbatches: int | None = None,
        offload_optimizer: bool = False,
    ):
        self.manifest, self.stage, self.device = manifest, stage, device
        self.model = model.to(device)
        self.simulated = simulated  # testing aid: emulate a slower device
        self.first, self.last = stage == 0, stage == manifest.num_stages - 1
        named = trainable_parameters(self.model)
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = make_optimizer(manifest, self.params)
        # --offload-optimizer on a GPU: the statistics in RAM between steps (server/offload.py)
        self.offloaded = OffloadedStatistics(self.optimizer, device) if offload_optimizer else None
        self.staleness = StalenessControl(self.optimizer, manifest.training.delay_scaled_lr)
        self.scaler = LossScaler(enabled=manifest.training.precision == "float16")  # server/precision.py
        self.averager: StageAverager | None = None  # attached when the stage averages (server/rounds.py)
        self.counters = ComputeCounters()
        self.weights_version = 0  # bumps whenever the weights change: stashes of older versions are stale
        self.backward_passes = 0  # since the last optimizer step
        self._stash: list[torch.Tensor] = []  # a copy of the current weights that optimizer steps never modify
        self._stash_version = -1
        self._apply_before: float | None = None  # of the request being processed (see process)
        self._cache = ActivationCache(manifest, stage, kept_microbatches)  # forwards kept for their backward
        self._ledger: OrderedDict[str, float] = OrderedDict()  # forwarded microbatches taken: id -> when it expires
        self._replies: OrderedDict[str, list[torch.Tensor]] = OrderedDict()  # applied ones: id -> their reply
        self._reply_bytes = 0
        self._staleness: deque[int] = deque(maxlen=STALENESS_WINDOW)
        self._forward_version = 0  # the version of the weights the gradient being computed comes from

    # ---------------------------------------------------------------------- forwarded microbatches

    def claim(self, microbatch_id: str) -> None:
        """Take a forwarded microbatch on, once: raises DuplicateMicrobatchError if it is in progress here or its
        gradient was applied here (within the microbatch deadline), so no gradient is ever applied twice."""
        now = time.monotonic()
        while self._ledger and (next(iter(self._ledger.values())) < now or len(self._ledger) > MAX_LEDGER):
            self._ledger.popitem(last=False)
        expires = self._ledger.get(microbatch_id)
        if expires is not None and expires >= now:
            raise DuplicateMicrobatchError(f"microbatch {microbatch_id} is in progress or applied here already")
        self._ledger[microbatch_id] = now + 2 * self.manifest.training.timeouts.microbatch

    def settle(self, microbatch_id: str, applied: bool, caller: str, reply: list[torch.Tensor] | None = None) -> None:
        """A claimed microbatch is done: if its gradient was not applied, it may come again (a retry); if it was,
        its `reply` is kept for a repeat (replay). Its cached forward, if any, is dropped."""
        if not applied:
            self._ledger.pop(microbatch_id, None)
        elif reply is not None:
            self._replies[microbatch_id] = reply
            self._reply_bytes += sum(t.numel() * t.element_size() for t in reply)
            while self._reply_bytes > REPLY_CACHE_BYTES and self._replies:
                _, old = self._replies.popitem(last=False)
                self._reply_bytes -= sum(t.numel() * t.element_size() for t in old)
        self._cache.drop((caller, microbatch_id))

    def replay(self, microbatch_id: str) -> list[torch.Tensor] | None:
        """The reply of a forwarded microbatch applied here already, for a repeat of it: its caller died before the
        reply reached it, and another peer of that stage sends it again. The repeat gets the same reply and
        nothing is applied again (the gradient it carries was computed from the first caller's activations, which
        a replica's differ from only by how far replicas drift apart)."""
        if microbatch_id not in self._ledger:
            self._replies.pop(microbatch_id, None)
            return None
        return self._replies.get(microbatch_id)

    # ----------------------------------------------------------------------------------- requests

    def process(
        self, kind: str, req: StageRequest, caller: str, apply_before: float | None = None
    ) -> list[torch.Tensor]:
        """Forward or backward of one decoded request; raises BadRequestError, WrongStageError or
        UnknownMicrobatchError for requests it cannot serve (nothing changes then). With `apply_before` (a
        time.monotonic() moment), gradients are applied only before then; after it, TooLateError."""
        if req.stage != self.stage:
            raise WrongStageError(f"this peer serves stage {self.stage} now, not stage {req.stage}")
        self._cache.drop_older_than(self.manifest.training.timeouts.microbatch)  # their trainers gave up on them
        self._apply_before = apply_before
        begin = time.perf_counter()
        outputs = self._forward(req, caller) if kind == "forward" else self._backward(req, caller)
        if self.simulated is not None:
            full = kind == "forward" and self.last and req.train  # the last stage runs backward too
            share = 1.0 if full else FORWARD_SHARE if kind == "forward" else 1.0 - FORWARD_SHARE
            self.simulated.pad(begin, req.tensors[0].shape[0], share)
        return outputs

    def _forward(self, req: StageRequest, caller: str) -> list[torch.Tensor]:
        window = sends_window(self.manifest) and not self.first
        expected = 2 if self.last or window else 1
        if len(req.tensors) != expected:
            what = "[inputs, window]" if window else "[inputs, targets]" if self.last else "[inputs]"
            raise BadRequestError(f"forward of stage {self.stage} takes {what}, got {len(req.tensors)} tensors")
        inputs = req.tensors[0]
        check_inputs(inputs, self.manifest, self.stage)
        if expected == 2:
            check_token_tensor(self.manifest, req.tensors[1], inputs)
        tokens, targets = self._tokens(req.tensors[1] if expected == 2 else None)
        x = inputs.to(self.device)

        if not req.train:
            with torch.no_grad():
                out = self.model(x, tokens)
                if self.last:
                    return [StageModel.loss(out, targets).float().cpu()]
                return [out.float().cpu()]

        if not self.first:
            x.requires_grad_(True)
        if self.last:  # the last stage runs backward at once and returns the gradient of its inputs
            self._forward_version = self.weights_version
            loss = self.model.forward_loss(x, targets, tokens)
            grads = self._gradients(loss, x, None, self.params)
            self.counters.samples_served += inputs.shape[0]
            result = [loss.detach().float().cpu()]
            return result if self.first else result + [grads.cpu()]
        weights = self._stashed_weights()
        out = self._run(x, weights, tokens)
        self._remember(caller, req.microbatch_id, x, out, weights)
        return [out.detach().float().cpu()]

    def _tokens(self, tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(tokens this stage's model takes, targets) from a request's token tensor (swarm/wire/boundary.py)."""
        if tensor is None:
            return None, None
        tensor = tensor.to(self.device)
        if not sends_window(self.manifest):
            return None, tensor
        tokens, targets = split_window(tensor)
        return (None if self.first else tokens), targets

    def _backward(self, req: StageRequest, caller: str) -> list[torch.Tensor]:
        if self.last:
            raise BadRequestError("the last stage runs backward within forward; do not send it backward")
        window = sends_window(self.manifest) and not self.first
        recompute = 3 if window else 2
        if len(req.tensors) not in (1, recompute):
            what = "[grad_outputs, inputs, window]" if window else "[grad_outputs, inputs]"
            raise BadRequestError(f"backward takes [grad_outputs] or {what}, got {len(req.tensors)} tensors")
        grad = req.tensors[0]
        key = (caller, req.microbatch_id)
        cached = self._cache.get(key)
        if cached is not None:
            check_grad(grad, tuple(cached.outputs.shape))  # a bad gradient leaves the activations cached
            self._cache.drop(key)
            x, out, weights = cached.inputs, cached.outputs, cached.weights
            self.staleness.observed_delay(self.counters.optimizer_steps - cached.steps)
            self._forward_version = cached.version
        else:
            # No activations here (evicted, or this peer did not run the microbatch's forward, e.g. because that
            # peer failed): recompute forward with the current weights from the inputs sent along.
            if len(req.tensors) != recompute:
                raise UnknownMicrobatchError(
                    f"no forward of microbatch {req.microbatch_id} is cached here; resend backward with its inputs"
                )
            inputs = req.tensors[1]
            check_inputs(inputs, self.manifest, self.stage)
            if window:
                check_token_tensor(self.manifest, req.tensors[2], inputs)
            tokens, _ = self._tokens(req.tensors[2] if window else None)
            batch, length = inputs.shape[:2]
            check_grad(grad, (batch, length, boundary_width(self.manifest)))
            self.counters.recomputed_forwards += 1
            self._forward_version = self.weights_version
            x = inputs.to(self.device)
            if not self.first:
                x.requires_grad_(True)
            weights = self._stashed_weights()
            out = self._run(x, weights, tokens)
        grad_inputs = self._gradients(out, x, grad.to(self.device), weights)
        self.counters.samples_served += x.shape[0]
        return [] if self.first else [grad_inputs.cpu()]

    def _stashed_weights(self) -> list[torch.Tensor]:
        """The current weights, as tensors that later optimizer steps leave alone (weight stashing).

        Forward runs with these and keeps them in its graph, so its backward computes exact gradients even if
        optimizer steps happened in between, instead of recomputing forward. One copy per weights version.
        """
        if self._stash_version != self.weights_version:
            self._stash = [p.detach().clone().requires_grad_(True) for p in self.params]
            self._stash_version = self.weights_version
        return self._stash

    def _run(self, x: torch.Tensor, weights: list[torch.Tensor], tokens: torch.Tensor | None) -> torch.Tensor:
        return torch.func.functional_call(self.model, dict(zip(self.param_names, weights)), (x, tokens))

    def _gradients(
        self, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor | None, weights: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """Gradients of the stage's parameters (accumulated) and of its input (returned).

        Gradients are computed into new tensors and checked before they touch the accumulators, so a request
        that produces NaN or Inf never changes the weights. A float16 stage scales what it backpropagates and
        unscales the gradients (server/precision.py); an overflow then is the scale's fault, not the caller's.
        """
        wrt = list(weights) + ([] if self.first else [x])
        scale = self.scaler.scale
        if scale != 1.0:
            out, grad_out = (out * scale, None) if grad_out is None else (out, grad_out * scale)
        grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
        if scale != 1.0:
            grads = tuple(None if g is None else g.float() / scale for g in grads)
        if not all(g is None or all_finite(g) for g in grads):
            if self.scaler.enabled and scale > self.scaler.minimum:  # at the floor: the request's fault
                self.scaler.overflowed()
                raise GradientOverflowError(
                    f"float16 gradients overflowed at loss scale {scale:g}; not applied, the scale is now "
                    f"{self.scaler.scale:g}"
                )
            raise BadRequestError("the request produced non-finite gradients; it was not applied")
        self.scaler.succeeded()
        if self._apply_before is not None and time.monotonic() > self._apply_before:
            raise TooLateError("the microbatch's deadline at this hop passed before its gradient was applied")
        share = 1.0 / self.manifest.training.microbatches_per_step
        for param, g in zip(self.params, grads[: len(self.params)]):
            if g is None:
                continue
            if param.grad is None:
                param.grad = g * share
            else:
                param.grad.add_(g, alpha=share)
        self._observe_staleness(self.weights_version - self._forward_version)
        self.backward_passes += 1
        if self.backward_passes >= self.manifest.training.microbatches_per_step:
            self.optimizer_step()
        return None if self.first else grads[-1].float()

    def _observe_staleness(self, versions: int) -> None:
        self._staleness.append(versions)
        self.counters.staleness_mean = sum(self._staleness) / len(self._staleness)
        self.counters.staleness_max = max(self._staleness)

    def optimizer_step(self) -> None:
        try:
            if self.manifest.training.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.manifest.training.max_grad_norm)
            self.staleness.before_step()  # a smaller rate for late gradients (server/staleness.py)
            if self.offloaded is not None:
                self.offloaded.step()
            else:
                self.optimizer.step()
            self.counters.optimizer_steps += 1
        finally:  # even if the step failed: one bad step must not make every later backward fail again
            self.optimizer.zero_grad(set_to_none=True)
            self.backward_passes = 0
            self.weights_version += 1

    def _remember(
        self, caller: str, microbatch_id: str, x: torch.Tensor, out: torch.Tensor, weights: list[torch.Tensor]
    ) -> None:
        forward = CachedForward(x, out, weights, time.monotonic(), self.counters.optimizer_steps, self.weights_version)
        self._cache.remember((caller, microbatch_id), forward)

    @property
    def kept_microbatches(self) -> int:
        """How many forwards' activations are kept for their backward (the window; server/shedding.py)."""
        return self._cache.limit

    def keep_fewer_forwards(self, limit: int) -> None:
        """Out of memory (server/shedding.py): keep at most `limit` forwards' activations from now on, and drop the
        oldest beyond it now (their backward recomputes forward from the inputs it carries)."""
        self._cache.keep_at_most(limit)

    def drop_device_copies(self) -> None:
        """Pausing (server/parking.py): drop every kept forward and the stash of the weights (both on the device)."""
        self._cache.clear()
        self._stash, self._stash_version = [], -1

    def forget_forwards(self, keys: list[tuple[str, str]]) -> None:
        """Drop the cached forwards of these (caller, microbatch id)s: their step gate slots were given up."""
        for key in keys:
            self._cache.drop(key)

    # -------------------------------------------------------------------------------------- state

    def snapshot(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, int]]:
        """The stage's state as named CPU tensors (layout: swarm/wire/state.py), and its counters."""
        items = state_tensors(self.param_names, self.params, self.optimizer)
        if self.averager is not None:
            items += self.averager.outer_state()
        counters = {"optimizer_steps": self.counters.optimizer_steps, "averaging_round": self.counters.averaging_round}
        return items, counters

    def _checked_outer_state(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The DiLoCo outer state among downloaded `items`; BadRequestError if any of it does not fit."""
        outer = {name: tensor for name, tensor in items if name.startswith("outer/")}
        shapes = outer_state_shapes(self.manifest, {n: tuple(p.shape) for n, p in zip(self.param_names, self.params)})
        for name, tensor in outer.items():
            if name not in shapes:
                raise BadRequestError(f"the state holds {name[:200]!r}, which this stage does not have")
            if tuple(tensor.shape) != shapes[name] or tensor.dtype != torch.float32 or not all_finite(tensor):
                raise BadRequestError(f"state tensor {name!r} is not a finite float32 tensor of {list(shapes[name])}")
        return outer

    def rebase(self, items: list[tuple[str, torch.Tensor]], counters: dict[str, int]) -> None:
        """DiLoCo, one round behind: take the stage's anchor, outer momentum and round number from a peer's state
        and keep this peer's own local progress and inner optimizer (swarm/averaging/averager.py, StageAverager.rebase).
        Raises BadRequestError, leaving everything untouched, if the state has no complete outer state."""
        outer = self._checked_outer_state(items)
        names = outer_state_shapes(self.manifest, {n: tuple(p.shape) for n, p in zip(self.param_names, self.params)})
        if self.averager is None or not self.averager.diloco or outer.keys() != names.keys():
            raise BadRequestError("the state holds no complete DiLoCo outer state to rebase on")
        self.averager.rebase(outer)
        self.counters.averaging_round = counters.get("averaging_round", 0)
        self.weights_version += 1

    def load_state(self, items: list[tuple[str, torch.Tensor]], counters: dict[str, int]) -> None:
        """Take over a stage's state downloaded from another peer or read from a checkpoint. Raises
        BadRequestError, leaving everything untouched, if the state does not fit."""
        outer = self._checked_outer_state(items)
        load_state_tensors(
            [item for item in items if item[0] not in outer], self.param_names, self.params, self.optimizer
        )
        if self.averager is not None:
            self.averager.load_outer_state(outer)
        if self.offloaded is not None:
            self.offloaded.offload()  # load_state_tensors put the statistics on the device
        self.counters.optimizer_steps = counters.get("optimizer_steps", 0)
        self.counters.averaging_round = counters.get("averaging_round", 0)
        self.weights_version += 1

    # ---------------------------------------------------------------------------------- averaging

    def attach_averager(self, averager: StageAverager) -> None:
        """The stage averages: its rounds read and write these tensors, and its outer state is part of the state."""
        self.averager = averager

    def begin_round(self) -> None:
        assert self.averager is not None
        self.averager.begin_round()

    def finish_round(self, averaged: bool, alone: bool) -> None:
        """Apply a round (raises AveragingError if its result is refused); forwards from now on use the new
        weights."""
        assert self.averager is not None
        if self.averager.finish_round(averaged, alone):
            self.weights_version += 1

    def set_round(self, number: int) -> None:
        """The number of the stage's next round (it travels with the state, so it changes in this thread)."""
        self.counters.averaging_round = number
