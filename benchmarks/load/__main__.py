"""Load benchmark: one stage peer under many concurrent trainers, past its queue limit.

    python -m benchmarks.load [--duration 60] [--clients 8] [--concurrency 16] [--manifest PATH]

Starts one `swarm-peer` process serving the last stage (no trainer, 1 thread, loopback only), then sends it
training forwards ([inputs, targets]; the last stage runs backward and an optimizer step within forward) over
the real RPC path: `--clients` hivemind P2P identities in this process, each with `--concurrency` tasks that
send one request after another. By default they keep 128 requests in flight, twice the peer's queue limit
(swarm.server.admission.MAX_PENDING_REQUESTS), and each client no more than the peer's limit per caller, so that part of
them get 'busy' replies because the queue is full; a task that gets one waits as a trainer does when no other
peer of the stage is free (swarm.client.pipeline.NO_PEER_WAIT), then sends again.

Prints one JSON line: requests sent, served, busy (and the peer's reasons), other error replies by code and
exceptions by type (the goal is no error but 'busy'), served per second, p50/p99 latency of served requests
and of busy replies (which must be prompt), and the memory of the peer's processes (its process group: the
peer, its DHT and averager processes, its p2pd daemon),
the sum of their VmRSS sampled every 0.5 s: before the load, at its peak, and the mean of the first and last
20% of the run, to show whether it grows. Progress goes to stderr every 10 seconds. The default model is the
tiny preset's (the demo's, 2 stages); --keep-logs keeps the peer's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import benchmark_manifest, stop_on_sigterm
from benchmarks.load.clients import run_load
from peers import runtime
from swarm.client.pipeline import NO_PEER_WAIT
from swarm.local import processes
from swarm.local.processes import PeerProcess, memory_mb, peer_processes, stop_peers
from swarm.server import admission
from swarm.server.admission import MAX_PENDING_REQUESTS

MEMORY_PERIOD = 0.5  # seconds between two samples of the peer's memory
START_TIMEOUT = 120.0  # for the peer to print "serving stage" (2 busy cores make it slow)
EDGE_SHARE = 0.2  # memory at the start vs the end: mean of the first and last 20% of the samples


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--clients", type=int, default=8, help="P2P identities sending requests (default 8)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per client (default 16)")
    parser.add_argument("--manifest", default=None, help="swarm manifest (default: a tiny 2-stage model)")
    parser.add_argument(
        "--busy-wait",
        type=float,
        default=NO_PEER_WAIT,
        help=f"seconds a task waits after a busy reply (default {NO_PEER_WAIT}, as a trainer with no other peer)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the peer's log and print its folder")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.clients < 1 or args.concurrency < 1 or args.busy_wait < 0:
        parser.error("--duration must be positive, --clients and --concurrency at least 1, --busy-wait not negative")
    return args


# ---------------------------------------------------------------------------------------------- the peer


def start_peer(manifest_path: Path, stage: int, folder: Path, duration: float) -> PeerProcess:
    """A swarm-peer serving `stage`, in its own session (process group), its output in folder/peer.log."""
    args = processes.loopback_args(manifest_path, stage, trainer=False) + ["--throughput", "100"]
    args += ["--checkpoint-dir", str(folder / "checkpoints"), "--checkpoint-every", "0"]
    args += ["--duration", str(duration + 600)]  # an orphaned peer (this process killed) stops by itself
    return processes.start_peer(args, folder / "peer.log", cache_dir=folder / "cache")


def peer_cpu_seconds(pgid: int) -> float:
    """CPU time (user and system) that the peer's live processes have used so far."""
    ticks = sum(int(fields[11]) + int(fields[12]) for fields in peer_processes(pgid).values())  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def sample_memory(pgid: int, samples: list[tuple[float, float]], stop: threading.Event) -> None:
    """Append (time, MB of all the peer's processes) every MEMORY_PERIOD until `stop`; a thread, so that a busy event loop
    does not delay the samples."""
    while not stop.is_set():
        samples.append((time.monotonic(), sum(memory_mb(pgid).values())))
        stop.wait(MEMORY_PERIOD)


def stop_peer(peer: PeerProcess, grace: float = 20.0) -> None:
    """SIGTERM (a clean shutdown, which shows whether the peer still stops well after the load), then SIGKILL
    whatever is left of its processes, and remove the socket files a kill leaves."""
    stop_peers([peer], grace)


# ---------------------------------------------------------------------------------------------- figures


def percentiles_ms(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"p50": None, "p99": None, "max": None}
    p50, p99 = np.percentile(latencies, [50, 99])
    return {"p50": round(p50 * 1000, 1), "p99": round(p99 * 1000, 1), "max": round(max(latencies) * 1000, 1)}


def memory_figures(samples: list[tuple[float, float]], start: float, end: float, before: float) -> dict:
    """Peak, and the mean of the first and last EDGE_SHARE of the load's samples (flat memory: growth near 0)."""
    during = [mb for t, mb in samples if start <= t <= end]
    if not during:
        return {"before_load_mb": round(before, 1), "samples": 0}
    edge = max(1, int(len(during) * EDGE_SHARE))
    first, last = float(np.mean(during[:edge])), float(np.mean(during[-edge:]))
    return {
        "before_load_mb": round(before, 1),
        "peak_mb": round(max(mb for _, mb in samples), 1),
        "first_20pct_mean_mb": round(first, 1),
        "last_20pct_mean_mb": round(last, 1),
        "growth_mb": round(last - first, 1),
        "samples": len(during),
    }


