"""The owner's rules (swarm/peer/owner.py): the hours a peer may run, and what a bad --hours says."""

from __future__ import annotations

from datetime import datetime

import pytest

from swarm.errors import PeerStartError
from swarm.peer.owner import OwnerRules, other_gpu_processes, parse_hours


def at(hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 12, 6, hour, minute)


def test_hours_across_midnight_within_a_day_and_all_day():
    night = parse_hours("22-08")
    assert [night.allow(at(h)) for h in (21, 22, 23, 0, 7, 8, 12)] == [False, True, True, True, True, False, False]
    office = parse_hours("09:30-17:00")
    assert [office.allow(at(*t)) for t in ((9, 29), (9, 30), (16, 59), (17, 0))] == [False, True, True, False]
    assert all(parse_hours("0-0").allow(at(h)) for h in range(24))
    assert night.describe() == "22:00-08:00"


@pytest.mark.parametrize("bad", ["22", "22-", "25-08", "22:61-08", "night", "22-08-09", ""])
def test_a_bad_hours_spec_says_what_one_looks_like(bad):
    with pytest.raises(PeerStartError, match="START-END|from 0 to 23"):
        parse_hours(bad)


def test_the_rules_want_a_pause_outside_the_hours_only():
    rules = OwnerRules(pause=None, resume=None, is_paused=lambda: False, hours=parse_hours("22-08"))
    assert "outside the hours" in rules.reason_to_pause(at(12))
    assert rules.reason_to_pause(at(23)) is None


def test_without_nvidia_smi_nobody_else_is_known_to_use_the_gpu():
    assert other_gpu_processes(0, set()) is None  # this machine has no NVIDIA driver


def test_one_peer_per_gpu_gets_its_own_device_identity_and_ports(tmp_path):
    from peers.gpu_peers import gpu_peer_args

    argv = ["--join", "s.json", "--gpus", "all", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/0"]
    assert gpu_peer_args([*argv, "--metrics-port", "9100"], 2, tmp_path) == [
        "--join",
        "s.json",
        "--host-maddrs",
        "/ip4/0.0.0.0/tcp/31339",
        "/ip6/::/tcp/0",
        "--device",
        "cuda:2",
        "--identity",
        str(tmp_path / "identity-gpu2.key"),
        "--metrics-port",
        "9102",
    ]
    assert gpu_peer_args(["--join", "s.json", "--gpus=0,1", "--identity", "~/k.key"], 1, tmp_path)[-2:] == [
        "--identity",
        "~/k.key.gpu1",
    ]


def test_gpus_on_a_machine_without_one_is_refused_in_one_line(capsys):
    from peers.swarm_peer import main

    assert main(["--join", "nothing.json", "--gpus", "all"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--gpus all: torch sees no CUDA GPU" in error and "without --gpus" in error


@pytest.mark.integration
@pytest.mark.slow(20)
def test_a_peer_outside_its_hours_pauses_itself_and_stays_in_the_swarm(start_peer, write_manifest):
    from conftest import tiny_manifest_dict

    now = datetime.now()
    hours = f"{(now.hour + 2) % 24}-{(now.hour + 3) % 24}"  # an hour that is not now
    manifest = write_manifest(tiny_manifest_dict(averaging={"mode": "none"}))  # no averager process to start
    flags = ("--no-trainer", "--throughput", "100", "--bandwidth", "1000", "--status-every", "1")
    peer = start_peer(manifest, "--stage", "0", *flags, "--hours", hours)
    event = peer.wait_for_event("paused", 90)
    assert "outside the hours it may run" in event["reason"] and event["stages"] == [0], event
    peer.wait_for_json(lambda line: line.get("state") == "paused", 30, "announced paused")
    assert peer.process.poll() is None
