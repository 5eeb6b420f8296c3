"""The step gate (swarm/server/step_gate.py): a stage hands out `slots` gradient slots per optimizer step and a new
step's slots only once the last step's gradients are all applied, so no gradient is ever applied to weights
newer than the ones its forward ran with."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarm.server.step_gate import MIN_STRAGGLER_S, StepGate


def far() -> float:
    return time.monotonic() + 60


async def take_later(gate: StepGate, key: str, wait: float = 5.0) -> bool:
    return await gate.take(("trainer", key), far(), time.monotonic() + wait)


def test_a_full_step_holds_new_microbatches_until_its_gradients_are_applied():
    async def scenario() -> None:
        gate = StepGate(slots=3)
        for key in "abc":
            assert await take_later(gate, key)
        waiter = asyncio.create_task(take_later(gate, "d"))
        await asyncio.sleep(0.05)
        assert not waiter.done() and gate.waiting == 1  # the step is full: d waits
        await gate.release(("trainer", "a"), applied=True)
        await gate.release(("trainer", "b"), applied=True)
        await asyncio.sleep(0.05)
        assert not waiter.done() and gate.version == 0  # c is still out: stepping now would make it stale
        await gate.release(("trainer", "c"), applied=True)
        assert await asyncio.wait_for(waiter, 1) is True
        assert gate.version == 1 and gate.open.keys() == {("trainer", "d")} and gate.waited == 1

    asyncio.run(scenario())


def test_a_failed_microbatch_frees_its_slot_without_counting_towards_the_step():
    async def scenario() -> None:
        gate = StepGate(slots=2)
        assert await take_later(gate, "a") and await take_later(gate, "b")
        waiter = asyncio.create_task(take_later(gate, "c"))
        await asyncio.sleep(0.05)
        await gate.release(("trainer", "a"), applied=False)  # e.g. the next stage failed
        assert await asyncio.wait_for(waiter, 1) is True
        assert gate.version == 0 and gate.applied == 0  # a step is always `slots` applied gradients
        await gate.release(("trainer", "b"), applied=True)
        await gate.release(("trainer", "c"), applied=True)
        assert gate.version == 1 and gate.taken == 0

    asyncio.run(scenario())


def test_a_wait_ends_at_its_limit_and_a_key_holds_one_slot():
    async def scenario() -> None:
        gate = StepGate(slots=1)
        assert await take_later(gate, "a")
        assert await take_later(gate, "a")  # a repeat of the same microbatch: the same slot
        begin = time.monotonic()
        assert await take_later(gate, "b", wait=0.2) is False
        assert 0.15 < time.monotonic() - begin < 2 and gate.waiting == 0

    asyncio.run(scenario())


def test_a_slot_whose_backward_never_comes_is_given_up_at_its_expiry():
    async def scenario() -> None:
        given_up: list = []
        gate = StepGate(slots=1, on_expire=given_up.extend)
        assert await gate.take(("dead", "a"), time.monotonic() + 0.2, time.monotonic() + 1)
        assert await take_later(gate, "b")  # waits until a's slot expires, then takes it
        assert given_up == [("dead", "a")] and gate.expired == 1
        await gate.release(("dead", "a"), applied=True)  # too late: ignored, nothing counts twice
        assert gate.applied == 0 and gate.open.keys() == {("trainer", "b")}

    asyncio.run(scenario())


def test_between_steps_waits_for_the_microbatches_in_flight_and_hands_out_no_slot_meanwhile():
    async def scenario() -> None:
        gate = StepGate(slots=4)
        assert await take_later(gate, "a")
        inside: list[bool] = []

        async def round_() -> None:
            async with gate.between_steps(timeout=5) as drained:
                inside.append(drained)
                await asyncio.sleep(0.1)
                inside.append(gate.can_take())

        averaging = asyncio.create_task(round_())
        await asyncio.sleep(0.05)
        newcomer = asyncio.create_task(take_later(gate, "b"))
        await asyncio.sleep(0.05)
        assert not inside and not newcomer.done()  # a is in flight: the round waits, and b with it
        await gate.release(("trainer", "a"), applied=True)
        await asyncio.wait_for(averaging, 2)
        assert inside == [True, False]  # applied between two microbatches, no slot handed out meanwhile
        assert await asyncio.wait_for(newcomer, 1) is True

    asyncio.run(scenario())


def test_a_gate_needs_a_slot():
    with pytest.raises(ValueError):
        StepGate(slots=0)


def test_a_straggler_gives_its_slot_to_a_waiting_microbatch_but_a_pinned_slot_is_kept():
    """A microbatch stuck behind a stalled later peer must not hold the step until its timeout while others wait;
    but once its gradient is being applied (pinned) its slot is never given up, or the worker (which steps by
    count) and the gate would disagree on the step."""

    async def scenario() -> None:
        given_up: list = []
        gate = StepGate(slots=3, on_expire=given_up.extend)
        assert await take_later(gate, "quick")
        await asyncio.sleep(0.05)
        await gate.release(("trainer", "quick"), applied=True)  # a typical hold: 50 ms
        assert gate.typical_hold is not None and gate.typical_hold < 0.5
        assert await take_later(gate, "stuck") and await take_later(gate, "applying")
        assert gate.pin(("trainer", "applying"))
        await asyncio.sleep(MIN_STRAGGLER_S + 0.1)  # nobody waits yet: both keep their slots
        assert gate.open.keys() == {("trainer", "stuck"), ("trainer", "applying")}
        begin = time.monotonic()
        assert await take_later(gate, "next", wait=5)  # takes the straggler's slot at once
        assert time.monotonic() - begin < 0.5
        assert given_up == [("trainer", "stuck")] and gate.stragglers == gate.expired == 1
        assert not gate.pin(("trainer", "stuck"))  # its late gradient must not be applied
        await gate.release(("trainer", "applying"), applied=True)
        await gate.release(("trainer", "next"), applied=True)
        assert gate.version == 1 and gate.taken == 0

    asyncio.run(scenario())


def test_a_pinned_slot_outlives_its_expiry():
    async def scenario() -> None:
        gate = StepGate(slots=1)
        assert await gate.take(("trainer", "a"), time.monotonic() + 0.1, time.monotonic() + 1, pinned=True)
        assert await take_later(gate, "b", wait=0.4) is False  # a's gradient is being applied: b must wait
        assert gate.expired == 0
        await gate.release(("trainer", "a"), applied=True)
        assert gate.version == 1 and await take_later(gate, "b")

    asyncio.run(scenario())


def test_a_trainer_with_a_large_window_cannot_crowd_out_one_with_a_small():
    """Waiting microbatches are served by their trainers' recent shares of slots, not in arrival order: a greedy
    trainer that queues 6 microbatches before a polite one queues 1 still gets only every other slot."""

    async def scenario() -> None:
        gate = StepGate(slots=1)
        order: list[str] = []

        async def microbatch(caller: str, name: str) -> None:
            assert await gate.take((caller, name), far(), time.monotonic() + 10)
            order.append(caller)

        assert await gate.take(("greedy", "g0"), far(), time.monotonic() + 1)
        tasks = [asyncio.create_task(microbatch("greedy", f"g{i}")) for i in range(1, 7)]
        await asyncio.sleep(0.05)
        tasks += [asyncio.create_task(microbatch("polite", f"p{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        assert gate.waiting == 9
        held = ("greedy", "g0")
        for _ in range(9):  # each step has one slot: apply the holder's gradient, the next in turn takes the slot
            await gate.release(held, applied=True)
            await asyncio.sleep(0.02)
            (held,) = gate.open
        await asyncio.gather(*tasks)
        assert order[:6] == ["polite", "greedy"] * 3, order  # polite came last but is served every other slot

    asyncio.run(scenario())
