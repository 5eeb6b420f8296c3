"""Shared plumbing of the programs: logging, devices, the --join argument, signals."""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import torch

from swarm.dht import hivemind_futures
from swarm.errors import PeerStartError
from swarm.files import cache_root
from swarm.preflight.checks import no_cuda_reason
from swarm.preflight.probes import nvidia_driver


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def resolve_device(name: str) -> torch.device:
    """The device --device names (auto: a GPU torch can use, else the CPU, saying why when a GPU is there but
    unusable); PeerStartError, with the cause and the remedy, for one this machine cannot give."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        driver = nvidia_driver()
        if driver:  # a GPU is there, but this torch cannot use it: a volunteer would want to know
            print(f"computing on the CPU: {no_cuda_reason(torch.__version__, torch.version.cuda, driver)}", flush=True)
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        reason = no_cuda_reason(torch.__version__, torch.version.cuda, nvidia_driver())
        raise PeerStartError(f"--device {name} was asked for, but {reason}")
    if name.startswith("cuda:") and int(name.split(":")[1]) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise PeerStartError(
            f"--device {name}: this machine has {count} GPU{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})"
        )
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise PeerStartError("--device mps was asked for, but this torch has no MPS support; use --device auto or cpu")
    return torch.device(name)


JOIN_HELP = (
    "path or http(s) URL of the swarm's manifest (a URL ending in #<swarm id> is checked against it), "
    "or the multiaddr of any running peer of the swarm (it hands out the manifest)"
)


def add_join_argument(parser: argparse.ArgumentParser) -> None:
    """--join, the same in every program: a manifest's path or URL, or a running peer's multiaddr."""
    parser.add_argument("--join", required=True, metavar="MANIFEST", help=JOIN_HELP)


def install_stop_handlers(stop: asyncio.Event, hurry: asyncio.Event | None = None) -> None:
    """Ctrl-C, SIGTERM and SIGHUP (the terminal closed) set `stop`, so that the program shuts down cleanly; a second
    one sets `hurry` (if given): stop without waiting for others to take this peer's stages over."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set() and hurry is not None and not hurry.is_set():
            print("stopping now, without waiting for a handover; then finishing the work in flight", flush=True)
            hurry.set()
        elif stop.is_set():  # the first is being acted on; say so rather than look stuck
            print("already stopping: finishing the work in flight (at most about a minute)", flush=True)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
STOPPED = 130  # the exit status of a program stopped by Ctrl-C (128 + SIGINT), as shells report it


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop_at_once(name: str) -> Callable[[int, object], None]:
    """The handler of a stop during a start: one line and exit 130, from the handler itself.

    Raising KeyboardInterrupt is not enough there: inside asyncio.run, Python turns a Ctrl-C into a cancellation of
    the main task, which a start under way can absorb (a peer went on to serve after its Ctrl-C), and asyncio.run
    then waits for the threads its start had handed work to. What a half-made start leaves (its DHT process and
    p2pd) ends by itself once this process is gone (swarm/lifetime.py).
    """
    line = f"{name}: stopped\n".encode()

    def stop(signum: int, frame: object) -> None:
        try:
            sys.stdout.flush()
        except (OSError, RuntimeError, ValueError):  # a signal in the middle of a write, or a closed stdout
            pass
        os.write(2, line)
        os._exit(STOPPED)

    return stop


