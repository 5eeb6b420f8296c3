"""Averaging, state sync and checkpoints with real peer processes on loopback.

The test drives the peers itself (forward requests with training on, straight to a chosen peer) so that it
knows exactly which data each replica saw and when a round is due."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch

from conftest import client_dht, tiny_manifest_dict, wait_until
from swarm.client.rpc import call_stage, download_state
from swarm.dht.records import announcement_lifetime, fetch_announcements
from swarm.manifests.validation import manifest_from_dict
from swarm.server.rounds import ALONE_AFTER_LIFETIMES
from swarm.wire import messages
from swarm.wire.state import stage_state_shapes

pytestmark = pytest.mark.integration


def one_stage_swarm(announce_period: float = 3.0, **averaging) -> dict:
    """One stage (first and last at once): a forward with training on is a whole local training step."""
    return tiny_manifest_dict(
        stages={"count": 1},
        network={"announce_period": announce_period},  # records live 3 periods: a stopped peer looks online a while
        averaging={"matchmaking_time": 4.0, "timeout": 20.0, **averaging},
    )


class Driver:
    """The test's own client: trains chosen peers on chosen data, reads their state and announcements."""

    def __init__(self, manifest, maddr: str):
        self.manifest = manifest
        self.dht = client_dht(maddr)
        self.loop = asyncio.new_event_loop()
        self.p2p = self.loop.run_until_complete(self.dht.replicate_p2p())
        self.shapes = stage_state_shapes(manifest, 0)
        self.calls = 0

    def train(self, peer_id: str, seed: int, microbatches: int) -> None:
        """Forward+backward+step on `peer_id` with token batches drawn from `seed` (different data per seed)."""
        generator = torch.Generator().manual_seed(seed * 1000 + self.calls)
        config, batch = self.manifest.model, self.manifest.training.microbatch_size
        for _ in range(microbatches):
            self.calls += 1
            tokens = torch.randint(0, 64 * seed, (batch, config.context_length + 1), generator=generator)
            request = messages.make_request(self.manifest, 0, f"mb{self.calls}", [tokens[:, :-1], tokens[:, 1:]])
            reply = self.loop.run_until_complete(call_stage(self.p2p, peer_id, "forward", request, 30, 1))
            messages.decode_reply(reply, 1)  # the loss; raises on an error reply

    def state(self, peer_id: str) -> dict[str, torch.Tensor]:
        fetch = download_state(self.p2p, peer_id, self.manifest, 0, self.shapes, 30)
        items, _ = self.loop.run_until_complete(fetch)
        return dict(items)

    def announcement(self, peer_id: str):
        announcements = self.loop.run_until_complete(fetch_announcements(self.dht, self.manifest.swarm_id, 0))
        return next((a for a in announcements if a.peer_id == peer_id), None)

    def wait_for_rounds(self, peer_ids: list[str], rounds: int, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            anns = [self.announcement(p) for p in peer_ids]
            if all(a is not None and a.averaging_rounds >= rounds for a in anns):
                return
            time.sleep(0.5)
        raise AssertionError(f"no averaging round within {timeout}s: {anns}")

    def close(self) -> None:
        self.loop.run_until_complete(self.p2p.shutdown())
        self.loop.close()
        self.dht.shutdown()


def parameter_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).norm() ** 2) for k in a if k.startswith("param/")) ** 0.5


@pytest.fixture
def driver():
    drivers = []

    def make(manifest, maddr):
        drivers.append(Driver(manifest, maddr))
        return drivers[-1]

    yield make
    for d in drivers:
        d.close()


def start_pair(start_peer, write_manifest, raw, *flags):
    first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", *flags)
    raw["initial_peers"] = [first.maddr()]
    second = start_peer(write_manifest(raw, "joined.json"), "--stage", "0", "--no-trainer", *flags)
    second.wait_for("serving stage 0")
    first.wait_for("serving stage 0")
    return first, second


