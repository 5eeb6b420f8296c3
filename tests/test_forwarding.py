"""Stage-to-stage forwarding with real peer processes, each behind an emulated home link
(swarm/local/emulated_links.py): the trainer's link carries tokens, not activations; a stage peer killed mid-training is
routed around, and no stage applies a microbatch twice."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import settled_status, tiny_manifest_dict
from swarm.local.emulated_links import EmulatedLinks, LinkSpec
from swarm.manifests.validation import manifest_from_dict

pytestmark = pytest.mark.integration

LINK = LinkSpec.parse("100mbit/5ms")  # fast enough for a short test, slow enough to be a link
# every stage peer is told its link's speed (100 Mbit/s, as the emulated links have) instead of probing it: a probe
# takes seconds over an emulated link (many more over the far peer's 300 ms), and the routes then differ only in what
# the links' latencies make them (pings, coordinates), which is what these tests are about
BANDWIDTH = ("--bandwidth", "100")
BATCH, LENGTH, WIDTH = 8, 32, 64


def last_status(peer) -> dict:
    return peer.status_lines()[-1]


def longest_stall(trainer, samples: int, timeout: float) -> float:
    """Seconds of the trainer's longest stretch without progress until it trained `samples` in all."""

    def trained() -> int:
        return (last_status(trainer).get("trainer_samples") or 0) if trainer.status_lines() else 0

    start = last_change = time.monotonic()
    seen, longest = trained(), 0.0
    while seen < samples:
        assert time.monotonic() - start < timeout, f"{seen} of {samples} samples after {timeout:g} s"
        assert trainer.process.poll() is None, trainer.tail()
        time.sleep(0.2)
        now, current = time.monotonic(), trained()
        if current > seen:
            longest, last_change, seen = max(longest, now - last_change), now, current
    return longest