def stop_by_keyboard_interrupt() -> None:
    """For a program that cleans up on KeyboardInterrupt once started (swarm-monitor writes its history): from now on
    Ctrl-C, SIGTERM and SIGHUP raise it, as Python does for Ctrl-C."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def program(name: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """The main() of a program that starts a swarm node: until its event loop takes the signals over
    (install_stop_handlers, or stop_by_keyboard_interrupt), Ctrl-C, SIGTERM and SIGHUP at any moment of its start
    end it with one line and exit status 130, never a traceback; a file it cannot write is one line naming the path
    and the remedy (exit status 2)."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            stop = _stop_at_once(name)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, stop)
            try:
                hivemind_futures.start_memory_manager_deaf_to_terminal()
                return main(argv)
            except KeyboardInterrupt:
                print(f"{name}: stopped", file=sys.stderr, flush=True)
                sys.stdout.flush()
                # at once: an interrupt in the middle of a start can leave an event loop or a DHT process half
                # made, whose clean-up at exit prints noise or waits; the DHT process and its daemon end by
                # themselves when this process is gone (swarm/lifetime.py)
                os._exit(STOPPED)
            except OSError as e:
                if e.filename is None:  # not a file's: a bug or the network, which the program reports itself
                    raise
                print(f"{name}: error: {file_error_message(e)}", file=sys.stderr, flush=True)
                return 2

        return run

    return wrap


def file_error_message(error: OSError) -> str:
    """One line for a file or folder that could not be used: which, why, and what to do."""
    path = error.filename
    if error.errno in DISK_FULL:
        return disk_full_message(error, None)
    where = (
        f"the peer keeps its caches, identity and data under {cache_root()} (SWARM_CACHE_DIR) and its checkpoints "
        "under --checkpoint-dir"
    )
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on {path}: make it writable by this user, or point there elsewhere ({where})"
    if error.errno == errno.EROFS:
        return f"{path} is on a read-only file system: point there to a writable disk ({where})"
    return f"{error.strerror or error} ({path}): {where}; check that path"


def disk_full_message(error: OSError, checkpoint_dir: str | None) -> str:
    """What to do when a disk is full: where the peer writes, and how to move it."""
    where = f" ({error.filename})" if error.filename else ""
    checkpoints = checkpoint_dir or f"{cache_root()}/checkpoints"
    return (
        f"the disk is full{where}: the peer writes its dataset's tokens and caches under {cache_root()} and its "
        f"checkpoints under {checkpoints}; free some space there, or set SWARM_CACHE_DIR and --checkpoint-dir to a "
        "disk with room (swarm-peer --check says how much it needs)"
    )


PAUSE_SIGNAL, RESUME_SIGNAL = signal.SIGUSR1, signal.SIGUSR2


def install_pause_handlers(pause: Callable[[], Awaitable[None]], resume: Callable[[], Awaitable[None]]) -> None:
    """SIGUSR1 pauses the peer, SIGUSR2 resumes it: `kill -USR1 <pid>` (the peer's own process, whose id it
    prints at start; not its process group: the DHT's process and the p2p daemon would take the signal as a stop)."""
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task] = set()  # kept referenced until done

    def done(task: asyncio.Task) -> None:
        running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logging.getLogger("swarm.peer").error(f"pausing or resuming failed: {task.exception()!r}")

    def start(action: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.ensure_future(action())
        running.add(task)
        task.add_done_callback(done)

    loop.add_signal_handler(PAUSE_SIGNAL, start, pause)
    loop.add_signal_handler(RESUME_SIGNAL, start, resume)


# what the p2p daemon's connection to this process raises when the remote peer of an incoming stream went away
# before the daemon passed the stream on: hivemind's handler (p2p_daemon_bindings/control.py) does not catch it,
# so asyncio logs it as "Unhandled exception in client_connected_cb" with a traceback that reads like a crash
VANISHED_STREAM_ERRORS = (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError)


class VanishedStreams(logging.Filter):
    """Turns asyncio's error for an incoming stream whose peer vanished before it began into one debug line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if str(record.msg).startswith("Unhandled exception in client_connected_cb") and isinstance(
            error, VANISHED_STREAM_ERRORS
        ):
            logging.getLogger("swarm.p2p").debug(f"an incoming stream ended before it began: {error!r}")
            return False
        return True


def quiet_vanished_streams() -> None:
    """Install VanishedStreams on asyncio's logger, before the DHT's process starts (it inherits it): every other
    error asyncio logs is reported as before."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, VanishedStreams) for f in logger.filters):
        logger.addFilter(VanishedStreams())
