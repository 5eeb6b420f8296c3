"""Attacks that one live, training swarm shrugs off, one after another (real peer processes on loopback): a forger
of records, a flood of reachability checks, and a peer that announces a huge throughput and answers nothing.

They share one swarm (a stage-0 peer that trains, a stage-1 peer), started once: the module is one unit of work
under pytest-xdist (tests/conftest.py, SHARED_SWARMS) and its tests run in file order; each leaves the swarm as it
found it. The threat model is docs/RELIABILITY.md's "Public swarms"; tests/test_adversaries.py has the attacks
that need a swarm of their own (liars among replicas, a poisoning replica).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from conftest import LOOPBACK, ROOT, PeerProcess, client_dht, tiny_manifest_dict, wait_until
from swarm.dht import node
from swarm.dht.records import fetch_announcements, stage_key
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.server.reachability import check_reachability

pytestmark = [pytest.mark.integration, pytest.mark.slow(60)]  # all alike: they keep their file order


@dataclass
class Swarm:
    manifest: Manifest
    path: Path  # the manifest that joins it
    first: PeerProcess  # serves stage 0 and trains
    second: PeerProcess  # serves stage 1
    reader: DHT  # a DHT client in this process that checks the records' signatures


@pytest.fixture(scope="module")
def swarm(start_module_peer, tmp_path_factory) -> Iterator[Swarm]:
    folder = tmp_path_factory.mktemp("manifests")
    raw = tiny_manifest_dict()
    (folder / "manifest.json").write_text(json.dumps(raw))
    first = start_module_peer(folder / "manifest.json", "--stage", "0", "--status-every", "1")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    path = folder / "joined.json"
    path.write_text(json.dumps(raw))
    second = start_module_peer(path, "--stage", "1", "--no-trainer")
    reader = client_dht(first.maddr())
    try:
        node.sign_records(reader, manifest, None)
        first.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > 0, timeout=90, what="training")
        yield Swarm(manifest, path, first, second, reader)
    finally:
        reader.shutdown()


def online(swarm: Swarm, stage: int) -> dict[str, int]:
    """Online peers of a stage and the samples each says it served."""
    anns = asyncio.run(fetch_announcements(swarm.reader, swarm.manifest.swarm_id, stage))
    return {a.peer_id: a.samples_served for a in anns if a.state == "online"}


def test_a_forger_cannot_take_a_live_peer_out_of_the_swarm(swarm: Swarm):
    """A bare hivemind node keeps storing records that say the stage-1 peer went offline (with later expirations, so
    they would win): the swarm's nodes refuse them, readers that check signatures still see the peer online, and
    the trainer keeps training through it."""
    manifest, victim_id = swarm.manifest, swarm.second.peer_id()
    forger = DHT(initial_peers=[swarm.first.maddr()], start=True, host_maddrs=[LOOPBACK])
    try:
        announcements = asyncio.run(fetch_announcements(swarm.reader, manifest.swarm_id, 1))
        record = {**next(a for a in announcements if a.peer_id == victim_id).to_record()}
        record.update(state="offline", throughput=0.0)
        begin = swarm.first.status_lines()[-1]["trainer_samples"]
        for _ in range(10):  # the attack: a store every half second for 5 s
            forger.store(stage_key(manifest.swarm_id, 1), record, get_dht_time() + 60, subkey=victim_id)
            time.sleep(0.5)
        assert victim_id in online(swarm, 1)
        assert swarm.first.status_lines()[-1]["trainer_samples"] > begin + 5 * 8  # still trains through it
        # and the peers count what they refused (the forger stores at every node of this small DHT)
        swarm.first.wait_for_json(lambda line: line.get("refused_records", 0) >= 1, timeout=10, what="refusals")
    finally:
        forger.shutdown()


def test_a_flood_of_reachability_checks_stops_neither_training_nor_a_newcomers_check(swarm: Swarm):
    """A process keeps 32 reachability checks in flight at the stage-0 peer for 10 s, from one identity: it gets
    one dial back and refusals after that, the peer trains on, and a newcomer's check in the meantime is answered."""
    first = swarm.first
    begin, started = first.status_lines()[-1], time.monotonic()
    command = [sys.executable, "-m", "tests.adversaries.reachability_flood", first.maddr(), "10", "32"]
    flood = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        assert flood.stdout.readline().strip() == "under way"  # its first check was answered: it floods now
        verdict = asyncio.run(check_reachability([first.maddr()], [LOOPBACK], None))  # a newcomer, meanwhile
        assert flood.poll() is None, "the flood ended before the newcomer's check was answered"
        out, _ = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:  # its p2p daemon is in its process group
            os.killpg(flood.pid, signal.SIGKILL)
            flood.wait()
    end, took = first.status_lines()[-1], time.monotonic() - started
    answers = json.loads(out.strip().splitlines()[-1])
    print(f"flood answers: {answers}; newcomer: {verdict}")
    assert verdict.reachable is True, verdict.detail
    assert answers.get("reachable", 0) <= 1 and answers.get("refused", 0) >= 100, answers
    assert sum(n for key, n in answers.items() if key.startswith("failed")) <= 3, answers
    assert end["trainer_samples"] - begin["trainer_samples"] >= 8 * took, (begin, end)  # a microbatch a second
    assert first.process.poll() is None


def test_a_peer_that_announces_a_huge_throughput_and_answers_nothing_only_slows_training(swarm: Swarm, start_peer):
    """Stage 1 has an honest peer and one that announces 100,000 samples/s and never answers: stage 0 tries it,
    waits out the hop's budget (about 11 s here), bans it for WASTE_FACTOR times that wait, and trains through the
    honest peer. So in any 30 s after it appears, the hole costs at most one such wait. (Last: the trainer
    remembers the black hole; it is killed at the end, by start_peer.)"""
    hole = start_peer(
        swarm.path, "--stage", "1", "--no-trainer", "--throughput", "100000", module="tests.adversaries.black_hole_peer"
    )
    hole_id = hole.peer_id()
    wait_until(lambda: hole_id in online(swarm, 1), 60, "the black hole to announce itself online", every=0.5)
    window = 30  # one wait of ~11 s fits in it, a second would not (the ban after the first lasts ~44 s)
    begin = swarm.first.status_lines()[-1]
    time.sleep(window)  # the window measured: training goes on with the black hole in the swarm
    end = swarm.first.status_lines()[-1]
    trained = end["trainer_samples"] - begin["trainer_samples"]
    failed = end["trainer_failed_microbatches"] - begin["trainer_failed_microbatches"]
    assert trained >= (window / 2) * 8, (begin, end)  # a microbatch a second for at least half of the window
    assert failed <= 2, (begin, end)
    assert online(swarm, 1)[hole_id] == 0  # it served nothing
    print(f"with the black hole: {trained / window:.1f} samples/s, {failed} microbatches failed")
