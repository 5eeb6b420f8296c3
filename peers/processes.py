"""swarm-peer processes seen from outside, for the programs that start them (swarm-demo, the benchmarks, the
tests): which processes belong to a peer, their memory and socket files, and stopping or killing a peer whole.

A peer is started in a session of its own, so its process group holds the peer, its hivemind DHT process, its
averager process and its p2pd daemons; torch_shm_manager (shared memory for the averager) starts a session of
its own, so a peer's processes are its group plus their descendants outside it. A killed p2pd cannot remove
its socket file in the temporary folder; whoever kills a peer removes them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

GROUP_WAIT = 5.0  # seconds for a killed group's processes to disappear


def live_processes() -> dict[int, list[str]]:
    """The fields after the name in /proc/PID/stat (state, ppid, pgid, ...) of every process but zombies."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z":
            found[int(stat.parent.name)] = fields
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    return [pid for pid, fields in live_processes().items() if int(fields[2]) == pgid]


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def peer_processes(pgid: int) -> dict[int, list[str]]:
    """The peer's processes: its group and their descendants outside it."""
    every = live_processes()
    found = {pid: fields for pid, fields in every.items() if int(fields[2]) == pgid}
    while more := {pid: fields for pid, fields in every.items() if int(fields[1]) in found and pid not in found}:
        found.update(more)
    return found


def memory_mb(pgid: int) -> dict[str, float]:
    """MB of resident memory (VmRSS) of each of the peer's processes, by '<name> <pid>'."""
    found = {}
    for pid in peer_processes(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        name = re.search(r"^Name:\s*(\S+)", status, re.M)
        rss = re.search(r"^VmRSS:\s*(\d+) kB", status, re.M)
        if name and rss:  # a process that is exiting has no VmRSS
            found[f"{name.group(1)} {pid}"] = int(rss.group(1)) / 1024
    return found


def socket_files(pgid: int) -> set[Path]:
    """Unix socket files that the peer's processes have open."""
    inodes = set()
    for pid in peer_processes(pgid):
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.add(Path(fields[7]))
    return paths


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def kill_peer(process: subprocess.Popen, sockets: set[Path] | None = None) -> None:
    """SIGKILL the peer's whole group at once, as if its machine died, and its processes outside the group; then
    remove the socket files the kill left (`sockets`, if taken before a SIGTERM)."""
    pgid = process.pid  # the session leader's pid is the group id
    sockets = socket_files(pgid) if sockets is None else sockets
    # descendants in other groups, by (pid, start time): a pid reused meanwhile is not theirs
    strays = {(pid, fields[19]) for pid, fields in peer_processes(pgid).items() if int(fields[2]) != pgid}
    signal_group(pgid, signal.SIGCONT)  # a stopped (SIGSTOP) group must run to die
    signal_group(pgid, signal.SIGKILL)
    alive = live_processes()
    for pid, start in strays:  # only if still the same process (a pid may have been reused)
        if pid in alive and alive[pid][19] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + GROUP_WAIT
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in sockets:
        path.unlink(missing_ok=True)


def stop_peers(processes: Sequence[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM every peer (a clean shutdown: announce offline, checkpoint), wait up to `grace` seconds in all,
    then kill whatever is left of each."""
    sockets = [socket_files(p.pid) for p in processes]  # a daemon killed below cannot remove its own
    for process in processes:
        if process.poll() is None:
            signal_group(process.pid, signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process, files in zip(processes, sockets):
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_peer(process, files)
