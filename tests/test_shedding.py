"""Out of memory while serving (swarm/server/shedding.py): which errors are one, the policy (a smaller window of
kept microbatches, then a shorter span, else busy), and a served stage's request path applying it: the request that
ran out is answered busy, the kept activations beyond the new window are dropped (their backward recomputes), the
stage reports it as an event and goes on serving. The peer process that survives a real one: test_out_of_memory.py.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.events import Event, EventKind
from swarm.manifests.validation import manifest_from_dict
from swarm.server.compute import StageCompute
from swarm.server.shedding import (
    FLOOR_REPEATS,
    FLOOR_SECONDS,
    MIN_KEPT,
    ShedAction,
    describe,
    is_out_of_memory,
    shed,
)
from swarm.server.stage import StageServer
from swarm.throughput import Throughput
from swarm.wire.messages import StageRequest

IMPOSSIBLE = 1 << 50  # bytes: no allocator of this machine has them, so asking for them fails for real


def allocator_error() -> RuntimeError:
    """What torch's CPU allocator really raises when memory runs out."""
    try:
        torch.empty(IMPOSSIBLE, dtype=torch.uint8)
    except RuntimeError as error:
        return error
    raise AssertionError("the allocation was expected to fail")


# ------------------------------------------------------------------------------------------- the policy


def test_each_out_of_memory_halves_the_window_down_to_the_smallest():
    kept, floor, seen = 13, (), []
    while kept > MIN_KEPT:
        decision = shed(kept, floor, now=100.0, can_shorten=True)
        assert decision.action == ShedAction.SMALLER_WINDOW and decision.floor_times == ()
        kept, floor = decision.kept, decision.floor_times
        seen.append(kept)
    assert seen == [6, 3, 1]


def test_repeats_at_the_smallest_window_shorten_the_span_or_answer_busy():
    floor, actions = (), []
    for moment in range(FLOOR_REPEATS):
        decision = shed(MIN_KEPT, floor, now=10.0 + moment, can_shorten=True)
        actions.append(decision.action)
        floor = decision.floor_times
        assert decision.kept == MIN_KEPT
    assert actions == [ShedAction.BUSY] * (FLOOR_REPEATS - 1) + [ShedAction.SHORTER_SPAN]
    assert floor == ()  # the shorter span counts afresh
    # one stage served (or a shortening under way): nothing more to shed, ever busy, the count bounded
    floor = ()
    for moment in range(2 * FLOOR_REPEATS):
        decision = shed(MIN_KEPT, floor, now=10.0 + moment, can_shorten=False)
        assert decision.action == ShedAction.BUSY
        floor = decision.floor_times
    assert len(floor) == FLOOR_REPEATS


def test_out_of_memory_errors_far_apart_do_not_add_up():
    floor = ()
    for moment in range(2 * FLOOR_REPEATS):  # one a little more often than every FLOOR_SECONDS / (REPEATS - 1)
        decision = shed(MIN_KEPT, floor, now=moment * FLOOR_SECONDS / (FLOOR_REPEATS - 1), can_shorten=True)
        assert decision.action == ShedAction.BUSY
        floor = decision.floor_times


def test_what_counts_as_out_of_memory():
    real = allocator_error()
    assert "DefaultCPUAllocator: can't allocate memory" in str(real)
    assert is_out_of_memory(real)
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
    try:  # an error raised from one still is one
        raise ValueError("the forward failed") from real
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ZeroDivisionError("a bug"))
    line = describe(real)
    assert line.startswith("RuntimeError: ") and "\n" not in line and len(line) <= 300


# ------------------------------------------------------------------------------- a served stage applying it


def hidden_forward(compute: StageCompute, name: str) -> None:
    tokens = torch.randint(0, compute.manifest.model.vocab_size, (2, compute.manifest.model.context_length))
    compute.process("forward", StageRequest(0, name, True, [tokens]), "trainer")


