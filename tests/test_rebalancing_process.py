"""Stage choice and moves with real peer processes: joiners take the bottleneck, peers move when a stage's
peers are killed, and a moving peer takes over the stage's trained state."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from conftest import client_dht, tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.client.rpc import download_state
from swarm.manifests.validation import manifest_from_dict
from swarm.wire.state import stage_state_shapes

pytestmark = pytest.mark.integration


def status(peer, key: str, timeout: float = 60.0, until=lambda value: True):
    """The newest value of `key` in the peer's JSON status lines, once `until(value)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in peer.status_lines() if key in line]
        if lines and until(lines[-1][key]):
            return lines[-1][key]
        if peer.process.poll() is not None:
            raise AssertionError(f"peer exited:\n{peer.output()[-3000:]}")
        time.sleep(0.3)
    raise AssertionError(f"{key} never satisfied the condition:\n{peer.output()[-3000:]}")


@pytest.mark.slow(70)
def test_a_joining_peer_takes_the_stage_with_least_throughput(start_peer, write_manifest):
    raw = tiny_manifest_dict(model={"depth": 3}, stages={"count": 3})
    first = start_peer(write_manifest(raw), "--stage", "0", "--throughput", "100", "--no-trainer")
    raw["initial_peers"] = [first.maddr()]
    path = write_manifest(raw, "joined.json")
    one = start_peer(path, "--stage", "1", "--throughput", "10", "--no-trainer")
    two = start_peer(path, "--stage", "2", "--throughput", "40", "--no-trainer")  # both at once: stages are given
    one.wait_for("serving stage 1")
    two.wait_for("serving stage 2")
    joiner = start_peer(path, "--throughput", "20", "--no-trainer")
    joiner.wait_for(r"serving stage \d")
    assert "serving stage 1" in joiner.output()  # 10 samples/s there, against 100 and 40
    # the swarm is now 100 / 30 / 40, stages 0 and 2 held once: a second joiner gives the thinner of them with less
    # throughput a second holder (balancing.min_holders, 2 by default) before it helps stage 1's throughput
    second = start_peer(path, "--throughput", "20", "--no-trainer")
    second.wait_for(r"serving stage \d")
    assert "serving stage 2" in second.output(), second.output()


@pytest.mark.slow(90)
def test_a_peer_moves_to_a_weakened_stage_and_takes_over_its_trained_state(start_peer, write_manifest):
    # a round every 256 samples (not 2048) and 2 s of matchmaking: the keeper holds trained parameters sooner; a
    # round whose all-reduce stalls (seen once, for the first round after the keeper joined) is given up after 10 s
    # (rounds take about 2 s here), not the default 30
    averaging = {"every_samples": 256, "matchmaking_time": 2.0, "timeout": 10.0}
    raw = tiny_manifest_dict(balancing={"check_period": 2.0, "min_gain": 0.1}, averaging=averaging)
    manifest = manifest_from_dict(raw)
    trainer = start_peer(write_manifest(raw), "--stage", "0", "--throughput", "100", "--status-every", "1")
    raw["initial_peers"] = [trainer.maddr()]
    path = write_manifest(raw, "joined.json")
    trainer.wait_for("serving stage 0")  # announced: stage 0 has at least 100 samples/s from the start
    # the three start together: whatever the mover sees of the other two, stage 1 has least (0 or 20 samples/s,
    # against 100 or 105)
    keeper = start_peer(path, "--stage", "0", "--throughput", "5", "--no-trainer", "--status-every", "1")
    one = start_peer(path, "--stage", "1", "--throughput", "20", "--no-trainer")
    mover = start_peer(path, "--throughput", "50", "--no-trainer", "--status-every", "1")
    one.wait_for("serving stage 1")
    keeper.wait_for("serving stage 0")
    mover.wait_for("serving stage 1")  # 105 samples/s serve stage 0, 70 stage 1
    assert status(mover, "moves") == 0

    # the slow stage-0 peer holds trained parameters: it averages with the trainer's peer (and may serve a few
    # microbatches too; how many depends on routing)
    # killed right after a round, so that no round is due once the mover arrives (one due before would still be
    # averaged with it, and averaging two identical replicas in 8 bits does not leave them bit-identical)
    rounds = status(keeper, "averaging_rounds", until=lambda rounds: rounds >= 1)
    status(keeper, "averaging_rounds", until=lambda now: now > rounds)
    trainer.kill()  # stage 0 is left with 5 samples/s, stage 1 has 70: the mover must go to stage 0
    assert status(mover, "stage", timeout=60, until=lambda stage: stage == 0) == 0
    assert status(mover, "moves") == 1
    # what it printed as it happened (swarm/events.py): the move, and where it took the stage's state from
    assert [(e["from_stage"], e["to_stage"]) for e in mover.events("moved")] == [(1, 0)], mover.events()
    taken = [(e["stage"], e["source"], e["reason"]) for e in mover.events("state_taken")]
    assert (0, "peer", "move") in taken, taken  # from a peer (the keeper), as it moved

    # it serves the trained parameters (nobody trains any more: they must be exactly the keeper's)
    dht = client_dht(mover.maddr())
    try:

        async def fetch(peer_id: str) -> dict[str, torch.Tensor]:
            p2p = await dht.replicate_p2p()
            items, _ = await download_state(p2p, peer_id, manifest, 0, stage_state_shapes(manifest, 0), timeout=30)
            return dict(items)

        moved = asyncio.run(fetch(mover.peer_id()))
        kept = asyncio.run(fetch(keeper.peer_id()))
    finally:
        dht.shutdown()
    initial = dict(build_stage(manifest, 0).named_parameters())
    assert moved.keys() == kept.keys() and any(key.startswith("optim/") for key in moved)
    for key, value in kept.items():
        assert torch.equal(moved[key], value), (key, mover.events("averaging_round"))  # no round since
    assert any(not torch.equal(moved[f"param/{name}"], p.detach()) for name, p in initial.items())
    time.sleep(3)  # and it stays there: the swarm is balanced as well as it can be
    assert status(mover, "moves") == 1
