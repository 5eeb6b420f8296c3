"""An adversary suite: real peer processes on loopback, one of them hostile, and the swarm keeps training.

The threat model is docs/RELIABILITY.md's "Public swarms". Forgers of records in detail: tests/test_signed_records.py
(real DHT nodes); poisoning replicas and dishonest reducers: tests/test_averaging.py (real averaging rounds). Here:
a forger in a live swarm, a stage peer that computes wrong results, and a peer that announces a huge throughput
and answers no call.
"""

from __future__ import annotations

import asyncio
import random
import time

from hivemind import DHT
from hivemind.utils import get_dht_time

from conftest import LOOPBACK, client_dht, tiny_manifest_dict
from swarm import joining
from swarm.client.checks import CONVICTING_PARTNERS, WorkChecks, losses_disagree
from swarm.manifest import manifest_from_dict
from swarm.records import fetch_announcements, stage_key

# ------------------------------------------------------------------------------------ checks, pure logic


def test_checks_convict_the_replica_that_agrees_with_nobody():
    checks = WorkChecks(fraction=1.0)
    rng = random.Random(0)
    stages = [["honest-a", "honest-b", "liar"], ["last"]]
    convicted = []
    for _ in range(200):
        plan = checks.plan([rng.choice(stages[0]), "last"], stages, rng)
        if plan is None:
            continue
        loss = {"honest-a": 3.0, "honest-b": 3.05, "liar": 5.2}
        convicted += checks.record(plan, loss[plan.route[0]], loss[plan.other_route[0]])
    assert convicted == ["liar"]
    assert checks.disagreements > 0 and checks.checks > checks.disagreements


def test_checks_convict_nobody_when_two_replicas_disagree():
    """With two replicas, a disagreement cannot tell which one lied: nobody is convicted."""
    checks = WorkChecks(fraction=1.0)
    rng = random.Random(0)
    stages = [["a", "b"], ["last"]]
    for _ in range(100):
        plan = checks.plan(["a", "last"], stages, rng)
        assert plan is not None and plan.other_route == ("b", "last")
        assert checks.record(plan, 3.0, 5.0) == []
    assert not checks.convicted and CONVICTING_PARTNERS >= 2


def test_losses_of_close_replicas_agree_and_wrong_ones_do_not():
    assert not losses_disagree(3.0, 3.1)
    assert not losses_disagree(0.01, 0.04)  # tiny losses: the absolute floor
    assert losses_disagree(3.0, 4.0)
    assert losses_disagree(3.0, float("nan"))


# ------------------------------------------------------------------------------------ live swarms


def _online(dht, manifest, stage: int) -> dict[str, int]:
    """Online peers of a stage and the samples each says it served."""
    anns = asyncio.run(fetch_announcements(dht, manifest.swarm_id, stage))
    return {a.peer_id: a.samples_served for a in anns if a.state == "online"}


def test_a_stage_peer_that_computes_wrong_results_is_caught_and_routed_around(start_peer, write_manifest):
    """Stage 0 has two honest replicas and one that returns shuffled activations (finite, plausible, wrong). The
    trainer sends a share of its microbatches through two replicas and compares the losses: it convicts the liar,
    never an honest replica, and stops sending it work."""
    raw = tiny_manifest_dict()
    first = start_peer(write_manifest(raw), "--stage", "0", "--status-every", "1", "--check-fraction", "0.3")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    path = write_manifest(raw, "joined.json")
    honest = start_peer(path, "--stage", "0", "--no-trainer")
    start_peer(path, "--stage", "1", "--no-trainer")
    dht = client_dht(first.maddr())
    try:
        # the liar joins once the model has learnt something (at the start every output gives about the same loss)
        first.wait_for_json(lambda line: (line.get("trainer_loss") or 9.0) < 4.0, timeout=150, what="loss below 4")
        liar = start_peer(path, "--stage", "0", "--no-trainer", module="tests.adversaries.dishonest_peer")
        liar_id, honest_ids = liar.peer_id(), {first.peer_id(), honest.peer_id()}
        joined = time.monotonic()
        line = first.wait_for_json(
            lambda line: liar_id in line.get("trainer_convicted", []), timeout=120, what="the liar convicted"
        )
        detection = time.monotonic() - joined
        assert not honest_ids & set(line["trainer_convicted"]), line  # no honest replica convicted
        assert line["trainer_checks"] > 0 and line["trainer_check_disagreements"] > 0
        time.sleep(3 * manifest.network.announce_period)  # its announced count catches up with what it served
        served = _online(dht, manifest, 0)[liar_id]
        time.sleep(8)  # routed around: it gets no more of the trainer's work
        assert _online(dht, manifest, 0)[liar_id] == served
        print(f"liar convicted {detection:.1f} s after it joined; checks {line['trainer_checks']}")
    finally:
        dht.shutdown()


