"""Nothing trained is lost when a volunteer leaves: a peer that stops while it is the only one serving a stage
hands that stage's state to the peer that takes it over before it goes (swarm/server/handover.py), and stops at
once when its owner asks twice."""

from __future__ import annotations

import re
import signal
import time

import pytest

from conftest import tiny_manifest_dict

NOISE = ("Traceback", "Unhandled exception", "Task exception", "hard way", "failed during shutdown")


def steps_of(peer, stage: int) -> int:
    """The optimizer steps of the last checkpoint the peer saved of `stage` (it saves one as it stops)."""
    saved = re.findall(rf"checkpoint of stage {stage} saved to \S+ \((\d+) steps\)", peer.output())
    assert saved, peer.tail()
    return int(saved[-1])


def start_swarm(start_peer, write_manifest):
    """Stage 0: a trainer pinned there and a movable peer; stage 1: one peer only, the one that will leave. The
    announced throughputs make stage 0 the weaker stage, so that the movable peer chooses it at first."""
    raw = tiny_manifest_dict(balancing={"check_period": 60})  # the handover cannot wait for a regular check
    trainer = start_peer(write_manifest(raw), "--stage", "0", "--throughput", "100", "--status-every", "1")
    raw["initial_peers"] = [trainer.maddr()]
    path = write_manifest(raw, "joined.json")
    leaver = start_peer(path, "--stage", "1", "--no-trainer", "--throughput", "1000", "--status-every", "1")
    leaver.wait_for("serving stage 1")
    taker = start_peer(path, "--no-trainer", "--throughput", "100", "--status-every", "1")
    taker.wait_for("serving stage 0")
    leaver.wait_for_json(lambda line: (line.get("optimizer_steps") or 0) >= 8, 120, "stage 1 trained")
    return trainer, leaver, taker


@pytest.mark.slow(60)
def test_the_only_holder_of_a_stage_hands_it_over_when_a_ctrl_c_stops_it(start_peer, write_manifest):
    trainer, leaver, taker = start_swarm(start_peer, write_manifest)
    begin = time.monotonic()
    leaver.signal_group(signal.SIGINT)  # a terminal's Ctrl-C: the peer's whole process group
    leaving = leaver.wait_for_event("leaving", 30)
    assert leaving["stages"] == [1]
    assert leaver.process.wait(timeout=90) == 0, leaver.tail()
    handed = leaver.wait_for_event("handed_over", 5)
    assert handed["taken"] == [1] and handed["left_behind"] == [] and not handed["hurried"], handed
    print(
        f"the only peer of stage 1 left: handed over in {handed['seconds']} s, {time.monotonic() - begin:.1f} s to exit"
    )
    # the peer that took stage 1 over got its final state: not one optimizer step rolled back
    taken = taker.wait_for_event("state_taken", 30, stage=1)
    assert taken["source"] == "peer" and taken["peer_id"] == leaver.peer_id(), taken
    assert taken["optimizer_steps"] == steps_of(leaver, 1) > 0, (taken, leaver.tail())
    assert time.monotonic() - begin < 60
    # training goes on through the peer that took it over
    samples = trainer.json_lines()[-1].get("trainer_samples") or 0
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > samples + 32, 60, "training again")
    output = leaver.output()
    assert not [word for word in NOISE if word in output], output[-3000:]


