"""swarm-demo: a whole swarm on this machine, on loopback: peers, trainers, a progress bar and a summary."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from hivemind import DHT
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from peers import runtime
from swarm.architectures.model import build_full_model
from swarm.client.trainer import Trainer
from swarm.dataset.shards import TextData, heldout_batches
from swarm.dht import node
from swarm.dht.records import PeerState, fetch_announcements, fetch_trainer_reports
from swarm.errors import SwarmError
from swarm.local import processes
from swarm.manifests.loading import load_manifest, write_manifest
from swarm.manifests.manifest import Manifest
from swarm.server.reachability import ReachabilityService

DEMO_MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "demo.json"
EVAL_BATCHES = 8

EXAMPLES = """\
examples:
  swarm-demo                      4 peers (2 stages x 2 replicas), about 2 minutes
  swarm-demo --duration 30 --json a short run; print the summary as one JSON line
  swarm-demo --peers 6 --manifest my-swarm.json
  swarm-demo --monitor 8080       the same, watched in the browser: open the URL it prints
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-demo",
        description="Run a whole Swarm on this machine (loopback only): start peers, train, report held-out loss.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peers", type=int, default=4, help="number of peers (default 4); peer k serves stage k mod S")
    parser.add_argument("--duration", type=float, default=100.0, help="seconds of training (default 100)")
    parser.add_argument("--manifest", default=str(DEMO_MANIFEST), help="swarm manifest (default examples/demo.json)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.add_argument(
        "--monitor", type=int, default=None, metavar="PORT", help="also start swarm-monitor's page on PORT (0: any)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="print the folder of the peers' logs and keep it")
    args = parser.parse_args(argv)
    if args.peers < 1:
        parser.error("--peers must be at least 1")
    if args.duration <= 0:
        parser.error("--duration must be positive")
    if args.monitor is not None and not 0 <= args.monitor <= 65535:
        parser.error("--monitor must be a port between 0 and 65535")
    return args


@runtime.program("swarm-demo")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=args.json)
    runtime.setup_logging("WARNING")
    try:
        manifest = load_manifest(args.manifest)
        if args.peers < manifest.num_stages:
            raise SwarmError(f"--peers {args.peers}: the swarm has {manifest.num_stages} stages, each needs a peer")
        # the peers are forked from one process that imports torch, hivemind and swarm once, started now so that
        # its imports overlap with the demo's own start (swarm/local/forkserver.py): four fresh interpreters would
        # each spend 4-5 s of CPU on the same imports
        processes.fork_peers_from_a_preloaded_process(start_now=True)
        dht = node.start_dht([], node.LOOPBACK)
        node.sign_records(dht, manifest, None)  # it reads the peers' records, writes none
    except SwarmError as e:
        print(f"swarm-demo: error: {e}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    peers: list[processes.PeerProcess] = []
    try:
        summary = asyncio.run(run_demo(args, manifest, dht, logs, peers, console))
    except SwarmError as e:
        print(f"swarm-demo: error: {e}\n(peer logs: {logs})", file=sys.stderr)
        return 1
    finally:
        processes.stop_peers(peers)
        dht.shutdown()
    if args.keep_logs:
        console.print(f"peer logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    if summary is None:
        return 130
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(console, summary)
    return 0


async def run_demo(
    args: argparse.Namespace, manifest: Manifest, dht: DHT, logs: Path, peers: list, console: Console
) -> dict | None:
    stop = asyncio.Event()
    runtime.install_stop_handlers(stop)
    manifest = manifest.with_initial_peers([str(a) for a in dht.get_visible_maddrs()])
    manifest_path = logs / "manifest.json"
    write_manifest(manifest, manifest_path)

    console.print(
        f"[bold]Swarm demo[/]: {args.peers} peers, {manifest.num_stages} stages, swarm id {manifest.swarm_id}"
    )
    console.print(f"watch it from another terminal: peer-status --join {manifest_path} --watch 2", soft_wrap=True)
    heldout = TextData.load_heldout(manifest.data.source, manifest.data.heldout_fraction)
    batches = heldout_batches(heldout, EVAL_BATCHES, manifest.training.microbatch_size, manifest.model.context_length)
    initial_loss = evaluate_fresh_model(manifest, batches)
    console.print(f"held-out loss of the freshly initialised model: {initial_loss:.3f}")

    p2p = await dht.replicate_p2p()
    reachability = ReachabilityService()  # the peers' first contact: it answers their "can you dial me?"
    await reachability.add_p2p_handlers(p2p, namespace=ReachabilityService.NAMESPACE)
    for k in range(args.peers):
        # its own session: Ctrl-C reaches only the demo, which then stops every peer cleanly
        name = ["--public-name", f"demo-peer-{k}"]  # how the monitor's leaderboard shows it
        peers.append(
            processes.start_local_peer(manifest_path, k % manifest.num_stages, logs / f"peer{k}.log", extra=name)
        )
    if args.monitor is not None:
        peers.append(start_monitor(manifest_path, args.monitor, logs))  # stopped with the peers
        console.print(f"the monitor's page: {await monitor_url(peers[-1])}  (it stops with the demo)", soft_wrap=True)
    try:
        with console.status("starting peers (each loads torch and hivemind, joins the DHT, measures itself)..."):
            await wait_until_served(dht, manifest, peers, args.peers, stop, timeout=120)
        if stop.is_set():
            return None

        started = time.monotonic()
        samples, speed = 0, 0.0
        first_poll: tuple[float, int] | None = None  # (time, samples) of the first trainer reports
        loss = float("nan")
        with Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]} samples/s  {task.fields[samples]} samples"),
            TimeRemainingColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("train", total=args.duration, loss="-", speed="-", samples=0)
            while not stop.is_set() and (elapsed := time.monotonic() - started) < args.duration:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=2)
                except TimeoutError:
                    pass
                check_peers_alive(peers)
                reports = await fetch_trainer_reports(dht, manifest.swarm_id)
                if reports:
                    samples = sum(r.samples for r in reports)
                    # Reports lag by up to one announce period at both ends of the window, which cancels out.
                    now = time.monotonic()
                    first_poll = first_poll or (now, samples)
                    speed = (samples - first_poll[1]) / max(now - first_poll[0], 1e-9)
                    losses = [r.loss for r in reports if r.loss == r.loss]
                    loss = sum(losses) / len(losses) if losses else loss
                    progress.update(
                        task,
                        completed=min(elapsed, args.duration),
                        loss=f"{loss:.3f}",
                        speed=f"{speed:.1f}",
                        samples=samples,
                    )
            progress.update(task, completed=args.duration)
        if stop.is_set():
            return None
        train_seconds = time.monotonic() - started

        with console.status("evaluating the trained swarm on held-out data..."):
            evaluator = Trainer(manifest, dht, p2p, str(dht.peer_id), seed=0)
            final_loss = await evaluator.evaluate(batches)
            served = [await fetch_announcements(dht, manifest.swarm_id, s) for s in range(manifest.num_stages)]
        return {
            "initial_loss": round(initial_loss, 4),
            "final_loss": round(final_loss, 4),
            "loss_drop": round(1 - final_loss / initial_loss, 4),
            # the demo's vocabulary is bytes: a token is a byte, so bits per byte is nats per token / ln 2
            "final_bits_per_byte": round(final_loss / math.log(2), 4),
            "samples_per_second": round(speed, 2),
            "samples": samples,
            "train_seconds": round(train_seconds, 1),
            "swarm_id": manifest.swarm_id,
            "peers": [
                {
                    "peer_id": a.peer_id,
                    "stage": a.stage,
                    "state": a.state,
                    "samples_served": a.samples_served,
                    "averaging_rounds": a.averaging_rounds,
                    "averaging_mb_sent": round(a.averaging_bytes_sent / 1e6, 2),
                    "activation_mb_sent": round(a.activation_bytes_sent / 1e6, 2),
                }
                for stage in served
                for a in stage
            ],
        }
    finally:
        await reachability.shutdown()
        await p2p.shutdown()


