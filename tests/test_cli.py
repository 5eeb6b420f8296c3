"""swarm-peer and swarm-demo: bad user input gets a clear one-paragraph error, quickly, never a traceback.

Input refused before anything starts (flags, manifests, stages) is checked in this process; what the programs
meet later (addresses, peers, a demo's run) by running them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import ROOT, live_processes, tiny_manifest_dict, wait_until
from peers.swarm_demo import main as demo_main
from peers.swarm_peer import main as peer_main
from peers.swarm_peer import parse_args as peer_parse_args
from swarm.local import processes

pytestmark = pytest.mark.integration


def run(
    module: str, *args: str, timeout: float = 60, stdout_only: bool = False, env: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """Run a program to its end: its exit status, what it printed and how long it took. swarm-peer starts as the
    suite's peers do (forked from a process that has imported it, unless SWARM_TEST_FORK_PEERS=0), its stdout and
    stderr into one log."""
    start = time.monotonic()
    if module == "peers.swarm_peer" and not stdout_only:
        with tempfile.TemporaryDirectory(prefix="swarm-cli-") as folder:
            peer = processes.start_peer(list(args), Path(folder) / "peer.log", env=env)
            try:
                code = peer.process.wait(timeout=timeout)
            finally:
                processes.kill_peer(peer)
            return code, peer.output(), time.monotonic() - start
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


def in_process(module: str, args: list[str], capsys) -> tuple[int, str]:
    """Parse a program's command line in this process (flags are refused before anything starts, so a process of
    its own, seconds of imports apiece, shows nothing more): its exit status and what it printed. swarm-demo's
    main() runs until its manifest is read: it starts its DHT only after that."""
    try:
        if module == "peers.swarm_peer":
            peer_parse_args(args)  # returns if it accepts the flags: then there is no exit status
            code = None
        else:
            code = demo_main(args)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_help_shows_examples(capsys):
    for module in ("peers.swarm_peer", "peers.swarm_demo"):
        code, out = in_process(module, ["--help"], capsys)
        assert code == 0 and "examples:" in out


@pytest.mark.parametrize(
    "manifest,flags,expected,process",
    [
        (None, [], "does not exist", False),
        ({"model": {"heads": 3}}, [], "'model.heads'", False),
        ({}, ["--stage", "7"], "--stage 7", False),
        ({}, ["--host-maddrs", "/ip4/not-an-ip/tcp/0"], "--host-maddrs", True),
        ({"balancing": {"min_gain": -1}}, [], "'balancing.min_gain'", False),
        ({}, ["--max-memory", "50MB"], "but this peer has", True),
    ],
    ids=["missing-manifest", "bad-field", "stage-out-of-range", "bad-host-maddr", "bad-balancing", "no-stage-fits"],
)
def test_bad_input_gets_a_clear_error(tmp_path, capsys, manifest, flags, expected, process):
    """A manifest that is missing or bad, or a stage it does not have, is refused before anything starts: in this
    process (swarm-peer's main()); a bad address as swarm-peer, a process of its own, meets it."""
    path = tmp_path / "m.json"
    if manifest is not None:
        path.write_text(json.dumps(tiny_manifest_dict(**manifest)))
    args = ["--join", str(path), "--no-trainer", *flags]
    if process:
        code, out, elapsed = run("peers.swarm_peer", *args)
    else:
        begin = time.monotonic()
        code = peer_main(args)
        captured = capsys.readouterr()
        out, elapsed = captured.out + captured.err, time.monotonic() - begin
    assert code == 2
    assert expected in out
    assert "Traceback" not in out
    assert elapsed < 30


@pytest.mark.parametrize(
    "module,flags,expected",
    [
        ("peers.swarm_peer", ["--threads", "0"], "--threads must be at least 1"),
        ("peers.swarm_peer", ["--duration", "0"], "--duration must be positive"),
        ("peers.swarm_peer", ["--status-every", "-1"], "--status-every must be positive"),
        ("peers.swarm_peer", ["--device", "tpu"], "'tpu' is not a device: write auto, cpu, cuda, cuda:N or mps"),
        ("peers.swarm_peer", ["--throughput", "fast"], "--throughput must be auto, eval or a number"),
        ("peers.swarm_peer", ["--throughput", "-3"], "--throughput must be auto, eval or a number"),
        ("peers.swarm_peer", ["--throughput", "nan"], "--throughput must be auto, eval or a number"),
        ("peers.swarm_peer", ["--throughput", "1e300"], "--throughput must be auto, eval or a number"),
        ("peers.swarm_peer", ["--bandwidth", "0"], "--bandwidth must be a positive number"),
        ("peers.swarm_peer", ["--simulated-speed", "2"], "--simulated-speed must be in (0, 1]"),
        ("peers.swarm_peer", ["--simulated-speed", "0"], "--simulated-speed must be in (0, 1]"),
        ("peers.swarm_peer", ["--public-name", "x" * 65], "--public-name must be at most 64"),
        ("peers.swarm_peer", ["--public-name", "bell\a"], "--public-name must be at most 64"),
        ("peers.swarm_peer", ["--no-listen", "--new-swarm"], "--no-listen: nobody could join through this peer"),
        ("peers.swarm_peer", ["--metrics-host", "0.0.0.0"], "--metrics-host needs --metrics-port"),
        ("peers.swarm_peer", ["--metrics-port", "70000"], "--metrics-port must be a port number"),
        ("peers.swarm_peer", ["--trainer-only", "--stage", "0"], "--trainer-only trains and serves no stage"),
        ("peers.swarm_peer", ["--trainer-only", "--no-trainer"], "--trainer-only trains and serves no stage"),
        ("peers.swarm_peer", ["--max-memory", "lots"], "cannot read 'lots' as an amount of memory"),
        ("peers.swarm_demo", ["--peers", "0"], "--peers must be at least 1"),
        ("peers.swarm_demo", ["--duration", "-5"], "--duration must be positive"),
        ("peers.swarm_demo", ["--peers", "1"], "each needs a peer"),
    ],
)
def test_bad_flags_are_refused(tmp_path, capsys, module, flags, expected):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(tiny_manifest_dict()))
    args = ["--join", str(path), *flags] if module == "peers.swarm_peer" else flags
    code, out = in_process(module, args, capsys)
    assert code == 2
    assert expected in out
    assert "Traceback" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_asked_for_on_a_machine_without_one_is_refused_in_one_line(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(tiny_manifest_dict()))
    code, out, _ = run(
        "peers.swarm_peer", "--join", str(path), "--device", "cuda:1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"
    )
    assert code == 2 and "--device cuda:1 was asked for, but torch sees no CUDA GPU" in out, out
    assert "Traceback" not in out


