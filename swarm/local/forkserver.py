"""Peers forked from a process that has imported them once: a peer's start without its 3-4 s of imports.

A peer process spends 3-4 s of CPU importing torch, hivemind and swarm before it does anything; a test suite that
starts some two hundred peers on two cores spends a tenth of its time there, and every waiting test waits for it.
The fork server is one process (per program that starts peers) that imports the peer's modules once and then
forks each peer from itself: the child becomes what `python -m MODULE ARGS` would be (its own session, its
output into a log file, its environment, its argv, `__main__`) and runs the module as the interpreter would,
exiting through the interpreter's exit (atexit handlers included). The server stays single-threaded, so that a
fork copies no lock that another thread holds.

The program that starts it talks to it over its stdin and stdout, one JSON line each way per peer; the server
reaps its children and writes each one's exit status into a file next to the peer's log, which ForkedProcess (a
subprocess.Popen for the calls the local tools make) reads. The server ends when its stdin closes: the program that
started it has ended, and its peers then stop as their parent is gone (swarm/lifetime.py).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from swarm import lifetime

PRELOAD = ("peers.swarm_peer",)  # what every peer imports first: torch, hivemind, swarm
REAP_EVERY = 0.02  # seconds between two looks for ended children


class ForkServer:
    """The client side: start() the server (it imports PRELOAD), then start_process() for each peer."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self.server, self.lock = cwd, None, threading.Lock()

    def start_process(
        self, module: str, args: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> ForkedProcess:
        exit_path = log_path.with_name(log_path.name + ".exit")
        exit_path.unlink(missing_ok=True)
        log_path.write_bytes(b"")  # there once this returns, as a Popen's log is
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "log": str(log_path)}
        with self.lock:
            server = self._running()
            server.stdin.write(json.dumps({**request, "exit": str(exit_path)}) + "\n")
            server.stdin.flush()
            answer = server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server ended (exit status {server.wait()})")
        return ForkedProcess(json.loads(answer)["pid"], exit_path, [module, *args])

    def start_in_background(self) -> None:
        """Start the server now, in a thread: its imports overlap with what the program does before its first peer."""

        def start() -> None:
            with self.lock:
                try:
                    self._running()
                except (OSError, RuntimeError):
                    pass  # start_process tries again, and raises

        threading.Thread(target=start, name="fork-server-start", daemon=True).start()

    def _running(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [sys.executable, "-m", __name__],
                cwd=self.cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # a terminal's Ctrl-C is the program's to handle: the server ends with it
            )
            if self.server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the fork server did not start (exit status {self.server.wait()})")
        return self.server

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()


class ForkedProcess:
    """A peer forked by the server, seen as the subprocess.Popen it replaces (pid, poll, wait, signals)."""

    def __init__(self, pid: int, exit_path: Path, args: list[str]) -> None:
        self.pid, self.exit_path, self.args, self.returncode = pid, exit_path, args, None

    def poll(self) -> int | None:
        if self.returncode is None and self.exit_path.exists():
            self.returncode = int(self.exit_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(REAP_EVERY)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # an ended child is a zombie until reaped: its pid cannot be someone else's yet
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ the server


def serve() -> str | None:
    """The server's loop; returns in a forked child only, with the module that child must run."""
    for module in PRELOAD:
        __import__(module)
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # a first optimizer imports torch._dynamo: 1-2 s more
    if threading.active_count() != 1:  # a fork would copy locks that other threads hold
        raise RuntimeError(f"importing {PRELOAD} started threads: {threading.enumerate()}")
    print("ready", flush=True)
    exits: dict[int, str] = {}  # pid -> the file its exit status goes to
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], REAP_EVERY)
        _reap(exits)
        if not readable:
            continue
        received = os.read(0, 1 << 16)
        if not received:  # the program that started this server has ended
            return None
        *lines, pending = (pending + received).split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(request)
                return request["module"]
            exits[pid] = request["exit"]
            print(json.dumps({"pid": pid}), flush=True)


def _reap(exits: dict[int, str]) -> None:
    while exits:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in exits:
            path = Path(exits.pop(pid))
            code = os.waitstatus_to_exitcode(status)  # -N for a signal, as subprocess reports it
            temporary = path.with_name(path.name + ".tmp")
            temporary.write_text(str(code))
            temporary.replace(path)


def _become(request: dict[str, Any]) -> None:
    """In the forked child: what `python -m MODULE ARGS` would be, with its output into the log."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if lifetime.PARENT_ENV in os.environ:  # it watches this server, its parent, which ends with the program
        os.environ[lifetime.PARENT_ENV] = str(os.getppid())
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # never the server's requests
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    forget_the_servers_shared_state()
    sys.argv = [request["module"], *request["args"]]  # runpy puts the module's path first, as `python -m` does


def forget_the_servers_shared_state() -> None:
    """Give a forked child its own copies of what the server's imports made to be shared between processes: hivemind's
    family locks (a sibling killed while it held one would otherwise keep every later peer's DHT from starting) and
    numpy's global random state (drawn once in the server)."""
    import numpy

    from swarm.dht import hivemind_futures

    hivemind_futures.start_a_new_family()
    numpy.random.seed()


if __name__ == "__main__":
    if (child_module := serve()) is not None:  # a forked child: run the module as `python -m` does, then exit
        import runpy

        sys.modules.pop(child_module, None)  # run afresh as __main__, as `python -m` runs a module not yet imported
        runpy.run_module(child_module, run_name="__main__", alter_sys=True)
