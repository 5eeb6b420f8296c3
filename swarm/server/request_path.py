"""The one path of a request into a served stage: admission, a request slot, the work in the worker, the slot's
release, and the error reply for whatever stopped it.

Both kinds of stage work go through it: forward and backward calls (swarm/server/service.py) and the hops of a
forwarded microbatch (swarm/server/forwarding.py). A request first gets a prompt refusal instead of work if its
sender is banned or this peer cannot take it now (swarm/server/admission.py). Taken, it holds one of its
sender's request slots until its work in the worker is done, even if the caller has given up meanwhile: a
cancelled call still occupies the worker until its turn has passed, and the slots say how loaded the worker
is. An exception the work raises becomes the reply, with the code the one map of swarm/wire/codes.py gives it;
a bad request also counts against its sender (who is banned if it keeps sending them). An out-of-memory error is
no bug of the request's: the stage sheds what server/shedding.py says, in the worker before its next request, and
answers `busy` (the hop before tries another peer of the stage); `on_out_of_memory` reports it.

Work that will produce a gradient here first takes a slot of the stage's step gate (swarm/server/step_gate.py,
when `training.pipelining` is `flush`): it may wait there for the stage's next optimizer step, holding one of its
sender's request slots meanwhile, so a flood still meets admission's limits.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.proto import runtime_pb2

from swarm.dht.records import PeerState
from swarm.errors import StageStoppedError
from swarm.server.admission import Admission
from swarm.server.compute import StageCompute
from swarm.server.shedding import MIN_KEPT, Shedding, describe, is_out_of_memory, shed
from swarm.server.step_gate import Key, StepGate
from swarm.server.worker import StageWorker
from swarm.wire.codes import ErrorCode, code_of
from swarm.wire.messages import make_error_reply

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Failed:
    """What stopped a request's work in the worker (handed back to the event loop, which answers it)."""

    error: Exception


@dataclass
class _OutOfMemory:
    """A request's work ran out of memory: the error, in a line (the error itself, whose traceback holds the failed
    request's tensors, is let go), and what the stage shed about it."""

    message: str
    shedding: Shedding