def start_monitor(manifest_path: Path, port: int, logs: Path) -> processes.PeerProcess:
    """swarm-monitor beside the demo's peers, its history in the demo's folder (each demo starts a new swarm)."""
    args = ["--join", str(manifest_path), "--port", str(port), "--history", str(logs / "monitor.sqlite"), "--json"]
    return processes.start_peer([*args, "--every", "2"], logs / "monitor.log", module="peers.swarm_monitor")


async def monitor_url(monitor: processes.PeerProcess, timeout: float = 60.0) -> str:
    """The URL the monitor prints once it serves its page; SwarmError if it exits or stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lines := [line for line in monitor.json_lines() if "url" in line]:
            return lines[0]["url"]
        if (code := monitor.poll()) is not None:
            raise SwarmError(f"swarm-monitor exited with code {code}:\n{monitor.tail(2000)}")
        await asyncio.sleep(0.2)
    raise SwarmError(f"swarm-monitor printed no URL within {timeout:.0f}s:\n{monitor.tail(2000)}")


def evaluate_fresh_model(manifest: Manifest, batches: list) -> float:
    """Held-out loss of the seed initialisation, which is exactly what every fresh peer starts from."""
    model = build_full_model(manifest.model)
    with torch.no_grad():
        losses = [float(model.loss(model(x), y)) for x, y in batches]
    return sum(losses) / len(losses)


async def wait_until_served(
    dht: DHT, manifest: Manifest, peers: list, count: int, stop: asyncio.Event, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        check_peers_alive(peers)
        online = [
            sum(a.state == PeerState.ONLINE for a in await fetch_announcements(dht, manifest.swarm_id, s))
            for s in range(manifest.num_stages)
        ]
        if sum(online) >= count:
            return
        if time.monotonic() > deadline:
            raise SwarmError(f"peers did not come online within {timeout:.0f}s (online per stage: {online})")
        await asyncio.sleep(0.5)


def check_peers_alive(peers: list[processes.PeerProcess]) -> None:
    for k, peer in enumerate(peers):
        if (code := peer.poll()) is not None:
            name = "the monitor" if peer.log_path.name == "monitor.log" else f"peer {k}"
            raise SwarmError(f"{name} exited with code {code}; the end of its log:\n{peer.tail(2000)}")


def print_summary(console: Console, summary: dict) -> None:
    table = Table(title="Swarm demo: summary", show_header=False)
    table.add_row("held-out loss before", f"{summary['initial_loss']:.3f}")
    table.add_row(
        "held-out loss after",
        f"{summary['final_loss']:.3f}  ({summary['loss_drop']:.0%} lower; {summary['final_bits_per_byte']:.3f} bits per byte)",
    )
    table.add_row("samples per second", f"{summary['samples_per_second']:.1f}")
    table.add_row("samples trained", str(summary["samples"]))
    console.print(table)
    peers = Table(title="peers")
    for column in ("peer", "stage", "state", "samples served", "averaging rounds", "MB sent: averaging / activations"):
        peers.add_column(column)
    for p in sorted(summary["peers"], key=lambda p: p["stage"]):
        traffic = f"{p['averaging_mb_sent']:.1f} / {p['activation_mb_sent']:.1f}"
        peers.add_row(
            p["peer_id"][-12:],
            str(p["stage"]),
            p["state"],
            str(p["samples_served"]),
            str(p["averaging_rounds"]),
            traffic,
        )
    console.print(peers)


if __name__ == "__main__":
    sys.exit(main())
