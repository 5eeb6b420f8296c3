"""The one thread that may touch a served stage's model: `await worker.run(fn)` runs `fn(compute)` there, between
two requests (see swarm/server/compute.py for why)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from swarm.errors import StageStoppedError
from swarm.server.compute import StageCompute

T = TypeVar("T")


class StageWorker:
    """The one thread that touches a StageCompute. Every access goes through `run`."""

    def __init__(self, compute: StageCompute):
        self._compute = compute
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{compute.stage}")
        self.counters = compute.counters  # readable by anyone; written by the worker only
        self.seconds_per_request = 0.0  # EMA of the worker's time per request (0 until the first one)
        self._used = False
        self._finished = False

    @property
    def kept_microbatches(self) -> int:
        """How many forwards' activations the compute keeps now (an int: a read from another thread is safe)."""
        return self._compute.kept_microbatches

    def before_first_task(self, fn: Callable[[StageCompute], T]) -> T:
        """`fn(compute)` here and now, allowed only before the worker has been given any task (nothing can race
        then). For what must happen on the main thread: creating a hivemind averager forks a process."""
        if self._used:
            raise RuntimeError("the stage's worker has started: reach the compute through run()")
        return fn(self._compute)

    async def run(self, fn: Callable[[StageCompute], T]) -> T:
        """`fn(compute)` in the worker thread, after the work queued before it. StageStoppedError once the stage
        has stopped (`finish`)."""
        return await self._queue(fn, self._compute)

    def submit(self, fn: Callable[[StageCompute], T]) -> asyncio.Future[T]:
        """Like `run`, timed as a request, and returns the future at once (a request's slot is freed when the
        work is done, not when its caller gives up). StageStoppedError once the stage has stopped."""
        return self._queue(self._timed, fn, self._compute)

    def _queue(self, *call) -> asyncio.Future:
        self._used = True
        stopped = f"stage {self._compute.stage} has stopped on this peer; try another peer"
        if self._finished:
            raise StageStoppedError(stopped)
        try:
            return asyncio.get_running_loop().run_in_executor(self._executor, *call)
        except RuntimeError:  # the executor shut down meanwhile (cannot schedule new futures after shutdown)
            raise StageStoppedError(stopped) from None

    def _timed(self, fn: Callable[[StageCompute], T], compute: StageCompute) -> T:
        started = time.perf_counter()
        try:
            return fn(compute)
        finally:
            took = time.perf_counter() - started
            previous = self.seconds_per_request
            self.seconds_per_request = took if previous == 0 else 0.9 * previous + 0.1 * took

    @property
    def finished(self) -> bool:
        """Whether finish() was called: no more work is taken (the stage stopped)."""
        return self._finished

    async def finish(self, timeout: float) -> bool:
        """Wait, up to `timeout`, for the work in flight; False (and the rest dropped) if it did not finish."""
        self._finished = True
        try:
            finish = asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
            await asyncio.wait_for(finish, timeout=timeout)
            return True
        except TimeoutError:
            self._executor.shutdown(wait=False, cancel_futures=True)
            return False

    def after_shutdown(self) -> StageCompute:
        """The compute, once `finish` returned True: no thread touches it any more."""
        return self._compute
