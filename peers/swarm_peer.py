"""swarm-peer: run one peer of a swarm (serve a stage; by default also train).

This program parses its flags (peers/swarm_peer_args.py), starts the peer's DHT node, runs the Peer
(swarm/peer/peer.py) until it is stopped, and prints: what the start-up found (swarm/peer/startup.py), status lines
and events, as sentences or, with --json, as one JSON object per line. With --check it runs the preflight
(swarm/preflight/) instead, and prints its table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from peers import runtime
from peers.gpu_peers import run_gpu_peers
from peers.peer_output import print_event, print_progress
from peers.swarm_peer_args import parse_args
from swarm import lifetime
from swarm.client import joining
from swarm.dht import node
from swarm.dht.records import announceable, without_loopback_unless_only
from swarm.errors import PeerStartError, SwarmError
from swarm.manifests.manifest import Manifest
from swarm.peer.owner import OwnerRules
from swarm.peer.peer import Peer, TrainingOptions
from swarm.peer.startup import JoinOptions, StartedNode, enter_swarm, publish_addresses, start_node
from swarm.preflight.checks import VERDICTS, ExitCode, Status
from swarm.preflight.run import PreflightOptions, PreflightResult, run_preflight
from swarm.server.checkpoint import default_checkpoint_dir
from swarm.server.stage import ServingOptions, StageServer

logger = logging.getLogger("swarm-peer")


def say(line: str) -> None:
    """What the start-up found, one line each (swarm/peer/startup.py hands them over)."""
    print(line, flush=True)


@runtime.program("swarm-peer")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:  # before anything else starts: the check joins nothing and changes nothing
        return run_check(args)
    if args.gpus is not None:  # one swarm-peer per GPU, each with these flags and a device of its own
        return run_gpu_peers(sys.argv[1:] if argv is None else argv, args.gpus)
    runtime.setup_logging(args.log_level)
    runtime.quiet_vanished_streams()  # before the DHT process starts: it inherits the filter
    started: StartedNode | None = None
    try:
        # The DHT forks its own process: start it before any thread exists.
        manifest = joining.read_join(args.join)  # None: --join names a peer, which hands out the manifest (below)
        if manifest is not None:
            check_stage_flag(args, manifest)
        options = JoinOptions(
            join=args.join,
            new_swarm=args.new_swarm,
            host_maddrs=args.host_maddrs or node.ALL_INTERFACES,
            announce_maddrs=args.announce_maddrs or (),
            no_listen=args.no_listen,
            identity_path=Path(args.identity).expanduser() if args.identity else None,
        )
        started = start_node(options, manifest, say)
        device = runtime.resolve_device(args.device)
        if args.offload_optimizer and device.type != "cuda":
            say("--offload-optimizer has no effect on a CPU peer: its optimizer is in RAM already")
        if args.threads:
            torch.set_num_threads(args.threads)
    except (SwarmError, KeyboardInterrupt, OSError) as e:
        if started is not None:
            started.stop()
        if not isinstance(e, SwarmError):
            raise  # one line, by runtime.program
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_peer(args, started, device))
    except SwarmError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in runtime.DISK_FULL:
            raise
        print(f"swarm-peer: error: {runtime.disk_full_message(e, args.checkpoint_dir)}", file=sys.stderr)
        return 2
    finally:
        started.stop()


def run_check(args: argparse.Namespace) -> int:
    """swarm-peer --check: the preflight (swarm/preflight/), its progress on stderr, then a table (or one JSON
    object with --json); the exit code says whether this machine can serve (0), only train (1) or not join (2)."""
    runtime.setup_logging("ERROR")  # the table is the output: hivemind's chatter would bury it
    runtime.quiet_vanished_streams()  # before the DHT process starts: it inherits the filter
    options = PreflightOptions(
        join=args.join,
        device=args.device,
        max_memory=args.max_memory,
        offload_optimizer=args.offload_optimizer,
        stage=args.stage,
        span=args.span,
        host_maddrs=args.host_maddrs or node.ALL_INTERFACES,
        announce_maddrs=args.announce_maddrs,
        no_listen=args.no_listen,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        trainer=args.trainer,
        data=args.data,
        data_cache=args.data_cache,
    )
    started = time.monotonic()

    def progress(step: str) -> None:
        print(f"[{time.monotonic() - started:4.1f} s] {step}...", file=sys.stderr, flush=True)

    result = run_preflight(options, progress)
    if args.json:
        print(json.dumps(result.to_dict()), flush=True)
    else:
        print_check_table(result)
    return int(result.exit_code)


CHECK_STYLES = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


def print_check_table(result: PreflightResult) -> None:
    console = Console() if sys.stdout.isatty() else Console(width=160)  # piped: do not squeeze the table
    table = Table(title="swarm-peer --check", title_justify="left")
    for column in ("check", "status", "detail", "what to do"):
        table.add_column(column, overflow="fold")
    for check in result.checks:
        status = Text(str(check.status), style=CHECK_STYLES[check.status])
        table.add_row(check.name.replace("_", " "), status, check.detail, check.remedy)
    console.print(table)
    code = result.exit_code
    style = {ExitCode.CAN_SERVE: "bold green", ExitCode.TRAINER_ONLY: "bold yellow"}.get(code, "bold red")
    console.print(Text(f"{VERDICTS[code]} (exit code {int(code)})", style=style))


def check_stage_flag(args: argparse.Namespace, manifest: Manifest) -> None:
    if args.stage is not None and not 0 <= args.stage < manifest.num_stages:
        raise PeerStartError(f"--stage {args.stage}: the swarm has stages 0..{manifest.num_stages - 1}")
    if args.span != 1:
        if not manifest.balancing.spans:
            raise PeerStartError(
                "--span: this swarm's peers serve one stage each (its manifest has no balancing.spans)"
            )
        if args.stage is None or not 1 <= args.span <= manifest.num_stages - args.stage:
            raise PeerStartError(
                f"--span N goes with --stage S and pins stages S..S+N-1 within 0..{manifest.num_stages - 1}"
            )


def write_published_manifest(args: argparse.Namespace, manifest: Manifest, addrs: list[str]) -> None:
    """The manifest with this peer's addresses as initial peers, ready for the swarm's creator to publish."""
    path = Path(args.write_manifest or args.join)
    publish_addresses(manifest, addrs, path, args.new_swarm)
    print(
        f"wrote {path} with this peer's addresses as initial peers; publish it (a web server, a repository, a "
        f"gist) and others join with: swarm-peer --join <its URL>#{manifest.swarm_id}",
        flush=True,
    )


async def run_peer(args: argparse.Namespace, started: StartedNode, device: torch.device) -> int:
    stop, hurry = asyncio.Event(), asyncio.Event()
    runtime.install_stop_handlers(stop, hurry)
    lifetime.stop_when_parent_is_gone()  # started by another program (swarm-demo, a test): not past its end
    manifest, p2p = await enter_swarm(started, args.join, say)  # a clock far off: PeerStartError, exit 2
    if started.manifest is None:  # asked of the peer --join names
        check_stage_flag(args, manifest)
    dht = started.dht
    say(f"process {os.getpid()}: pause it with kill -USR1 {os.getpid()}, resume with kill -USR2 {os.getpid()}")
    maddrs = [] if args.no_listen else node.visible_maddrs(dht)  # hivemind logs an error for a non-listener
    if started.reachable:
        print("reachable at:", flush=True)
        for addr in without_loopback_unless_only(maddrs):  # what others could dial: no 127.0.0.1 beside a real one
            print(f"  {addr}", flush=True)
    if args.new_swarm or args.write_manifest:
        if started.reachable:
            write_published_manifest(args, manifest, maddrs)
        else:
            print("not writing the manifest: nobody can join through a peer that others cannot dial", flush=True)
    serving = ServingOptions(
        stage=args.stage,
        throughput=args.throughput,
        bandwidth_mbits=args.bandwidth,
        simulated_speed=args.simulated_speed,
        public_name=args.public_name,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else default_checkpoint_dir(manifest),
        checkpoint_every=args.checkpoint_every,
        reachable=started.reachable,
        maddrs=announceable(maddrs) if started.reachable else (),  # nobody can dial an unreachable peer
        max_memory=args.max_memory,
        span=args.span,
        offload_optimizer=args.offload_optimizer,
    )
    training = TrainingOptions(
        enabled=args.trainer,
        data=args.data,
        data_cache=args.data_cache,
        seed=args.seed,
        only=args.trainer_only,
        check_fraction=args.check_fraction,
    )

    def on_switch(servers: list[StageServer]) -> None:
        first, last = servers[0], servers[-1]
        stages = f"stage {first.stage}" if len(servers) == 1 else f"stages {first.stage}-{last.stage}"
        parameters = sum(server.parameter_count for server in servers)
        print(
            f"serving {stages} (layers {first.layers.start}..{last.layers.stop - 1}, {parameters / 1e6:.2f}M "
            f"parameters) on {device}, {first.throughput.serving:.1f} samples/s "
            f"(compute {first.throughput.compute:.1f}, network {first.throughput.network:.1f})",
            flush=True,
        )

    peer = Peer(manifest, dht, p2p, device, serving, training, on_switch, lambda e: print_event(e, args.json))
    runtime.install_pause_handlers(peer.pause, peer.resume)  # kill -USR1 / -USR2 <pid>: pause / resume
    rules_task: asyncio.Task | None = None  # the owner's rules (--hours, --yield-gpu), once the peer serves
    try:
        metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
        await peer.start_services(metrics)
        if peer.metrics is not None:
            print(f"metrics at {peer.metrics.url}", flush=True)
        if not await joined(peer, stop, max(args.status_every, JOIN_PROGRESS_EVERY)):
            return runtime.STOPPED  # stopped while joining (Ctrl-C): the finally below stops what started
        if peer.data is not None:
            index = peer.data.index
            print(
                f"training on {index.train_tokens / 1e6:.1f}M tokens in {len(index.chunks)} chunks from "
                f"{peer.data.locations[0]}, read where the swarm has read least; data cache "
                f"{peer.data.cache.folder} (cap {peer.data.cache.cap_bytes / 2**30:.1f} GiB)",
                flush=True,
            )
        if args.hours is not None or args.yield_gpu:  # the owner's rules pause and resume the peer by themselves
            gpu = (device.index or 0) if device.type == "cuda" else None
            rules = OwnerRules(
                peer.pause, peer.resume, lambda: peer.paused, args.hours, gpu if args.yield_gpu else None
            )
            rules_task = asyncio.create_task(rules.run(stop))
            if args.yield_gpu and gpu is None:
                print("--yield-gpu: this peer computes on the CPU, so it yields no GPU", flush=True)
        serving_since, refused = time.monotonic(), 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=args.status_every)
            except TimeoutError:
                pass
            if not stop.is_set():
                peer.check()  # surface a crash
            if args.duration is not None and time.monotonic() - serving_since >= args.duration:
                stop.set()
            counted = await peer.refused_records()
            refused = refused if counted is None else counted  # None: the DHT's process is busy; the last count stands
            print_progress(peer.snapshot(), args.json, refused)
    finally:
        if rules_task is not None:
            rules_task.cancel()
        print("stopping: finishing the work in flight and saving each stage's state", flush=True)
        await peer.shutdown(hurry)
        print("stopped cleanly", flush=True)
    return 0


JOIN_PROGRESS_EVERY = 15.0  # seconds between two "still joining" lines


async def joined(peer: Peer, stop: asyncio.Event, every: float) -> bool:
    """Run peer.join() (minutes, when a large stage's state comes over a home link) with a line every `every`
    seconds saying what it does, and give it up when `stop` is set (Ctrl-C): False then."""
    join = asyncio.create_task(peer.join())
    stopped = asyncio.create_task(stop.wait())
    begin = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({join, stopped}, timeout=every, return_when=asyncio.FIRST_COMPLETED)
            if join in done:
                join.result()  # its error, if any
                return True
            if stopped in done:
                print("stopping while joining the swarm", flush=True)
                return False
            print(f"joining: {peer.joining} ({time.monotonic() - begin:.0f} s so far)", flush=True)
    finally:
        for task in (join, stopped):
            task.cancel()
        await asyncio.gather(join, stopped, return_exceptions=True)


if __name__ == "__main__":
    sys.exit(main())
