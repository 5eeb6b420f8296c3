"""The owner comes first: a running peer pauses on SIGUSR1 (drains, parks its state in RAM, stays in the swarm) and
resumes on SIGUSR2 (catches up with its stage, serves again), and no microbatch fails because of it."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import tiny_manifest_dict, wait_until

pytestmark = pytest.mark.integration


def last(peer) -> dict:
    return peer.status_lines()[-1]


def after(peer, mark: int, accept, timeout: float, what: str) -> dict:
    """The first JSON line of `peer` printed after its `mark`-th (len(peer.json_lines()) then) that `accept`s."""
    return wait_until(lambda: next((j for j in peer.json_lines()[mark:] if accept(j)), None), timeout, what)


def trained(trainer) -> int:
    lines = trainer.status_lines()
    return (lines[-1].get("trainer_samples") or 0) if lines else 0


@pytest.mark.slow(60)
def test_a_paused_peer_drains_keeps_its_state_and_catches_up_when_it_resumes(start_peer, write_manifest):
    raw = tiny_manifest_dict()
    status = ("--status-every", "1")
    first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", *status)
    raw["initial_peers"] = [first.maddr()]
    path = write_manifest(raw, "joined.json")
    replicas = [start_peer(path, "--stage", "1", "--no-trainer", *status) for _ in range(2)]
    for peer in (first, *replicas):
        peer.wait_for("serving stage", timeout=90)
    trainer = start_peer(path, "--trainer-only", *status)
    trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) >= 80, timeout=120, what="training")

    # 1. one of stage 1's two peers pauses: it drains and parks; the other takes the stage's microbatches
    paused = replicas[0]
    signalled = time.monotonic()
    paused.process.send_signal(signal.SIGUSR1)
    # it says at once that it drains, and what it waits for; then how long the whole pause took
    pausing = paused.wait_for_event("pausing", 30)  # (its event loop may be seconds late on a loaded machine)
    assert pausing["stages"] == [1] and pausing["in_flight"] >= 0 and pausing["trainer_in_flight"] == 0, pausing
    event = paused.wait_for_event("paused", 60)
    assert event["stages"] == [1] and event["seconds"] < 30 and event["device_bytes_freed"] == 0, event  # a CPU
    assert event["seconds"] <= time.monotonic() - signalled and event["at"] >= pausing["at"]
    line = paused.wait_for_json(lambda line: line.get("state") == "paused", 30, "announced paused")
    served = line["samples_served"]
    before = trained(trainer)
    # 10 microbatches: were the paused peer still taking its share, it would have served some of them
    trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) >= before + 80, 60, "training on")
    assert last(paused)["samples_served"] == served  # it took no microbatch while paused
    assert last(paused)["state"] == "paused" and paused.process.poll() is None  # still there
    # the routes may have sent most microbatches to the paused peer before: the other one must go further now
    other, own_steps = replicas[1], last(paused)["optimizer_steps"]
    other.wait_for_json(lambda s: s.get("optimizer_steps", 0) > own_steps, 60, "the other replica to go further")

    # 2. it resumes: the other replica went further meanwhile, so it takes that state, and serves again
    mark = len(paused.json_lines())
    paused.process.send_signal(signal.SIGUSR2)
    event = paused.wait_for_event("resumed", 60)
    assert event["sources"] == ["peer"] and event["seconds"] < 30, event
    after(paused, mark, lambda line: line.get("state") == "online", 30, "online again")
    after(paused, mark, lambda line: line.get("samples_served", 0) > served, 90, "serving again")

    # 3. stage 0's only peer pauses: training waits (nothing fails), and on resuming nobody went further, so it
    # keeps the state it parked (no trained progress lost)
    steps = last(first)["optimizer_steps"]
    first.process.send_signal(signal.SIGUSR1)
    first.wait_for_event("paused", 60)
    steps = max(steps, last(first)["optimizer_steps"])
    first.process.send_signal(signal.SIGUSR2)
    event = first.wait_for_event("resumed", 60)
    assert event["sources"] == ["own"], event
    (taken,) = [e for e in first.events("state_taken") if e.get("reason") == "resume"]
    assert taken["optimizer_steps"] >= steps and taken["source"] == "own", taken
    before = trained(trainer)
    trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) >= before + 80, 90, "training after resume")
    assert last(trainer)["trainer_failed_microbatches"] == 0, last(trainer)  # no microbatch failed for a pause
