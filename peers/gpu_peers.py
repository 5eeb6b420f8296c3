"""`swarm-peer --gpus all`: one peer per visible GPU under one command, each with its own device, identity and port.

Each peer is a swarm-peer process of its own (`--device cuda:N`), so each has its own DHT node, p2p daemon and
peer id: a stage's state, throughput and memory are per GPU, and balancing places each GPU where it helps most.
Identities persist (a key file per GPU), so a restarted command keeps its peer ids and the addresses others know:
`--identity PATH` becomes `PATH.gpuN`, and without it `$SWARM_CACHE_DIR/identity-gpuN.key`. A fixed listening port
P (in `--host-maddrs`, and `--metrics-port`) becomes P + N; port 0 stays 0 (any free port). Their output is printed
with a `[gpu N]` prefix; Ctrl-C stops them all cleanly.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from peers import runtime
from swarm import lifetime
from swarm.files import cache_root
from swarm.local.processes import stop_peers

VALUE_FLAGS = ("--gpus", "--device", "--identity", "--metrics-port")  # flags replaced per GPU, with their value


def visible_gpus(spec: str) -> list[int]:
    """The GPU indices `--gpus` names: `all`, or a comma-separated list such as `0,2`; [] if torch sees none."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "all":
        return list(range(count))
    indices = [int(part) for part in spec.split(",")]
    return [index for index in indices if index < count]


def gpu_peer_args(argv: Sequence[str], index: int, identity_dir: Path) -> list[str]:
    """swarm-peer's flags for the peer of GPU `index`, from the command's own `argv`."""
    args, given = [], {}
    items = iter(argv)
    for item in items:
        name, _, inline = item.partition("=")
        if name in VALUE_FLAGS:
            given[name] = inline if inline else next(items, "")
            continue
        args.append(item)
    shifted = [_shift_port(arg, index) if arg.startswith("/ip") else arg for arg in args]
    identity = (
        f"{given['--identity']}.gpu{index}"
        if given.get("--identity")
        else str(identity_dir / f"identity-gpu{index}.key")
    )
    shifted += ["--device", f"cuda:{index}", "--identity", identity]
    if given.get("--metrics-port"):
        port = int(given["--metrics-port"])
        shifted += ["--metrics-port", str(port + index if port else 0)]
    return shifted


def _shift_port(maddr: str, index: int) -> str:
    """/ip4/0.0.0.0/tcp/31337 -> /ip4/0.0.0.0/tcp/<31337 + index>; port 0 stays 0."""
    return re.sub(r"/(tcp|udp)/(\d+)", lambda m: f"/{m[1]}/{int(m[2]) + index if int(m[2]) else 0}", maddr)


def run_gpu_peers(argv: Sequence[str], spec: str) -> int:
    """Start a peer per GPU and wait for them; the worst exit code. 2 (with one line) if torch sees no GPU."""
    gpus = visible_gpus(spec)
    if not gpus:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        seen = "torch sees no CUDA GPU on this machine" if count == 0 else f"this machine has GPUs 0 to {count - 1}"
        print(
            f"swarm-peer: error: --gpus {spec}: {seen}; run swarm-peer without --gpus to serve on the CPU "
            "(or check the NVIDIA driver and that torch was built for CUDA: python -c 'import torch; "
            "print(torch.cuda.is_available())')",
            file=sys.stderr,
        )
        return 2
    identity_dir = cache_root()
    identity_dir.mkdir(parents=True, exist_ok=True)
    children = []
    for index in gpus:
        command = [sys.executable, "-m", "peers.swarm_peer", *gpu_peer_args(argv, index, identity_dir)]
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=lifetime.child_environment(),
        )
        threading.Thread(target=_relay, args=(child, f"[gpu {index}] "), daemon=True).start()
        children.append(child)
    print(f"started {len(children)} peers, one per GPU ({', '.join(f'cuda:{i}' for i in gpus)})", flush=True)
    runtime.stop_by_keyboard_interrupt()  # from here a stop passes on to the peers, which stop cleanly
    try:
        return max(child.wait() for child in children)
    except KeyboardInterrupt:
        stop_peers(children)
        return 0


def _relay(child: subprocess.Popen, prefix: str) -> None:
    assert child.stdout is not None
    for line in iter(child.stdout.readline, b""):
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()