def test_a_peer_that_announces_a_huge_throughput_and_answers_nothing_only_slows_training(start_peer, write_manifest):
    """Stage 1 has an honest peer and one that announces 100,000 samples/s and never answers: the trainer tries
    it, times out, bans it for longer each time, and trains through the honest peer."""
    raw = tiny_manifest_dict()
    first = start_peer(write_manifest(raw), "--stage", "0", "--status-every", "1")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    path = write_manifest(raw, "joined.json")
    start_peer(path, "--stage", "1", "--no-trainer")
    dht = client_dht(first.maddr())
    try:
        first.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > 0, timeout=90, what="training")
        hole = start_peer(
            path, "--stage", "1", "--no-trainer", "--throughput", "100000", module="tests.adversaries.black_hole_peer"
        )
        hole_id = hole.peer_id()
        deadline = time.monotonic() + 60
        while hole_id not in _online(dht, manifest, 1):
            assert time.monotonic() < deadline, "the black hole never announced itself online"
            time.sleep(0.5)
        begin = first.status_lines()[-1]
        time.sleep(20)
        end = first.status_lines()[-1]
        trained = end["trainer_samples"] - begin["trainer_samples"]
        failed = end["trainer_failed_microbatches"] - begin["trainer_failed_microbatches"]
        assert trained >= 20 * 8, (begin, end)  # at least a microbatch a second, through the honest peer
        assert failed <= 2, (begin, end)
        assert _online(dht, manifest, 1)[hole_id] == 0  # it served nothing
        print(f"with the black hole: {trained / 20:.1f} samples/s, {failed} microbatches failed")
    finally:
        dht.shutdown()


def test_a_forger_cannot_take_a_live_peer_out_of_the_swarm(start_peer, write_manifest):
    """A bare hivemind node keeps storing records that say the stage-1 peer went offline (with later expirations, so
    they would win): the swarm's nodes refuse them, readers that check signatures still see the peer online, and
    the trainer keeps training through it."""
    raw = tiny_manifest_dict()
    first = start_peer(write_manifest(raw), "--stage", "0", "--status-every", "1")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    victim = start_peer(write_manifest(raw, "joined.json"), "--stage", "1", "--no-trainer")
    reader = client_dht(first.maddr())
    joining.sign_records(reader, manifest, None)
    forger = DHT(initial_peers=[first.maddr()], start=True, host_maddrs=[LOOPBACK])
    try:
        victim_id = victim.peer_id()
        first.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > 0, timeout=90, what="training")
        record = {**next(a for a in asyncio.run(fetch_announcements(reader, manifest.swarm_id, 1))).to_record()}
        assert record["peer_id"] == victim_id
        record.update(state="offline", throughput=0.0)
        begin = first.status_lines()[-1]["trainer_samples"]
        for _ in range(10):
            forger.store(stage_key(manifest.swarm_id, 1), record, get_dht_time() + 60, subkey=victim_id)
            time.sleep(0.5)
        assert victim_id in _online(reader, manifest, 1)
        assert first.status_lines()[-1]["trainer_samples"] > begin + 5 * 8  # still trains through it
    finally:
        forger.shutdown()
        reader.shutdown()
