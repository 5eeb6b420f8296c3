"""swarm-peer processes seen from outside, for the programs that start them (swarm-demo, the benchmarks, the
tests): starting a peer, waiting for what it prints (a pattern, a JSON line), reading its JSON lines (status lines
and events), which processes belong to it, their memory and socket files, and stopping or killing it whole.

A peer is started in a session of its own, so its process group holds the peer, its hivemind DHT process, its
averager process and its p2pd daemons, and its DHT process starts a group of its own (swarm/dht/node.py), so a
peer's processes are its group plus their descendants outside it. A killed p2pd cannot remove
its socket file in the temporary folder; whoever kills a peer removes them.

With --json a peer prints one JSON object per line: status lines (every --status-every seconds, no "event" key)
and events (the moment they happen, with key "event": see swarm/events.py for their fields).
"""

from __future__ import annotations

import atexit
import codecs
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarm import lifetime
from swarm.local.forkserver import PRELOAD, ForkedProcess, ForkServer

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/adversaries/ runs from there)
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
MADDR = r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)"  # a loopback address as a peer prints it
PEER_ID = r"peer ((?:12D3|Qm)\w+)"  # as a peer prints its id (Qm: an RSA key, from --identity)
POLL = 0.2  # seconds between two looks at a peer's log
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
    """The process group only, as a terminal's Ctrl-C reaches it: not the peer's DHT process and p2pd daemon, which
    run in a group of their own (swarm/dht/node.py, GroupedDHT)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def signal_peer(pgid: int, sig: int) -> None:
    """Every process of the peer: its group, and the groups of its processes outside it (the DHT process and its
    p2pd daemon). SIGSTOP stalls the peer as a frozen machine would."""
    groups = {pgid} | {int(fields[2]) for fields in peer_processes(pgid).values()}
    for group in sorted(groups, key=lambda g: g != pgid):
        signal_group(group, sig)


def still_alive(seen: dict[int, str]) -> bool:
    """Whether any of the processes `seen` (pid -> start time, from peer_processes) still runs: a pid reused
    meanwhile by another process is not one of them."""
    alive = live_processes()
    return any(pid in alive and alive[pid][19] == start for pid, start in seen.items())


def _popen(process: subprocess.Popen | PeerProcess) -> subprocess.Popen | ForkedProcess:
    return process.process if isinstance(process, PeerProcess) else process


def kill_peer(process: subprocess.Popen | PeerProcess, sockets: set[Path] | None = None) -> None:
    """SIGKILL the peer's whole group at once, as if its machine died, and its processes outside the group; then
    remove the socket files the kill left (`sockets`, if taken before a SIGTERM)."""
    process = _popen(process)
    pgid = process.pid  # the session leader's pid is the group id
    sockets = socket_files(pgid) if sockets is None else sockets
    # descendants in other groups, by (pid, start time): a pid reused meanwhile is not theirs
    strays = {(pid, fields[19]) for pid, fields in peer_processes(pgid).items() if int(fields[2]) != pgid}
    signal_peer(pgid, signal.SIGCONT)  # a stopped (SIGSTOP) peer must run to die
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


STOPPED = "stopped cleanly"  # what a peer prints once its clean shutdown is done (announced offline, checkpointed)
EXIT_AFTER_STOPPED = 2.0  # seconds a peer that printed STOPPED gets to exit before it is killed


def stop_peers(processes: Sequence[subprocess.Popen | PeerProcess], grace: float = 20.0) -> None:
    """SIGTERM every peer (a clean shutdown: announce offline, checkpoint), wait up to `grace` seconds in all,
    then kill whatever is left of each. A peer started here (a PeerProcess) that printed that its shutdown is
    done gets EXIT_AFTER_STOPPED seconds more to exit, not the whole grace: the replicas of a stage stopped
    together have been seen to hang in their exit after that, until killed."""
    peers = [p if isinstance(p, PeerProcess) else None for p in processes]
    processes = [_popen(p) for p in processes]
    sockets = [socket_files(p.pid) for p in processes]  # a daemon killed below cannot remove its own
    for process in processes:
        if process.poll() is None:
            signal_peer(process.pid, signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    stopped_at: dict[int, float] = {}  # by pid: when the peer was seen to have printed STOPPED
    waiting = list(range(len(processes)))
    while waiting and time.monotonic() < deadline:
        now = time.monotonic()
        for k in list(waiting):
            if processes[k].poll() is not None:
                waiting.remove(k)
            elif peers[k] is not None and STOPPED in peers[k].output()[-200:]:
                if now - stopped_at.setdefault(k, now) >= EXIT_AFTER_STOPPED:
                    waiting.remove(k)
        time.sleep(0.05)
    for process, files in zip(processes, sockets):
        kill_peer(process, files)


# ------------------------------------------------------------------------------------------ starting a peer


class PeerFailed(RuntimeError):
    """A peer exited, or did not print what was waited for in time; the message ends with its log's end."""