@pytest.mark.slow(70)
def test_replicas_trained_on_different_data_converge_and_a_failed_round_is_skipped(start_peer, write_manifest, driver):
    raw = one_stage_swarm(mode="parameters", every_samples=160, compression="float32")
    manifest = manifest_from_dict(raw)
    a, b = start_pair(start_peer, write_manifest, raw)
    client = driver(manifest, a.maddr())
    # the joiner started from the first peer's state (what it printed as it happened: swarm/events.py)
    taken = b.events("state_taken")
    assert [(e["stage"], e["source"], e["peer_id"], e["reason"]) for e in taken][:1] == [
        (0, "peer", a.peer_id(), "join")
    ]

    client.train(a.peer_id(), seed=1, microbatches=2)  # 32 samples in all: no round is due yet
    client.train(b.peer_id(), seed=3, microbatches=2)
    apart = parameter_distance(client.state(a.peer_id()), client.state(b.peer_id()))
    assert apart > 0

    client.train(a.peer_id(), seed=1, microbatches=9)  # 176 samples in all: a round is due
    client.train(b.peer_id(), seed=3, microbatches=9)
    client.wait_for_rounds([a.peer_id(), b.peer_id()], rounds=1)
    state_a, state_b = client.state(a.peer_id()), client.state(b.peer_id())
    assert parameter_distance(state_a, state_b) < 1e-4 * apart  # one model again
    ann = client.announcement(a.peer_id())
    assert ann.averaging_bytes_sent > 0 and ann.averaging_round >= 1

    # b stops answering (still announced online for a few seconds): a's next round cannot form a group. a first
    # serves most of the round's samples, so that the round is due right after the stop, while b's record is still
    # alive (20 microbatches after the stop took over 6 s on a loaded machine: a then averaged alone, never skipped)
    client.train(a.peer_id(), seed=1, microbatches=19)  # 152 of the round's 160 samples
    b.signal_all(signal.SIGSTOP)
    try:
        client.train(a.peer_id(), seed=1, microbatches=2)
        a.wait_for_event("averaging_round", timeout=40, stage=0, round=1, outcome="skipped")
        before = client.state(a.peer_id())
        client.train(a.peer_id(), seed=1, microbatches=3)  # and a goes on training (an error reply would raise)
        assert parameter_distance(client.state(a.peer_id()), before) > 0
        assert a.process.poll() is None
    finally:
        b.signal_all(signal.SIGCONT)


def outer_split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A DiLoCo replica's anchor, and its local progress (parameters minus anchor), by parameter name."""
    anchor = {k.removeprefix("outer/").removesuffix("/anchor"): v for k, v in state.items() if k.endswith("/anchor")}
    return anchor, {name: state[f"param/{name}"] - value for name, value in anchor.items()}