def peer_log_figures(peer: PeerProcess) -> dict:
    """What the peer itself counted and complained about (its last JSON status line is printed as it stops)."""
    text = peer.output()
    statuses = peer.status_lines()
    status = statuses[-1] if statuses else {}
    problems = [line for line in text.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) |Traceback", line)]
    for line in problems[:10]:
        print(f"peer log: {line[:300]}", file=sys.stderr)
    return {
        "samples_served": status.get("samples_served"),
        "bad_requests": status.get("bad_requests"),
        "busy_replies": status.get("busy_replies"),  # newer peers count them
        "warning_or_error_lines": len(problems),
        "stopped_cleanly": "stopped cleanly" in text,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # a benchmark stopped with SIGTERM still stops its peer
    runtime.setup_logging("WARNING")
    torch.set_num_threads(1)  # the peer needs the cores more than the clients
    manifest = benchmark_manifest(args.manifest, "load-benchmark")  # default: the tiny preset, the demo's model
    stage = manifest.num_stages - 1  # forward there is forward, backward and an optimizer step: the most work
    folder = Path(tempfile.mkdtemp(prefix="swarm-load-"))
    manifest_path = folder / "manifest.json"
    manifest_path.write_text(manifest.to_json())
    peer: PeerProcess | None = None
    memory: list[tuple[float, float]] = []
    stop_sampling = threading.Event()
    try:
        peer = start_peer(manifest_path, stage, folder, args.duration)
        peer.wait_for(r"serving stage", START_TIMEOUT)
        maddr = peer.maddr(5.0)
        before = sum(memory_mb(peer.pid).values())
        sampler = threading.Thread(target=sample_memory, args=(peer.pid, memory, stop_sampling), daemon=True)
        sampler.start()
        print(
            f"peer {maddr} serves stage {stage}; {args.clients} clients x {args.concurrency} requests in flight "
            f"against a queue of {MAX_PENDING_REQUESTS}, for {args.duration:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        cpu_before, own_before, wall_before = peer_cpu_seconds(peer.pid), own_cpu_seconds(), time.monotonic()
        tally, start, rates, elapsed = asyncio.run(run_load(manifest, stage, maddr, args, memory))
        wall = time.monotonic() - wall_before  # with the clients' start and the warm-up: a few seconds of little work
        peer_cpu = (peer_cpu_seconds(peer.pid) - cpu_before) / wall
        own_cpu = (own_cpu_seconds() - own_before) / wall
        by_process = memory_mb(peer.pid)
    finally:
        stop_sampling.set()
        if peer is not None:
            stop_peer(peer)
            peer_figures = peer_log_figures(peer)  # also when the run failed: its warnings go to stderr
        if args.keep_logs:
            print(f"peer log: {folder / 'peer.log'}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    end = start + args.duration
    for kind, message in tally.examples.items():
        print(f"{kind}: {message}", file=sys.stderr)
    served = len(tally.served)
    summary = {
        "settings": {
            "clients": args.clients,
            "concurrency_per_client": args.concurrency,
            "in_flight": args.clients * args.concurrency,
            "queue_limit": MAX_PENDING_REQUESTS,
            "queue_limit_per_caller": getattr(admission, "MAX_PENDING_PER_CALLER", None),  # newer servers have one
            "busy_wait_s": args.busy_wait,
            "duration_s": args.duration,
            "stage": stage,
            "manifest": {
                "stages": manifest.num_stages,
                "stage_layers": list(manifest.stages[stage]),
                **{k: getattr(manifest.model, k) for k in ("width", "depth", "heads", "context_length", "vocab_size")},
                "microbatch_size": manifest.training.microbatch_size,
                "activation_compression": manifest.training.activation_compression,
                "forward_timeout_s": manifest.training.timeouts.forward,
            },
        },
        "requests_sent": tally.sent,
        "served": served,
        "busy": len(tally.busy),
        "busy_reasons": dict(tally.busy_reasons),
        "error_replies": dict(tally.error_replies),
        "exceptions": dict(tally.exceptions),
        # replies to the requests in flight at the end come later (up to a timeout): they are not counted
        "served_per_second": round(sum(t <= end for t, _ in tally.served) / args.duration, 2),
        "served_per_second_by_10s": [round(r, 1) for r in rates],
        "served_latency_ms": percentiles_ms([latency for _, latency in tally.served]),
        "busy_latency_ms": percentiles_ms(tally.busy),
        "peer_memory": {
            **memory_figures(memory, start, end, before),
            "end_by_process_mb": {name: round(mb, 1) for name, mb in sorted(by_process.items())},
        },
        # the peer's own count: the served requests and the warm-up, plus any whose reply came too late
        "peer": {**peer_figures, "samples_expected": (served + 1) * manifest.training.microbatch_size},
        "cpu_percent": {
            "peer_processes": round(100 * peer_cpu),
            "this_process": round(100 * own_cpu),
            "cores": os.cpu_count(),
        },
        "client_loop_lag_ms": percentiles_ms(tally.loop_lags),
        "elapsed_s": round(elapsed, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