def loopback_args(
    manifest_path: Path | str, stage: int | None = None, trainer: bool = True, port: int = 0
) -> list[str]:
    """swarm-peer flags for a peer of a swarm on this machine: joins `manifest_path`, listens on loopback only
    (at `port`; 0: a free one), one torch thread, JSON lines; serves `stage` (or chooses one itself if None)."""
    args = ["--join", str(manifest_path), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--threads", "1", "--json"]
    args += [] if stage is None else ["--stage", str(stage)]
    return args + ([] if trainer else ["--no-trainer"])


def free_ports(count: int) -> list[int]:
    """Ports that are free on 127.0.0.1 now (all bound at once, so that they differ): for peers that must know
    their port before they start (a restarted peer keeps its address; a dead initial peer of a test)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


_forkserver: ForkServer | None = None


def fork_peers_from_a_preloaded_process(start_now: bool = False) -> None:
    """From now on, start_peer forks each peer from a process that has imported the peer's modules once
    (swarm/local/forkserver.py) instead of starting a new interpreter: 3-4 s of CPU less per peer. `start_now`:
    start that process at once, in the background, rather than at the first peer."""
    global _forkserver
    if _forkserver is None:
        _forkserver = ForkServer(ROOT)
        atexit.register(_forkserver.close)
        if start_now:
            _forkserver.start_in_background()


def start_peer(
    args: Sequence[str],
    log_path: Path,
    cache_dir: Path | None = None,
    env: dict[str, str] | None = None,
    module: str = "peers.swarm_peer",
) -> PeerProcess:
    """Start `python -m peers.swarm_peer ARGS` (or another `module` with swarm-peer's flags) in a session (process group) of its own, unbuffered, its stdout and
    stderr into `log_path`; with `cache_dir`, its measured throughputs are cached there (SWARM_CACHE_DIR), not in
    the user's cache. Its own session: a Ctrl-C in a terminal reaches only the program that started it, which
    then stops it cleanly (stop_peers), and a kill takes its DHT process and p2pd daemon with it."""
    # it stops when this process is gone, however this process ends (swarm/lifetime.py)
    environment = lifetime.child_environment({**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    if cache_dir is not None:
        environment["SWARM_CACHE_DIR"] = str(cache_dir)
    if _forkserver is not None and module in PRELOAD:  # another module may change what it imports (tests/adversaries/)
        return PeerProcess(_forkserver.start_process(module, list(args), environment, Path(log_path), ROOT), log_path)
    with open(log_path, "wb") as log:  # the child keeps its own copy of the file descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=environment,
        )
    return PeerProcess(process, Path(log_path))


def start_local_peer(
    manifest_path: Path,
    stage: int | None,
    log_path: Path,
    trainer: bool = True,
    extra: Sequence[str] = (),
    cache_dir: Path | None = None,
) -> PeerProcess:
    """A swarm-peer of a swarm on this machine as swarm-demo and the benchmarks start them (loopback_args): a
    status line every 5 s, warnings only, and checkpoints in the log's folder unless `extra` names a folder (a
    demo or a benchmark starts from scratch: never from an earlier run's state)."""
    args = loopback_args(manifest_path, stage, trainer) + ["--status-every", "5", "--log-level", "WARNING"]
    if "--checkpoint-dir" not in extra:
        args += ["--checkpoint-dir", str(Path(log_path).parent / "checkpoints")]
    return start_peer([*args, *extra], log_path, cache_dir)


class PeerProcess:
    """A started swarm-peer process: its log, what it printed, and stopping or killing it whole."""

    def __init__(self, process: subprocess.Popen | ForkedProcess, log_path: Path):
        self.process = process
        self.log_path = log_path
        self._data = bytearray()  # the log as read so far
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # _data decoded
        self._parsed = 0  # bytes of _data whose complete lines are parsed into _json
        self._json: list[dict[str, Any]] = []
        self._seen: dict[int, str] = {}  # its processes seen so far (pid -> start time): see processes()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pgid(self) -> int:
        return self.process.pid  # the session leader's pid is the group id

    def poll(self) -> int | None:
        return self.process.poll()

    # -------------------------------------------------------------------------------------- its output

    def _read(self) -> None:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(len(self._data))
                new = log.read()
        except FileNotFoundError:
            return
        self._data += new
        self._text += self._decoder.decode(new)

    def output(self) -> str:
        """Everything the peer printed so far."""
        self._read()
        return self._text

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def json_lines(self) -> list[dict[str, Any]]:
        """Every complete JSON-object line printed so far (status lines and events), in order."""
        self._read()
        end = self._data.rfind(b"\n") + 1
        if end > self._parsed:
            for line in bytes(self._data[self._parsed : end]).splitlines():
                if line.startswith(b"{"):
                    try:
                        value = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(value, dict):
                        self._json.append(value)
            self._parsed = end
        return list(self._json)

    def status_lines(self) -> list[dict[str, Any]]:
        """The JSON status lines (printed every --status-every seconds): JSON lines without an "event" key."""
        return [line for line in self.json_lines() if "event" not in line]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The events printed so far (of `kind` only, if given), in order: see swarm/events.py."""
        return [line for line in self.json_lines() if "event" in line and (kind is None or line["event"] == kind)]

    # ---------------------------------------------------------------------------------------- waiting

    def _wait(self, found: Callable[[], Any], what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            exited = self.process.poll()
            result = found()  # once more after an exit: it may have printed it last
            if result is not None:
                return result
            if exited is not None:
                raise PeerFailed(f"the peer exited ({exited}) before {what}; its log ends:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise PeerFailed(f"timed out after {timeout:g}s waiting for {what}; its log ends:\n{self.tail()}")
            time.sleep(POLL)

    def wait_for(self, pattern: str, timeout: float = 60.0, flags: int = 0) -> re.Match:
        """The first match of the regular expression `pattern` in the peer's output, once there is one."""
        return self._wait(lambda: re.search(pattern, self.output(), flags), repr(pattern), timeout)

    def wait_for_json(
        self, accept: Callable[[dict[str, Any]], bool], timeout: float = 60.0, what: str = "a JSON line"
    ) -> dict[str, Any]:
        """The first JSON line (status line or event) that `accept` accepts, once there is one."""
        return self._wait(lambda: next((j for j in self.json_lines() if accept(j)), None), what, timeout)

    def wait_for_event(self, kind: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        """The first event of `kind` whose fields have the values given, once there is one."""

        def accept(line: dict[str, Any]) -> bool:
            return line.get("event") == kind and all(line.get(k) == v for k, v in fields.items())

        return self.wait_for_json(accept, timeout, f"a {kind!r} event {fields or ''}".strip())

    def maddr(self, timeout: float = 60.0) -> str:
        """The loopback multiaddr it printed (its DHT is up)."""
        found = self.wait_for(MADDR, timeout).group(1)
        self.processes()  # its DHT process and p2pd run now: remembered, to be found once it exits
        return found

    def peer_id(self, timeout: float = 60.0) -> str:
        return self.wait_for(PEER_ID, timeout).group(1)

    # ----------------------------------------------------------------------------------------- ending

    def signal_group(self, sig: int) -> None:
        """Send a signal to the peer's process group, as a terminal's Ctrl-C (SIGINT) reaches it."""
        self.processes()
        signal_group(self.pgid, sig)

    def signal_all(self, sig: int) -> None:
        """Send a signal to every process of the peer (its DHT process and p2pd too): SIGSTOP stalls it."""
        self.processes()
        signal_peer(self.pgid, sig)

    def processes(self) -> dict[int, str]:
        """The peer's processes seen so far (pid -> start time), its DHT process and p2pd daemon included, which
        live in a group of their own: once the peer has exited they can no longer be found as its descendants."""
        self._seen.update({pid: fields[19] for pid, fields in peer_processes(self.pgid).items()})
        return dict(self._seen)

    def group_alive(self) -> bool:
        """Whether any of the peer's processes (its DHT process and p2pd too) still runs; zombies do not count."""
        return group_alive(self.pgid) or still_alive(self.processes())

    def socket_files(self) -> set[Path]:
        """Unix socket files that the peer's processes (python, DHT process, p2pd) have open."""
        self.processes()
        return socket_files(self.pgid)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL the whole group; remove socket files a kill leaves."""
        stop_peers([self.process], grace)

    def kill(self, sockets: set[Path] | None = None) -> None:
        """SIGKILL the peer, its DHT process and its p2pd daemon at once, as if the machine died."""
        kill_peer(self.process, sockets)