@pytest.mark.slow(45)
def test_a_second_ctrl_c_stops_at_once_and_says_what_stays_behind(start_peer, write_manifest):
    raw = tiny_manifest_dict(balancing={"check_period": 60})
    leaver = start_peer(write_manifest(raw), "--stage", "1", "--no-trainer", "--status-every", "1")
    raw["initial_peers"] = [leaver.maddr()]
    daemon_sockets = [path for path in leaver.socket_files() if "p2pd" in path.name]  # its DHT's daemon
    assert len(daemon_sockets) == 1, daemon_sockets
    # the other peer may move, but it is the only peer of stage 0, which it never leaves empty: nobody takes stage 1
    trainer = start_peer(write_manifest(raw, "joined.json"), "--throughput", "1000", "--status-every", "1")
    trainer.wait_for("serving stage 0")
    leaver.wait_for_json(lambda line: (line.get("optimizer_steps") or 0) >= 1, 120, "stage 1 trained")
    leaver.signal_group(signal.SIGINT)
    leaver.wait_for_event("leaving", 30)
    time.sleep(1)
    # the Ctrl-C reached the peer only, not its p2p daemon (which would close its control socket at once): the
    # peer can still announce, hand over and say goodbye while it leaves
    assert all(path.exists() for path in daemon_sockets), daemon_sockets
    begin = time.monotonic()
    leaver.signal_group(signal.SIGINT)
    assert leaver.process.wait(timeout=30) == 0, leaver.tail()
    assert time.monotonic() - begin < 15
    handed = leaver.wait_for_event("handed_over", 5)
    assert handed["hurried"] and handed["left_behind"] == [1] and handed["taken"] == [], handed
    assert "stopping now, without waiting for a handover" in leaver.output()
    assert steps_of(leaver, 1) >= 1  # its state is in its checkpoint
    output = leaver.output()
    assert not [word for word in NOISE if word in output], output[-3000:]


def backed_up_steps(peers, stage: int) -> list[int]:
    """Optimizer steps of every backup of `stage` the peers saved (server/backups.py), as their logs say."""
    return [
        int(steps)
        for peer in peers
        for steps in re.findall(
            rf"backed up stage {stage}, which only peer \S+ serves \((\d+) optimizer", peer.output()
        )
    ]


@pytest.mark.slow(70)
def test_a_vanished_only_holder_comes_back_from_a_backup_on_another_peer(start_peer, write_manifest, tmp_path):
    """The only peer of stage 1 vanishes (all its processes stopped: no goodbye, no handover). Another peer kept a
    backup of its state: the peer that takes stage 1 over fetches it over the network and starts from the
    freshest backup in the swarm, not afresh, and training goes on."""
    # no averaging (what is tested is the backups and the takeover): a peer without an averager starts, and moves,
    # seconds sooner (it forks none)
    raw = tiny_manifest_dict(balancing={"check_period": 60}, averaging={"mode": "none"})

    def own(name: str, every: str = "2") -> tuple[str, ...]:  # each peer its own folder, as on its own machine
        return ("--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", every, "--status-every", "1")

    trainer = start_peer(write_manifest(raw), "--stage", "0", "--throughput", "100", *own("trainer"))
    raw["initial_peers"] = [trainer.maddr()]
    path = write_manifest(raw, "joined.json")
    holder = start_peer(path, "--stage", "1", "--no-trainer", "--throughput", "1000", *own("holder"))
    holder.wait_for("serving stage 1")
    # the taker keeps no backups (--checkpoint-every 0): the trainer's peer does, and hands it over the network
    taker = start_peer(path, "--no-trainer", "--throughput", "100", *own("taker", "0"))
    taker.wait_for("serving stage 0")
    deadline = time.monotonic() + 90
    while not any(steps > 0 for steps in backed_up_steps([trainer], 1)):
        assert time.monotonic() < deadline, (trainer.tail(), taker.tail())
        time.sleep(0.5)
    holder.signal_all(signal.SIGSTOP)  # vanished: its link is as good as cut
    vanished, samples = time.monotonic(), trainer.json_lines()[-1].get("trainer_samples") or 0
    taken = taker.wait_for_event("state_taken", 60, stage=1)
    backups = backed_up_steps([trainer], 1)
    assert taken["source"] == "checkpoint" and taken["peer_id"] == trainer.peer_id(), taken
    # the freshest backup in the swarm: what the holder trained since it is all that was lost
    assert taken["optimizer_steps"] == max(backups) > 0, (taken, backups)
    # what was lost is announced with the stage (peer-status shows it): the status line reads the same figures
    line = taker.wait_for_json(lambda s: s.get("stage") == 1 and "event" not in s, 30, "a status line of stage 1")
    assert line["steps_behind"] == taken["steps_behind"], (line, taken)
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) > samples + 32, 60, "training again")
    stall = time.monotonic() - vanished
    print(f"the only holder of stage 1 vanished: training went on after {stall:.1f} s, "
          f"{taken['steps_behind']} optimizer steps behind")  # fmt: skip
    assert stall < 30