def test_a_port_in_use_is_named_with_what_to_do(tmp_path):
    """Even with initial peers in the manifest (once reported as "no initial peer could be reached")."""
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(tiny_manifest_dict(initial_peers=[dead])))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, _ = run("peers.swarm_peer", "--join", str(path), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert code == 2
    assert f"port {port} of /ip4/127.0.0.1/tcp/{port} is in use by another program" in out, out
    assert "choose another port in --host-maddrs" in out and "Traceback" not in out


def _peer_with_cache_on_tmpfs(tmp_path, options: str) -> tuple[int, str]:
    """swarm-peer run to its end with SWARM_CACHE_DIR on a tmpfs mounted with `options` (skipped without root): its
    exit status and what it printed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        path = tmp_path / "m.json"
        path.write_text(json.dumps(tiny_manifest_dict()))
        env = {"SWARM_CACHE_DIR": str(disk / "cache")}
        code, out, _ = run(
            "peers.swarm_peer", "--join", str(path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", timeout=90, env=env
        )
        return code, out
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_a_full_disk_is_named_with_what_to_do(tmp_path):
    """The trainer's dataset cache does not fit in a 256 kB file system."""
    code, out = _peer_with_cache_on_tmpfs(tmp_path, "size=256k")
    disk = tmp_path / "disk"
    assert code == 2, out
    assert f"swarm-peer: error: the disk is full: the peer writes its dataset's tokens and caches under {disk}" in out
    assert "set SWARM_CACHE_DIR and --checkpoint-dir to a disk with room" in out and "Traceback" not in out


def test_a_read_only_cache_is_named_with_what_to_do(tmp_path):
    """The cache folder is on a read-only file system."""
    code, out = _peer_with_cache_on_tmpfs(tmp_path, "ro,size=64k")
    disk = tmp_path / "disk"
    assert code == 2, out
    error = out.strip().splitlines()[-1]
    assert error.startswith("swarm-peer: error:") and str(disk / "cache") in error, out
    assert "read-only file system" in error.lower() and "SWARM_CACHE_DIR" in error and "Traceback" not in out, out
    assert [line for line in out.splitlines() if "error" in line.lower()] == [error], out  # one line, the last


KNOWN_START_STOP_FAULTS = {
    # under load the check can finish (the mute initial peer refused) before the Ctrl-C arrives: a race of the test
    "ctrl-c-during-check": "under load the check may end before the Ctrl-C reaches it (a race of this test)",
}


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(how, marks=pytest.mark.xfail(reason=KNOWN_START_STOP_FAULTS[how], strict=False))
        if how in KNOWN_START_STOP_FAULTS
        else how
        for how in ("ctrl-c", "sigterm", "ctrl-c-during-check")
    ],
)
def test_a_stop_while_starting_is_one_line_and_exit_130(tmp_path, how):
    """A volunteer who changes their mind while the peer starts (or while --check runs) sees one line, never a
    traceback, and nothing of the peer stays behind (its DHT process and p2pd watch it: swarm/lifetime.py)."""
    check = how == "ctrl-c-during-check"
    # a check joins through an initial peer: one that takes the connection and never answers keeps it busy
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]
    mute = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(tiny_manifest_dict(initial_peers=[mute] if check else [])))
    args = ["--join", str(path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    peer = processes.start_peer(args + (["--check"] if check else []), tmp_path / "peer.log")
    try:
        # the start is under way: a check's first step, or the peer's first line (before its DHT starts)
        peer.wait_for("joining the DHT" if check else "starting a new swarm", 60)
        printed = peer.output()  # where the start was when the signal left: what a hang report needs
        if how == "sigterm":
            peer.process.send_signal(signal.SIGTERM)
        else:
            peer.signal_group(signal.SIGINT)  # a terminal's Ctrl-C
        try:
            code = peer.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running 30 s after the signal; it had printed:\n{printed}\n... and then:\n{peer.tail()}"
            ) from None
        assert code == 130, peer.tail()
        out = peer.output()  # stopped before the peer ran ("stopped"), or while it joined (its clean stop)
        assert "swarm-peer: stopped" in out or "stopped cleanly" in out, out
        assert "Traceback" not in out and "Exception ignored" not in out, out
        # whatever it had started by then (its DHT process and p2pd leave its group, not its session)

        def session() -> list[int]:
            return [pid for pid, fields in processes.live_processes().items() if int(fields[3]) == peer.pid]

        wait_until(lambda: not session(), 30, "the processes the peer started to end", every=0.5)
    finally:
        peer.kill()
        silent.close()


def test_unreachable_initial_peers_fail_fast(tmp_path):
    # a valid address on loopback where nobody listens
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(tiny_manifest_dict(initial_peers=[dead])))
    code, out, elapsed = run("peers.swarm_peer", "--join", str(path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
    assert code == 2
    assert "no initial peer could be reached" in out
    assert "Traceback" not in out
    assert elapsed < 30


@pytest.mark.slow(90)
def test_demo_trains_and_reports_json_with_its_monitor():
    """swarm-demo --monitor 0: the monitor's URL is printed, its page answers while the demo trains, and it stops
    with the demo."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "peers.swarm_demo", "--duration", "10", "--json", "--monitor", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        url = None
        for line in demo.stderr:  # the demo's console is stderr with --json
            if match := re.search(r"the monitor's page: (http://127\.0\.0\.1:\d+/)", line):
                url = match.group(1)
                break
        assert url, "swarm-demo --monitor printed no URL"
        with urllib.request.urlopen(url + "api/v1/state", timeout=10) as response:
            assert json.loads(response.read())["swarm"]["name"] == "swarm-demo"
        threading.Thread(target=demo.stderr.read, daemon=True).start()  # keep the pipe from filling up
        out, _ = demo.communicate(timeout=240)
        assert demo.returncode == 0, out
    finally:
        if demo.poll() is None:
            processes.signal_peer(demo.pid, signal.SIGKILL)
            demo.wait(timeout=10)
    summary = json.loads(out.strip().splitlines()[-1])
    assert {"initial_loss", "final_loss", "samples_per_second", "peers"} <= set(summary)
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["samples_per_second"] > 0
    assert sorted(p["stage"] for p in summary["peers"]) == [0, 0, 1, 1]
    with pytest.raises(OSError):  # the monitor stopped with the demo
        urllib.request.urlopen(url + "healthz", timeout=5)


def _children(pid: int, module: bytes) -> list[int]:
    """Child processes of `pid` that run `module` (swarm-demo's monitor)."""
    found = []
    for child, parent, _ in live_processes():
        try:
            if parent == pid and module in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _demo_peers(pid: int) -> dict[int, Path]:
    """The demo's peers, by the log their output goes to (peer<k>.log): descendants of the demo, forked from its fork
    server (swarm/local/forkserver.py), whose command line is the server's."""
    found = {}
    for child in processes.peer_processes(pid):
        try:
            log = Path(os.readlink(f"/proc/{child}/fd/1"))
        except OSError:
            continue
        if log.name.startswith("peer") and log.suffix == ".log":
            found[child] = log
    return found


def _serving(folder: Path | None) -> int:
    """How many of the demo's peers serve their stage, by their logs."""
    logs = folder.glob("peer*.log") if folder is not None else []
    return sum("serving stage" in log.read_text(errors="replace") for log in logs)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigkill"])
def test_a_stopped_demo_leaves_no_process_behind(stop):
    """A terminal's Ctrl-C stops the demo, which stops its peers; a SIGKILL (a service manager's last word, an
    out-of-memory kill) cannot be handled, and still the peers and the monitor, their DHT processes and p2pd
    daemons stop, because each watches the process that started it (swarm/lifetime.py)."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "peers.swarm_demo", "--duration", "300", "--monitor", "0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    children: list[int] = []
    try:

        def started() -> list[int]:
            nonlocal children
            children = [*_demo_peers(demo.pid), *_children(demo.pid, b"peers.swarm_monitor")]
            return children if len(children) == 5 else []

        wait_until(started, 60, "the demo's 4 peers and its monitor")
        folder = next(iter(_demo_peers(demo.pid).values())).parent
        wait_until(lambda: _serving(folder) == 4, 120, "the demo's 4 peers to serve")
        # the demo's processes but itself: its DHT process and p2pd, and each child with its DHT process and p2pd

        def everything() -> dict[int, str]:
            found = processes.peer_processes(demo.pid)
            return {pid: fields[19] for pid, fields in found.items() if pid != demo.pid} if len(found) > 17 else {}

        seen = wait_until(everything, 30, "the DHT process and p2pd of the demo and of each of its children")
        if stop == "ctrl-c":
            os.killpg(demo.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
            assert demo.wait(timeout=60) == 130
        else:
            demo.kill()
            demo.wait(timeout=10)
        # a clean stop each (announce, hand over, checkpoint); past lifetime.FORCE_AFTER they are killed
        wait_until(lambda: not processes.still_alive(seen), 90, "every process of the demo to end", every=0.5)
    finally:
        for pgid in [demo.pid, *children]:
            processes.signal_peer(pgid, signal.SIGKILL)
        demo.wait(timeout=10)


def test_new_swarm_needs_a_manifest_file_to_write(capsys):
    code, out = in_process("peers.swarm_peer", ["--join", "http://127.0.0.1:9/swarm.json", "--new-swarm"], capsys)
    assert code == 2 and "--new-swarm writes this peer's addresses into the manifest" in out
    assert "Traceback" not in out


def test_a_check_fraction_outside_0_to_1_is_refused(capsys):
    for value in ("-0.1", "1.5", "nan"):
        code, out = in_process("peers.swarm_peer", ["--join", "m.json", "--check-fraction", value], capsys)
        assert code == 2 and "--check-fraction must be between 0 and 1" in out, (value, out)
    code, _ = in_process("peers.swarm_peer", ["--join", "m.json", "--check-fraction", "0"], capsys)
    assert code is None  # 0 turns the checks off


class SlowJoin:
    """A peer whose join takes as long as a large stage's state over a home link: it never ends by itself."""

    joining = "taking over a stage's state"
    cancelled = False

    async def join(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def test_a_long_join_says_what_it_does_and_ctrl_c_stops_it(capsys):
    from peers.swarm_peer import joined

    async def run() -> tuple[bool, float, SlowJoin]:
        peer, stop = SlowJoin(), asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)  # Ctrl-C, half a second into the join
        begin = time.monotonic()
        result = await joined(peer, stop, every=0.2)
        return result, time.monotonic() - begin, peer

    result, took, peer = asyncio.run(run())
    out = capsys.readouterr().out
    assert result is False and took < 30 and peer.cancelled  # not the hour the join would have taken
    assert "joining: taking over a stage's state (0 s so far)" in out and "stopping while joining the swarm" in out