class RequestPath:
    """Admission and the worker of one served stage, as every request of the stage uses them."""

    def __init__(self, admission: Admission, worker: StageWorker, state: Callable[[], PeerState], step_slots: int = 0):
        """`step_slots`: the step gate's slots (microbatches per step), 0 for none (the stage steps by count)."""
        self.admission, self.worker, self.state = admission, worker, state
        self.errors: collections.Counter[ErrorCode] = collections.Counter()  # error replies to work, by code
        self.gate = StepGate(step_slots, self.forget) if step_slots > 0 else None
        self.out_of_memory = 0  # requests whose work ran out of memory (answered busy)
        # set by the StageServer: whether its peer can drop a stage now (asked in the worker thread), and what to do
        # with each out-of-memory error once answered (on the event loop)
        self.can_shorten: Callable[[], bool] = lambda: False
        self.on_out_of_memory: Callable[[Shedding, str], None] = lambda shedding, message: None
        self._floor_times: tuple[float, ...] = ()  # the worker's: see server/shedding.py

    async def take_gradient_slot(self, caller: str, key: Key, expires: float, wait_until: float, pinned: bool = False):
        """Before work that will produce a gradient here: None once `key` holds a slot of the step gate (at once
        without a gate), or a 'busy' reply if none came free by `wait_until` (time.monotonic()). `pinned`: the
        gradient is applied by the work that starts now (StepGate.pin)."""
        if self.gate is None:
            return None
        self.admission.take_slot(caller)
        try:
            if await self.gate.take(key, expires, wait_until, pinned):
                return None
        finally:
            self.admission.release_slot(caller)
        return self.admission.busy("this stage's step is full and did not finish in time; try another peer")

    def pin_gradient_slot(self, key: Key) -> bool:
        """Before the work that applies `key`'s gradient: whether it may (False: its slot was given up)."""
        return self.gate is None or self.gate.pin(key)

    async def release_gradient_slot(self, key: Key, applied: bool) -> None:
        """`key`'s gradient was applied here (it counts towards the step) or will not be (its slot is free)."""
        if self.gate is not None:
            await self.gate.release(key, applied)

    def forget(self, keys: list[Key]) -> None:
        """Slots given up (their backward never came, or failed): drop their forwards' activations, in the worker,
        before any later request, so that a later backward recomputes at the weights of its own step."""
        try:
            self.worker.submit(lambda compute: compute.forget_forwards(keys))
        except StageStoppedError:
            pass  # a stopped stage keeps no activations

    def refusal(self, caller: str) -> runtime_pb2.ExpertResponse | None:
        """A prompt reply instead of work: the caller is banned, this peer is not online, or it is too busy."""
        return self.admission.refusal(caller, self.state(), self.worker.seconds_per_request)

    async def run(self, kind: str, caller: str, work: Callable[[StageCompute], T]) -> T | runtime_pb2.ExpertResponse:
        """`work(compute)` in the worker under one of the caller's request slots; its result, or the error reply if
        it raised. Call `refusal` first: this takes the slot without asking admission (a hop's backward, after
        its forward was taken on, is never refused)."""
        admission = self.admission
        admission.take_slot(caller)
        try:
            future = self.worker.submit(lambda compute: self._attempt(work, compute))
        except StageStoppedError as e:  # it stopped (a move, a leave) since the request was admitted
            admission.release_slot(caller)
            return self.error_reply(kind, caller, e)
        future.add_done_callback(lambda _: admission.release_slot(caller))
        result = await asyncio.shield(future)
        if isinstance(result, _Failed):
            return self.error_reply(kind, caller, result.error)
        if isinstance(result, _OutOfMemory):
            self.out_of_memory += 1
            self.on_out_of_memory(result.shedding, result.message)
            return admission.busy(f"this peer ran out of memory ({result.message}); try another peer")
        return result

    def error_reply(self, kind: str, caller: str, error: Exception) -> runtime_pb2.ExpertResponse:
        """The reply to a `kind` request from `caller` that `error` stopped, by the error's code."""
        code = code_of(error)
        self.errors[code] += 1
        if code == ErrorCode.BAD_REQUEST:
            logger.info(f"bad {kind} request from {caller[-8:]}: {error}")
            return self.admission.bad_request(caller, str(error))
        if code == ErrorCode.INTERNAL:  # a bug or a device error: report it, keep serving
            logger.error(f"a {kind} request failed", exc_info=error)
            return make_error_reply(f"internal error on the stage peer: {type(error).__name__}: {error}", code)
        return make_error_reply(str(error), code)

    def _attempt(self, work: Callable[[StageCompute], T], compute: StageCompute) -> T | _Failed | _OutOfMemory:
        """In the worker: `work(compute)`, or what stopped it (never raises: one request's failure is its own)."""
        try:
            return work(compute)
        except Exception as error:
            if not is_out_of_memory(error):
                return _Failed(error)
            message = describe(error)
        # out of the except block, the error and its traceback are gone, and with them the tensors of the request
        # that ran out: only now can shedding free memory
        return _OutOfMemory(message, self._shed(compute))

    def _shed(self, compute: StageCompute) -> Shedding:
        """In the worker, before its next request: a smaller window (server/shedding.py), and memory given back."""
        # the last stage keeps no activations (its backward follows its forward at once): no window to shed there
        window = MIN_KEPT if compute.last else compute.kept_microbatches
        shedding = shed(window, self._floor_times, time.monotonic(), self.can_shorten())
        self._floor_times = shedding.floor_times
        compute.keep_fewer_forwards(shedding.kept)
        gc.collect()  # tensors held only by reference cycles (autograd graphs, tracebacks) go now, not some time
        if compute.device.type == "cuda":
            torch.cuda.empty_cache()  # what the allocator caches is free for the next request's allocations
        return shedding
