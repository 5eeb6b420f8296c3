"""A full pipe without stale gradients, in a real swarm (peer processes on loopback): a trainer keeps 8 microbatches
in flight through two stages that step every 4. Under the step gate (training.pipelining flush, the default)
every gradient a stage applies was computed at the weights it is applied to: the staleness the peer measures,
announces and prints stays 0, and the gate shows that it held microbatches back. With pipelining async (steps by
count, as before) the same swarm applies stale gradients at stage 0 and says so: so the first assertion would
fail if the gate did not do its work."""

from __future__ import annotations

import asyncio

import pytest

from conftest import client_dht, tiny_manifest_dict
from swarm.dht.records import fetch_announcements
from swarm.local.emulated_links import EmulatedLinks, LinkSpec
from swarm.manifests.validation import manifest_from_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow(40)]

SAMPLES = 8 * 80  # microbatches of 8 samples: 20 optimizer steps of 4


@pytest.mark.parametrize("pipelining", ["flush", "async"])
def test_eight_microbatches_in_flight_apply_no_stale_gradient_under_the_step_gate(
    pipelining, start_peer, write_manifest
):
    training = {"microbatches_per_step": 4, "max_in_flight": 8, "adaptive_window": False, "pipelining": pipelining}
    # no averaging: no round is due in SAMPLES (the test swarm's rounds come every 2048), and a stage peer without
    # an averager starts seconds sooner (it forks none)
    raw = tiny_manifest_dict(training=training, averaging={"mode": "none"})
    first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", "--status-every", "1")
    raw["initial_peers"] = [first.maddr()]
    joined = write_manifest(raw, "joined.json")
    start_peer(joined, "--stage", "1", "--no-trainer")
    trainer = start_peer(joined, "--trainer-only", "--status-every", "1")
    line = trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= SAMPLES, 120, "training")
    assert line["trainer_failed_microbatches"] == 0, line

    manifest = manifest_from_dict(raw)
    dht = client_dht(first.maddr())
    try:

        def stage_zero() -> dict:
            anns = asyncio.run(fetch_announcements(dht, manifest.swarm_id, 0))
            return next(a for a in anns if a.peer_id == first.peer_id()).to_record()

        record = stage_zero()
        first_line = first.status_lines()[-1]
    finally:
        dht.shutdown()
    print(f"{pipelining}: stage 0 announces staleness {record['staleness_mean']} / {record['staleness_max']}")
    if pipelining == "flush":
        assert record["staleness_max"] == 0 and first_line["staleness_max"] == 0, (record, first_line)
        assert first_line["gate_waited"] > 0, first_line  # it did hold microbatches back for the next step
    else:
        assert record["staleness_max"] >= 1, record  # 8 in flight and a step every 4: stale without the gate
        assert first_line["gate_waited"] == 0


@pytest.mark.slow(40)
def test_a_trainer_fills_a_long_route_by_itself_with_the_default_window(start_peer, write_manifest):
    """With the manifest's defaults (max_in_flight 0: two steps' worth, adapted to the route) a trainer behind
    40 ms links keeps several microbatches in flight, at most the automatic limit, and no gradient is stale."""
    training = {"microbatches_per_step": 4, "max_in_flight": 0, "adaptive_window": True}
    raw = tiny_manifest_dict(training=training, averaging={"mode": "none"})
    limit = manifest_from_dict(raw).training.window_limit()
    assert limit == 8
    link = LinkSpec.parse("unlimited/40ms")  # a round trip of 4 x 80 ms through 2 stages: far above compute
    status = ("--status-every", "1")
    with EmulatedLinks(lifetime=300) as links:
        first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", *status, *links.peer_flags("s0", link))
        raw["initial_peers"] = [first.maddr()]
        joined = write_manifest(raw, "joined.json")
        start_peer(joined, "--stage", "1", "--no-trainer", *links.peer_flags("s1", link))
        trainer = start_peer(joined, "--trainer-only", *status, *links.peer_flags("trainer", link))
        # 60 microbatches: 15 steps of 4, most of them with the window grown (past half its limit within a few steps)
        trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= 8 * 60, 120, "training")
        windows = [line["trainer_window"] for line in trainer.status_lines() if "trainer_window" in line]
        last = trainer.status_lines()[-1]
        stage_zero = first.status_lines()[-1]
    print(f"trainer windows: {windows}")
    assert max(windows) >= limit // 2 and max(windows) <= limit, windows  # one in flight was the old default
    assert last["trainer_failed_microbatches"] == 0, last
    assert stage_zero["staleness_max"] == 0, stage_zero
