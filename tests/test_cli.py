"""swarm-peer and swarm-demo: bad user input gets a clear one-paragraph error, quickly, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT, tiny_manifest_dict

pytestmark = pytest.mark.integration


def run(module: str, *args: str, timeout: float = 60, stdout_only: bool = False) -> tuple[int, str, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    out = result.stdout if stdout_only else result.stdout + result.stderr
    return result.returncode, out, time.monotonic() - start


def test_help_shows_examples():
    for module in ("peers.peer", "peers.demo"):
        code, out, _ = run(module, "--help")
        assert code == 0 and "examples:" in out


@pytest.mark.parametrize(
    "manifest,flags,expected",
    [
        (None, [], "does not exist"),
        ({"model": {"heads": 3}}, [], "'model.heads'"),
        ({}, ["--stage", "7"], "--stage 7"),
        ({}, ["--host-maddrs", "/ip4/not-an-ip/tcp/0"], "--host-maddrs"),
    ],
    ids=["missing-manifest", "bad-field", "stage-out-of-range", "bad-host-maddr"],
)
def test_bad_input_gets_a_clear_error(tmp_path, manifest, flags, expected):
    path = tmp_path / "m.json"
    if manifest is not None:
        path.write_text(json.dumps(tiny_manifest_dict(**manifest)))
    code, out, elapsed = run("peers.peer", "--join", str(path), "--no-trainer", *flags)
    assert code == 2
    assert expected in out
    assert "Traceback" not in out
    assert elapsed < 30


def test_unreachable_initial_peers_fail_fast(tmp_path):
    # a valid address on loopback where nobody listens
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(tiny_manifest_dict(initial_peers=[dead])))
    code, out, elapsed = run("peers.peer", "--join", str(path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
    assert code == 2
    assert "initial peers could be reached" in out
    assert "Traceback" not in out
    assert elapsed < 30


def test_demo_trains_and_reports_json():
    code, out, elapsed = run("peers.demo", "--duration", "25", "--json", timeout=240, stdout_only=True)
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert {"initial_loss", "final_loss", "samples_per_second", "peers"} <= set(summary)
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["samples_per_second"] > 0
    assert sorted(p["stage"] for p in summary["peers"]) == [0, 0, 1, 1]