@pytest.mark.slow(60)
def test_a_diloco_replica_that_missed_a_round_keeps_its_local_steps(start_peer, write_manifest, driver):
    # records live 3 s; a peer is alone once nobody was seen for 2 lifetimes (6 s)
    raw = one_stage_swarm(announce_period=1.0, mode="diloco", every_samples=64)
    manifest = manifest_from_dict(raw)
    a, b = start_pair(start_peer, write_manifest, raw)
    client = driver(manifest, a.maddr())
    client.train(a.peer_id(), seed=1, microbatches=2)  # 32 of the round's 64 samples
    client.train(b.peer_id(), seed=3, microbatches=2)
    assert not a.events("averaging_round") and not b.events("averaging_round")
    b_anchor, b_local = outer_split(client.state(b.peer_id()))
    assert sum(float(v.norm()) for v in b_local.values()) > 0  # b trained: it has local steps of its own

    # b stops answering long enough for a to be alone: a's round applies its own outer step and moves to round 1
    b.signal_all(signal.SIGSTOP)
    try:
        # b's record lapses (it lives 3 s): from then on a cannot see b (it only counts unexpired records)
        wait_until(lambda: client.announcement(b.peer_id()) is None, 30, "b's record to lapse", every=0.25)
        # a is alone once it has seen nobody for 2 record lifetimes (rounds.py's rule): a window that must pass
        # before a's round is due, or a would try a round with b, fail it and count the round's samples again
        time.sleep(ALONE_AFTER_LIFETIMES * announcement_lifetime(manifest.network.announce_period))
        client.train(a.peer_id(), seed=1, microbatches=8)
        a.wait_for_event("averaging_round", timeout=30, stage=0, round=0, outcome="alone")
    finally:
        b.signal_all(signal.SIGCONT)
    a_anchor, _ = outer_split(client.state(a.peer_id()))

    # b, one round behind, takes the stage's anchor and keeps its local steps on top (it used to take a's whole
    # state, dropping them: a replica's work lost at every round it missed)
    b.wait_for_event("state_taken", timeout=30, stage=0, source="peer", reason="rebase")
    rebased = client.state(b.peer_id())
    anchor, local = outer_split(rebased)
    for name in anchor:
        assert torch.equal(anchor[name], a_anchor[name]), name
        assert torch.allclose(local[name], b_local[name], atol=1e-6), name
    assert any(not torch.equal(anchor[name], b_anchor[name]) for name in anchor)  # the anchor did move
    deadline = time.monotonic() + 10  # b announces its new round number within an announce period
    while client.announcement(b.peer_id()).averaging_round != 1:
        assert time.monotonic() < deadline, "b did not announce round 1"
        time.sleep(0.5)


@pytest.mark.slow(95)
def test_a_killed_peer_resumes_from_its_checkpoint_or_from_peers_that_are_ahead(
    start_peer, write_manifest, driver, tmp_path
):
    # records live 3 s: a restarted peer that finds no other peer looks again for one lifetime before it resumes
    # from its checkpoint, and the killed peer's record lapses before the last peer joins
    raw = one_stage_swarm(announce_period=1.0, mode="diloco", every_samples=10**6)
    manifest = manifest_from_dict(raw)
    first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", "--checkpoint-every", "1")
    first.wait_for("serving stage 0")
    client = driver(manifest, first.maddr())
    client.train(first.peer_id(), seed=1, microbatches=5)
    first.wait_for(r"checkpoint of stage 0 saved to .* \(5 steps\)", timeout=30)
    saved = client.state(first.peer_id())
    assert any(key.startswith("outer/") for key in saved)  # DiLoCo's outer state is part of a stage's state
    first.kill()  # SIGKILL: no goodbye, no last checkpoint

    # alone again: the restarted peer resumes from its checkpoint, not from the seed initialisation
    again = start_peer(write_manifest(raw, "again.json"), "--stage", "0", "--no-trainer", "--checkpoint-every", "1")
    again.wait_for_event("state_taken", stage=0, source="checkpoint")
    again.wait_for("serving stage 0")  # printed once its handlers are up
    client = driver(manifest, again.maddr())
    resumed = client.state(again.peer_id())
    assert resumed.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key

    # another peer joins and trains on; when the first one comes back, that peer is ahead: its state wins
    raw["initial_peers"] = [again.maddr()]
    joined = write_manifest(raw, "joined.json")
    other = start_peer(joined, "--stage", "0", "--no-trainer", "--checkpoint-dir", str(tmp_path / "elsewhere"))
    other.wait_for_event("state_taken", stage=0, source="peer", peer_id=again.peer_id())
    other.wait_for("serving stage 0")
    again.kill()
    client = driver(manifest, other.maddr())
    client.train(other.peer_id(), seed=2, microbatches=3)
    raw["initial_peers"] = [other.maddr()]
    back = start_peer(write_manifest(raw, "back.json"), "--stage", "0", "--no-trainer")
    back.wait_for_event("state_taken", stage=0, source="peer", peer_id=other.peer_id())
    back.wait_for("serving stage 0")
    ahead, taken = client.state(other.peer_id()), client.state(back.peer_id())
    for key, value in ahead.items():
        assert torch.equal(taken[key], value), key
    assert parameter_distance(taken, saved) > 0
