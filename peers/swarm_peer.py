"""swarm-peer: run one peer of a swarm (serve a stage; by default also train)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import torch

from peers import runtime
from swarm import __version__
from swarm.client.checks import CHECK_FRACTION
from swarm.client.trainer import Trainer
from swarm.dht import joining
from swarm.dht.records import MAX_THROUGHPUT, announceable
from swarm.errors import PeerStartError, SwarmError
from swarm.events import Event, EventKind
from swarm.manifests.loading import write_manifest
from swarm.manifests.manifest import Manifest
from swarm.network.startup_cache import StartupCache, reachability_key
from swarm.peer import Peer, TrainingOptions
from swarm.server.checkpoint import default_checkpoint_dir
from swarm.server.reachability import Verdict, check_reachability
from swarm.server.rebalancer import Rebalancer
from swarm.server.stage import ServingOptions, StageServer
from swarm.throughput import DEFAULT_BANDWIDTH_MBITS
from swarm.trust.identity import claim_identity, identity_taken, without_own_address
from swarm.trust.signing import IdentityKey, rejected_records_soon

logger = logging.getLogger("swarm-peer")

CONNECT_PERIOD = 5.0  # seconds between a peer's looks for peers to connect to, when others cannot dial it

EXAMPLES = """\
examples:
  swarm-peer --join my-swarm.json --new-swarm --host-maddrs /ip4/0.0.0.0/tcp/31337
      start the first peer of a new swarm (see swarm-init); it writes the addresses others can join
      through into my-swarm.json, ready to publish
  swarm-peer --join my-swarm.json
      join a swarm whose manifest lists initial peers; pick the stage that needs help most
  swarm-peer --join https://example.org/my-swarm.json#0123456789abcdef
      the same with a published manifest; the part after # is the swarm id it must have
  swarm-peer --join /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
      join through any running peer; it hands out the swarm's manifest
  swarm-peer --join my-swarm.json --stage 1 --no-trainer --device cuda
  swarm-peer --join my-swarm.json --trainer-only
      serve stage 1 on the GPU, without running a trainer (a pinned peer never moves)
  swarm-peer --join my-swarm.json --throughput eval --bandwidth 50
      measure compute throughput again (not from the cache) and take the link as 50 Mbit/s
  swarm-peer --join my-swarm.json --checkpoint-dir /data/ckpt --checkpoint-every 60
      save the served stage's state every minute (and on exit); a restart resumes from it
  swarm-peer --join my-swarm.json --identity ~/.swarm-peer.key --host-maddrs /ip4/0.0.0.0/tcp/31337
      keep the same peer id (and so the same address) across restarts: the address stays valid in manifests
  swarm-peer --join my-swarm.json --simulated-speed 0.25
      testing aid: behave like a device 4x slower than this one (compute takes 4x as long)
  swarm-peer --join my-swarm.json --metrics-port 9100 --metrics-host 0.0.0.0
      serve Prometheus metrics at http://<this machine>:9100/metrics, for a Prometheus on another machine
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Run one peer of a Swarm: join the DHT, serve a pipeline stage and (by default) train.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runtime.add_join_argument(parser)
    parser.add_argument(
        "--new-swarm",
        action="store_true",
        help="start a new swarm: do not contact the manifest's initial peers, and write this peer's addresses "
        "into the manifest as its initial peers (into --write-manifest if given, else into the --join file)",
    )
    parser.add_argument(
        "--write-manifest",
        default=None,
        metavar="PATH",
        help="write the manifest, with this peer's addresses first among its initial peers, to PATH",
    )
    parser.add_argument(
        "--stage", type=int, default=None, help="serve this stage (default: the one with least throughput)"
    )
    parser.add_argument(
        "--trainer", action=argparse.BooleanOptionalAction, default=True, help="also run a trainer (default: yes)"
    )
    parser.add_argument(
        "--trainer-only",
        action="store_true",
        help="only train: feed data through the swarm's stages, serve none (a machine with data but no GPU to spare)",
    )
    parser.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="multiaddrs to listen on (default: all interfaces, /ip4/0.0.0.0/tcp/0)",
    )
    parser.add_argument(
        "--no-listen",
        action="store_true",
        help="accept no incoming connections: others cannot dial this peer, so it opens connections to them "
        "(the stages' peers and the trainers) and serves over those (a peer behind NAT does this by itself)",
    )
    parser.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="multiaddrs to tell others (e.g. your public address with an explicit port)",
    )
    parser.add_argument(
        "--throughput",
        default="auto",
        metavar="auto|eval|NUMBER",
        help="auto: measure compute throughput once and cache it (default); eval: measure again; "
        "NUMBER: announce this many samples/s instead of measuring",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="MBITS",
        help="the link's speed in Mbit/s, instead of measuring it against another peer "
        f"(alone in the swarm, a peer assumes {DEFAULT_BANDWIDTH_MBITS:.0f} until another peer appears)",
    )
    parser.add_argument(
        "--simulated-speed",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="testing aid: emulate a slower device; 0.25 makes every compute step take 4x as long (default: 1)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save the served stage's state here, and resume from it on restart "
        "(default: $SWARM_CACHE_DIR or ~/.cache/swarm, then checkpoints/<swarm id>)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="save a checkpoint this often (default: 300); 0: only when the peer stops cleanly",
    )
    parser.add_argument(
        "--identity",
        default=None,
        metavar="PATH",
        help="keep this peer's id in a private key file (created if missing), so that it survives restarts; "
        "each running peer needs its own file (default: a new id on every start)",
    )
    parser.add_argument("--public-name", default="", help="a name shown to others in peer-status (at most 64 chars)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics of this peer at http://HOST:PORT/metrics (0: any free port, printed; "
        "default: no metrics)",
    )
    parser.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="address the metrics server listens on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 lets a Prometheus on another machine scrape it)",
    )
    parser.add_argument("--data", default=None, metavar="PATH", help="train on this text file or folder instead")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="default: auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: never)")
    parser.add_argument("--status-every", type=float, default=10.0, help="print a status line this often (seconds)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print status lines and events (moves, state taken, averaging rounds) as JSON, one object per line",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the trainer's data order (default: random)")
    parser.add_argument(
        "--check-fraction",
        type=float,
        default=CHECK_FRACTION,
        help="fraction of the trainer's microbatches sent twice, through two replicas of a stage, to catch peers that "
        f"compute wrong results (default: {CHECK_FRACTION}; 0 turns the checks off)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    args = parser.parse_args(argv)
    if not 0.0 <= args.check_fraction <= 1.0:
        parser.error("--check-fraction must be between 0 and 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be 0 (only on exit) or a positive number of seconds")
    if args.trainer_only and (not args.trainer or args.stage is not None or args.new_swarm):
        parser.error(
            "--trainer-only trains and serves no stage: it goes with neither --no-trainer, --stage nor --new-swarm"
        )
    if args.status_every <= 0:
        parser.error("--status-every must be positive")
    if args.duration is not None and args.duration <= 0:
        parser.error("--duration must be positive")
    if args.throughput not in ("auto", "eval"):
        try:
            value = float(args.throughput)
        except ValueError:
            value = -1.0
        if not 0 < value <= MAX_THROUGHPUT:
            parser.error(f"--throughput must be auto, eval or a number of samples/s in (0, {MAX_THROUGHPUT:g}]")
    if args.bandwidth is not None and not 0 < args.bandwidth <= 1e6:
        parser.error("--bandwidth must be a positive number of Mbit/s")
    if not 0 < args.simulated_speed <= 1:
        parser.error("--simulated-speed must be in (0, 1]: it can only slow a device down")
    if args.new_swarm and args.write_manifest is None and not Path(args.join).is_file():
        parser.error(
            "--new-swarm writes this peer's addresses into the manifest: --join must be a manifest file, "
            "or pass --write-manifest PATH"
        )
    if args.no_listen and (args.new_swarm or args.write_manifest):
        parser.error(
            "--no-listen: nobody could join through this peer, so it cannot start a swarm or be written into a manifest"
        )
    if len(args.public_name) > 64 or not args.public_name.isprintable():
        parser.error("--public-name must be at most 64 printable characters")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be a port number from 1 to 65535, or 0 for any free port")
    if args.metrics_host is not None and args.metrics_port is None:
        parser.error("--metrics-host needs --metrics-port (metrics are off without it)")
    args.metrics_host = args.metrics_host or "127.0.0.1"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.setup_logging(args.log_level)
    dht = None
    identity = None  # the locked identity file, held open while the peer runs
    try:
        host_maddrs = args.host_maddrs or joining.ALL_INTERFACES
        # The DHT forks its own process: start it before any thread exists.
        manifest = joining.read_join(args.join)  # None: --join names a peer, which hands out the manifest (below)
        if manifest is not None:
            check_stage_flag(args, manifest)
        initial_peers = [] if args.new_swarm else joining.bootstrap_peers(args.join, manifest)
        identity_path = Path(args.identity).expanduser() if args.identity else None
        startup = StartupCache()  # answers of earlier starts on this machine (swarm/network/startup_cache.py)
        if identity_path is not None:
            own_id, identity = claim_identity(identity_path)
            # asked with its own address among the initial peers: a live peer there with this id is a twin (not
            # asked when this identity last ran on this machine: the lock rules out a twin here)
            if not startup.identity_ran_here(identity_path) and asyncio.run(
                identity_taken(identity_path, initial_peers)
            ):
                raise PeerStartError(
                    f"--identity {identity_path}: a peer with this id ({own_id}) is already in the swarm; two peers "
                    "cannot share an identity: stop the other one, or give this peer its own file"
                )
            initial_peers = without_own_address(initial_peers, own_id)  # a restart: nobody answers there
        signing_key = IdentityKey.from_file(identity_path) if identity_path is not None else IdentityKey.generate()
        if not initial_peers and not args.new_swarm:
            print("the manifest lists no initial peers: starting a new swarm", flush=True)
        args.reachable = decide_reachability(args, initial_peers, host_maddrs, manifest, startup)
        sockets_before = joining.daemon_sockets()
        dht = joining.start_dht(
            initial_peers,
            host_maddrs,
            args.announce_maddrs,
            client_mode=not args.reachable,
            no_listen=args.no_listen,
            identity_path=identity_path,
            secret=manifest.secret if manifest is not None else None,
            identity=signing_key,
        )
        if identity_path is not None:
            startup.remember_identity(identity_path)
        device = runtime.resolve_device(args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
    except SwarmError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        if dht is not None:
            dht.shutdown()
        if identity is not None:
            identity.close()
        return 2
    try:
        return asyncio.run(run_peer(args, manifest, dht, device, signing_key))
    except SwarmError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2
    finally:
        dht.shutdown()
        # a Ctrl-C to the whole process group can end p2pd before it removes its socket file: remove the ones
        # that appeared since this peer started and that nobody listens on any more (live daemons are left alone)
        joining.remove_stale_sockets(joining.daemon_sockets() - sockets_before)
        if identity is not None:
            identity.close()


def decide_reachability(
    args: argparse.Namespace,
    initial_peers: list[str],
    host_maddrs: list[str],
    manifest: Manifest | None,
    startup: StartupCache,
) -> bool:
    """Whether other peers can dial this one: ask a few of them to dial it back (before the DHT starts), unless a
    start within the last hour with the same fixed addresses found out already."""
    if args.no_listen:
        print("--no-listen: others cannot dial this peer; it opens connections to them instead", flush=True)
        return False
    key = reachability_key(host_maddrs, args.announce_maddrs)
    cached = startup.reachability(key) if initial_peers else None
    started = time.monotonic()
    if cached is not None:
        verdict, took = Verdict(*cached), "as found by a start within the last hour with these addresses"
    else:
        verdict = asyncio.run(check_reachability(initial_peers, host_maddrs, args.announce_maddrs, manifest))
        took = f"checked in {time.monotonic() - started:.1f} s"
        if verdict.reachable is not None:
            startup.remember_reachability(key, verdict.reachable, verdict.detail)
    if verdict.reachable is False:
        print(
            f"this peer is NOT reachable from other peers: {verdict.detail} ({took}). It takes part anyway: it opens "
            "connections to the peers that call it, and announces that it does. To be reachable, open or forward "
            "a port (--host-maddrs /ip4/0.0.0.0/tcp/PORT) and announce your public address (--announce-maddrs)",
            flush=True,
        )
        return False
    if verdict.reachable is None:
        print(f"reachability not checked ({verdict.detail}); assuming other peers can dial this one", flush=True)
    else:
        print(f"reachable: {verdict.detail} ({took})", flush=True)
    return True


def check_stage_flag(args: argparse.Namespace, manifest: Manifest) -> None:
    if args.stage is not None and not 0 <= args.stage < manifest.num_stages:
        raise SwarmError(f"--stage {args.stage}: the swarm has stages 0..{manifest.num_stages - 1}")


def publish_addresses(args: argparse.Namespace, manifest: Manifest, addrs: list[str]) -> None:
    """Write the manifest with this peer's addresses as initial peers, ready for the swarm's creator to publish."""
    own = joining.publishable_maddrs(addrs)
    others = [] if args.new_swarm else [a for a in manifest.initial_peers if a not in own]
    path = Path(args.write_manifest or args.join)
    published = manifest.with_initial_peers(own + others)
    write_manifest(published, path)
    print(
        f"wrote {path} with this peer's addresses as initial peers; publish it (a web server, a repository, a "
        f"gist) and others join with: swarm-peer --join <its URL>#{manifest.swarm_id}",
        flush=True,
    )


async def run_peer(
    args: argparse.Namespace, manifest: Manifest | None, dht, device: torch.device, signing_key: IdentityKey
) -> int:
    stop = asyncio.Event()
    runtime.install_stop_handlers(stop)
    p2p = await dht.replicate_p2p()
    if manifest is None:
        manifest = await joining.manifest_through_peer(p2p, args.join, manifest)
        check_stage_flag(args, manifest)
    joining.sign_records(dht, manifest, signing_key)  # before any record is written or read
    print(f"swarm {manifest.name!r} (id {manifest.swarm_id}), peer {dht.peer_id}", flush=True)
    maddrs = [] if args.no_listen else joining.visible_maddrs(dht)  # hivemind logs an error for a non-listener
    if args.reachable:
        print("reachable at:", flush=True)
        for addr in maddrs:
            print(f"  {addr}", flush=True)
    if args.new_swarm or args.write_manifest:
        if args.reachable:
            publish_addresses(args, manifest, maddrs)
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
        reachable=args.reachable,
        maddrs=announceable(maddrs) if args.reachable else (),  # nobody can dial an unreachable peer
    )
    training = TrainingOptions(
        enabled=args.trainer,
        data=args.data,
        seed=args.seed,
        only=args.trainer_only,
        check_fraction=args.check_fraction,
    )

    def on_switch(server: StageServer) -> None:
        layers = server.layers
        print(
            f"serving stage {server.stage} (layers {layers.start}..{layers.stop - 1}, "
            f"{server.parameter_count / 1e6:.2f}M parameters) on {device}, {server.throughput.serving:.1f} samples/s "
            f"(compute {server.throughput.compute:.1f}, network {server.throughput.network:.1f})",
            flush=True,
        )

    peer = Peer(manifest, dht, p2p, device, serving, training, on_switch, lambda e: print_event(e, args.json))
    try:
        metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
        await peer.start_services(metrics)
        if peer.metrics is not None:
            print(f"metrics at {peer.metrics.url}", flush=True)
        await peer.join()
        if peer.data is not None:
            print(
                f"training on {peer.data.total_train_tokens / 1e6:.1f}M tokens in {len(peer.data.train)} shards "
                f"({peer.data.folder}), in an order of this peer's own",
                flush=True,
            )
        started, refused = time.monotonic(), 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=args.status_every)
            except TimeoutError:
                pass
            if not stop.is_set():
                peer.check()  # surface a crash
            if args.duration is not None and time.monotonic() - started >= args.duration:
                stop.set()
            try:
                refused = await asyncio.wait_for(rejected_records_soon(dht), timeout=2.0)
            except Exception:  # the DHT's process is busy or stopping: the last count stands
                pass
            print_progress(peer.rebalancer, peer.trainer, args.json, refused)
    finally:
        await peer.shutdown()
        print("stopped cleanly", flush=True)
    return 0


def print_progress(rebalancer: Rebalancer, trainer: Trainer | None, as_json: bool, refused_records: int = 0) -> None:
    server = rebalancer.server
    stats = server.stats() if server is not None else None  # None: a --trainer-only peer
    trainer_stats = trainer.stats() if trainer is not None else None
    if as_json:
        status = {**stats.to_dict(), "moves": rebalancer.moves} if stats is not None else {"stage": None}
        if trainer_stats is not None:
            status.update(trainer_stats.to_dict())
        status["refused_records"] = refused_records
        print(json.dumps(status), flush=True)
        return
    if stats is None:
        line = "training only"
    else:
        line = f"stage {stats.stage}: served {stats.samples_served} samples, {stats.optimizer_steps} optimizer steps"
    if rebalancer.moves:
        line += f" ({rebalancer.moves} moves)"
    if stats is not None and (stats.averaging_rounds or stats.averaging_rounds_failed):
        line += f", averaged {stats.averaging_rounds} rounds"
        if stats.averaging_rounds_failed:
            line += f" ({stats.averaging_rounds_failed} skipped)"
    if stats is not None and stats.averaging_exclusions:
        line += f", excluded {stats.averaging_exclusions} partners for far-off values"
    if refused_records:
        line += f", refused {refused_records} unsigned or forged records"
    if trainer_stats is not None:
        loss = trainer_stats.loss
        shown_loss = f"{loss:.3f}" if loss == loss else "-"  # NaN until the first microbatch completes
        line += (
            f" | trainer: loss {shown_loss}, {trainer_stats.samples_per_second:.1f} samples/s, "
            f"{trainer_stats.samples} samples"
        )
        if trainer_stats.failed_microbatches:
            line += f", {trainer_stats.failed_microbatches} microbatches dropped"
        if trainer_stats.unserved_stages:
            waiting = ", ".join(map(str, trainer_stats.unserved_stages))
            line += f" | waiting for a peer to serve stage {waiting}"
    print(line, flush=True)


def print_event(event: Event, as_json: bool) -> None:
    """An event the moment it happens: one JSON line with --json (benchmarks and tests read these), else a
    sentence."""
    if as_json:
        print(json.dumps(event.to_dict()), flush=True)
        return
    f = event.fields
    if event.kind == EventKind.MOVED:
        text = f"moved from stage {f['from_stage']} to stage {f['to_stage']}"
    elif event.kind == EventKind.STATE_TAKEN:
        origin = {
            "peer": f"from peer {f['peer_id'][-8:]}",
            "checkpoint": "from this peer's checkpoint",
            "pretrained": "from the pretrained model",
        }
        text = (
            f"took the state of stage {f['stage']} {origin.get(f['source'], 'afresh (nobody had it)')}: "
            f"{f['optimizer_steps']} optimizer steps, averaging round {f['averaging_round']}"
        )
    else:
        text = f"averaging round {f['round']} of stage {f['stage']}: {f['outcome']}"
        if f["group_size"]:
            text += f" with {f['group_size']} peers, parameters moved by {f['change']:.2%}"
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