@pytest.mark.slow(60)
def test_three_stages_forward_around_a_killed_hop_and_the_trainers_link_carries_no_activations(
    start_peer, write_manifest
):
    raw = tiny_manifest_dict(
        model={"depth": 3},
        stages={"count": 3},
        # float32 activations, so that an activation is far larger than a sample's tokens (the check below)
        training={"max_in_flight": 4, "microbatches_per_step": 2, "activation_compression": "float32"},
        averaging={"mode": "none"},
    )
    status = ("--status-every", "1")
    with EmulatedLinks(lifetime=300) as links:
        first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", *status, *links.peer_flags("s0", LINK))
        raw["initial_peers"] = [first.maddr()]
        assert manifest_from_dict(raw).num_stages == 3
        path = write_manifest(raw, "joined.json")
        middle = [
            start_peer(path, "--stage", "1", "--no-trainer", *status, *links.peer_flags(f"s1-{i}", LINK))
            for i in range(2)
        ]
        last = start_peer(path, "--stage", "2", "--no-trainer", *status, *links.peer_flags("s2", LINK))
        for peer in (first, *middle, last):
            peer.wait_for("serving stage", timeout=90)
        trainer = start_peer(path, "--trainer-only", *status, *links.peer_flags("trainer", LINK))

        # 1. it trains through forwarding, and the trainer's own link carries no activations
        trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) >= 40 * BATCH, timeout=120)
        carried, trained = links.carried(), last_status(trainer)["trainer_samples"]
        activation = LENGTH * WIDTH * 4  # bytes of one sample's activations (or their gradient) between stages
        trainer_link = (carried["trainer"]["up"] + carried["trainer"]["down"]) / trained
        middle_link = sum(carried[f"s1-{i}"]["up"] + carried[f"s1-{i}"]["down"] for i in range(2)) / trained
        # a stage-1 peer receives activations and sends them on, receives their gradient and sends one back
        assert middle_link > 3.5 * activation, (middle_link, activation)
        # the trainer's link carries tokens, targets, losses and the DHT's and pings' bytes: a small fraction of one
        # activation per sample, and more than 20 times less than a stage-1 peer's
        assert trainer_link < 0.5 * activation and trainer_link * 20 < middle_link, (trainer_link, middle_link)
        assert last_status(trainer)["trainer_bytes_sent"] <= carried["trainer"]["up"]
        assert last_status(trainer)["stage"] is None  # a trainer-only peer serves no stage

        # 2. a stage-1 peer dies mid-training: stage 0 sends its microbatches on to the other one. The one killed is
        # the one carrying traffic now (on a loaded machine the routes may favour one of them for a while, and
        # killing an idle one would leave nothing to reroute)
        def recent_bytes(before: dict, after: dict, name: str) -> int:
            return sum(after[name][d] - before[name][d] for d in ("up", "down"))

        earlier = links.carried()
        time.sleep(2)
        now = links.carried()
        busy = max(range(2), key=lambda i: recent_bytes(earlier, now, f"s1-{i}"))
        victim, survivor = middle[busy], middle[1 - busy]
        before = last_status(trainer)["trainer_samples"]
        # frozen first, for a second: microbatches that stage 0 sends it meanwhile are surely in flight there when it
        # dies (a kill at a moment when it held none leaves nothing to reroute: seen on a loaded machine)
        victim.signal_all(signal.SIGSTOP)
        time.sleep(1.0)
        victim.kill()
        # the trainer goes on within seconds (a hop given up after the manifest's 5 s forward timeout, or sooner), never
        # stuck until its microbatches' own 60 s timeout: half of that is far above the normal figure, far below it
        stall = longest_stall(trainer, before + 30 * BATCH, timeout=120)
        print(f"after the kill the trainer's longest stretch without progress was {stall:.1f} s")
        assert stall < raw["training"]["timeouts"]["microbatch"] / 2, stall
        trainer.stop()

        # 3. nothing applied twice: every microbatch stage 0 applied passed stage 2 exactly once (a hop finishes
        # what it started even if its caller is gone, as the trainer is now). A microbatch stage
        # 2 applied whose way back was cut by the kill is answered with its first reply when it comes again through
        # the other stage-1 peer (replayed); one still in progress there is refused as a duplicate (dropped)
        # the stage peers' counters once what was in flight when the trainer stopped is done
        s0 = settled_status(first, ("samples_served", "rerouted", "duplicates", "too_late"))
        s2 = settled_status(last, ("samples_served", "replayed"))
        trainer_end = trainer.status_lines()[-1]
        print(
            f"trainer link {trainer_link:.0f} B/sample, stage-1 links {middle_link:.0f} B/sample (activation "
            f"{activation} B); after the kill: rerouted {s0['rerouted']}, duplicates {s0['duplicates']}, replayed "
            f"{s2['replayed']}, failed {trainer_end['trainer_failed_microbatches']}"
        )
        assert s0["rerouted"] >= 1, s0
        # (a duplicate that comes back to the trainer is asked again and replayed, so it may end applied everywhere;
        # a gradient that came back to stage 0 after its deadline there is not applied there: too late, on a
        # loaded machine, for a microbatch the freeze held up)
        unapplied = s0["duplicates"] + s0["too_late"]
        assert 0 <= s2["samples_served"] - s0["samples_served"] <= BATCH * unapplied, (s0, s2)
        window = 4  # at most the microbatches in flight at the kill are affected
        assert s0["duplicates"] <= window and trainer_end["trainer_failed_microbatches"] <= unapplied
        assert s2["replayed"] <= window, s2
        # the trainer counts what came back; what was in flight when it stopped was applied but not counted
        assert 0 <= s0["samples_served"] - trainer_end["trainer_samples"] <= 4 * BATCH, (s0, trainer_end)
        assert victim.process.poll() is not None
        assert survivor.process.poll() is None and first.process.poll() is None


@pytest.mark.slow(75)
def test_routes_prefer_the_peer_behind_the_better_link(start_peer, write_manifest):
    """Two peers serve the last stage, one 5 ms away and one 300 ms away (one-way, at its end): the trainer's routes
    send most microbatches to the near one (the far one only when the near one's queue is longer than its
    round trip)."""
    raw = tiny_manifest_dict(averaging={"mode": "none"})
    status = ("--status-every", "1", *BANDWIDTH)
    with EmulatedLinks(lifetime=300) as links:
        first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer", *status, *links.peer_flags("s0", LINK))
        raw["initial_peers"] = [first.maddr()]
        path = write_manifest(raw, "joined.json")
        near = start_peer(path, "--stage", "1", "--no-trainer", *status, *links.peer_flags("near", LINK))
        far_link = LinkSpec.parse("100mbit/300ms")
        far = start_peer(path, "--stage", "1", "--no-trainer", *status, *links.peer_flags("far", far_link))
        for peer in (first, near, far):
            peer.wait_for("serving stage", timeout=90)
        trainer = start_peer(path, "--trainer-only", *status, *links.peer_flags("trainer", LINK))
        trainer.wait_for_json(lambda s: (s.get("trainer_samples") or 0) >= 60 * BATCH, timeout=120)
        trainer.stop()
        served_near = settled_status(near, ("samples_served",))["samples_served"]
        served_far = settled_status(far, ("samples_served",))["samples_served"]
        print(f"near peer served {served_near} samples, far peer {served_far}")
        assert served_near >= 2 * served_far, (served_near, served_far)
        assert served_near + served_far >= 60 * BATCH