def test_a_stage_that_runs_out_answers_busy_sheds_its_window_reports_it_and_serves_on():
    manifest = manifest_from_dict(tiny_manifest_dict())
    events: list[Event] = []
    server = StageServer(
        manifest,
        0,
        build_stage(manifest, 0),
        torch.device("cpu"),
        "me",
        Throughput(10.0, 10.0),
        on_event=events.append,
        kept_microbatches=8,
    )
    shortenings: list[int] = []
    path = server.requests
    ran_out = 0

    def run_out(compute: StageCompute) -> None:
        nonlocal ran_out
        ran_out += 1
        hidden_forward(compute, f"late-{ran_out}")  # its activations are kept, then memory runs out
        torch.empty(IMPOSSIBLE, dtype=torch.uint8)

    async def main() -> None:
        for k in range(6):  # six forwards in flight: their activations kept for their backward
            await path.run("forward", "trainer", lambda compute, k=k: hidden_forward(compute, f"m{k}"))
        reply = await path.run("forward", "trainer", run_out)
        meta = msgpack.unpackb(reply.metadata)
        assert meta["code"] == "busy" and "ran out of memory" in meta["error"]
        assert await server.worker.run(lambda compute: compute.kept_microbatches) == 4  # half the window
        assert path.out_of_memory == 1 and server.admission.pending == 0
        assert events[-1].kind == EventKind.OUT_OF_MEMORY
        fields = events[-1].fields
        assert fields["action"] == "smaller_window" and fields["kept_microbatches"] == 4
        assert fields["stage"] == 0 and fields["out_of_memory"] == 1 and "can't allocate memory" in fields["error"]
        # the stage serves on: the oldest forwards beyond the window were dropped at once, and their backward
        # recomputes forward from the inputs sent along; the newest kept theirs
        tokens = torch.randint(0, manifest.model.vocab_size, (2, manifest.model.context_length))
        grad = torch.randn(2, manifest.model.context_length, manifest.model.width)

        def backward(name: str):
            request = StageRequest(0, name, True, [grad, tokens])
            return path.run("backward", "trainer", lambda compute: compute.process("backward", request, "trainer"))

        assert await backward("m0") == [] and await backward("m1") == []
        assert server.worker.counters.recomputed_forwards == 2
        assert await backward("m5") == [] and server.worker.counters.recomputed_forwards == 2
        # down to the smallest window, then repeats: busy while the peer serves one stage ...
        for _ in range(2 + FLOOR_REPEATS):
            await path.run("forward", "trainer", run_out)
        assert [e.fields["kept_microbatches"] for e in events] == [4, 2, 1, 1, 1, 1]
        assert [e.fields["action"] for e in events[-FLOOR_REPEATS:]] == ["busy"] * FLOOR_REPEATS
        # ... and a shorter span once it serves several (the rebalancer's hook, here a list): at once, as the
        # repeats within the last minute are there already; then they count afresh
        server.shorten_span = lambda: shortenings.append(server.stage) or True
        for _ in range(FLOOR_REPEATS):
            await path.run("forward", "trainer", run_out)
        actions = [e.fields["action"] for e in events[-FLOOR_REPEATS:]]
        assert actions == ["shorter_span"] + ["busy"] * (FLOOR_REPEATS - 1) and shortenings == [0]
        server.shorten_span = lambda: False  # a shortening under way already: reported as busy
        await path.run("forward", "trainer", run_out)
        assert events[-1].fields["action"] == "busy" and shortenings == [0]
        assert path.out_of_memory == 6 + FLOOR_REPEATS + 1
        assert await path.run("forward", "trainer", lambda compute: compute.stage) == 0

    try:
        asyncio.run(main())
    finally:
        asyncio.run(server.worker.finish(timeout=5.0))


@pytest.mark.parametrize("error", [ZeroDivisionError("a bug"), RuntimeError("mat1 and mat2 shapes")])
def test_other_errors_shed_nothing(error):
    manifest = manifest_from_dict(tiny_manifest_dict())
    server = StageServer(
        manifest, 0, build_stage(manifest, 0), torch.device("cpu"), "me", Throughput(1.0, 1.0), kept_microbatches=8
    )

    def fail(compute: StageCompute) -> None:
        raise error

    async def main() -> None:
        reply = await server.requests.run("forward", "trainer", fail)
        assert msgpack.unpackb(reply.metadata)["code"] == "internal"
        assert await server.worker.run(lambda compute: compute.kept_microbatches) == 8
        assert server.requests.out_of_memory == 0

    try:
        asyncio.run(main())
    finally:
        asyncio.run(server.worker.finish(timeout=5.0))


def test_the_last_stage_has_no_window_to_shed():
    """Its backward follows its forward at once, so it keeps no activations: what runs out there goes straight to
    the repeats that shorten a span (or to busy)."""
    manifest = manifest_from_dict(tiny_manifest_dict())
    events: list[Event] = []
    server = StageServer(
        manifest, 1, build_stage(manifest, 1), torch.device("cpu"), "me", Throughput(1.0, 1.0), on_event=events.append
    )

    def run_out(compute: StageCompute) -> None:
        torch.empty(IMPOSSIBLE, dtype=torch.uint8)

    async def main() -> None:
        for _ in range(FLOOR_REPEATS):
            reply = await server.requests.run("forward", "trainer", run_out)
            assert msgpack.unpackb(reply.metadata)["code"] == "busy"
        assert [(e.fields["action"], e.fields["kept_microbatches"]) for e in events] == [("busy", 1)] * FLOOR_REPEATS

    try:
        asyncio.run(main())
    finally:
        asyncio.run(server.worker.finish(timeout=5.0))


def test_swarm_peer_prints_the_event_as_a_sentence(capsys):
    from peers.peer_output import print_event

    fields = {"stage": 1, "action": "smaller_window", "kept_microbatches": 4, "out_of_memory": 2, "error": "E: x"}
    print_event(Event(EventKind.OUT_OF_MEMORY, fields), as_json=False)
    line = capsys.readouterr().out.strip()
    assert line.startswith("stage 1 ran out of memory (E: x); answered busy") and "keeps 4 microbatches'" in line
