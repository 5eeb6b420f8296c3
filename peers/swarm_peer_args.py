"""swarm-peer's flags: the parser, its examples, and the checks of what argparse cannot check alone (ranges, flags
that go together or not). The program is peers/swarm_peer.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from peers import runtime
from swarm import __version__
from swarm.capacity.budget import parse_memory
from swarm.client.checks import CHECK_FRACTION
from swarm.dataset.cache import parse_size
from swarm.dht.records import MAX_THROUGHPUT
from swarm.errors import CapacityError, DataError, PeerStartError
from swarm.peer.owner import Hours, parse_hours
from swarm.throughput import DEFAULT_BANDWIDTH_MBITS

EXAMPLES = """\
examples:
  swarm-peer --join my-swarm.json --new-swarm --host-maddrs /ip4/0.0.0.0/tcp/31337
      start the first peer of a new swarm (see swarm-init); it writes the addresses others can join
      through into my-swarm.json, ready to publish
  swarm-peer --join my-swarm.json
      join a swarm whose manifest lists initial peers; pick the stage that needs help most
  swarm-peer --join https://example.org/my-swarm.json#0123456789abcdef
      the same with a published manifest; the part after # is the swarm id it must have
  swarm-peer --join /ip4/203.0.113.7/tcp/31337/p2p/QmXhR...
      join through any running peer; it hands out the swarm's manifest
  swarm-peer --join my-swarm.json --stage 1 --no-trainer --device cuda
      serve stage 1 on the GPU, without running a trainer (a pinned peer never moves)
  swarm-peer --join my-swarm.json --trainer-only
      train without serving a stage (a machine whose memory holds none)
  swarm-peer --join my-swarm.json --max-memory 6GB
      leave the rest of the GPU to others: serve only a stage that fits in 6 GB (swarm-plan shows what fits)
  swarm-peer --join my-swarm.json --device cuda:1 --identity ~/.swarm-gpu1.key --host-maddrs /ip4/0.0.0.0/tcp/31338
      a second GPU of the same machine: a peer of its own, with its own identity and port
  swarm-peer --join my-swarm.json --offload-optimizer
      an 8 GB card in a swarm of larger ones: AdamW's statistics in RAM, so the GPU holds more blocks
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
  swarm-peer --check --join https://example.org/my-swarm.json#0123456789abcdef
      before lending a machine: check it (software and GPU, memory, disk, the manifest, the initial peers,
      reachability, bandwidth, clock) without joining; a table of pass / warn / fail (--json: one JSON object)
  swarm-peer --join my-swarm.json --gpus all --host-maddrs /ip4/0.0.0.0/tcp/31337
      one peer per GPU of this machine (ports 31337, 31338, ...), each with an identity of its own
  swarm-peer --join my-swarm.json --hours 22-08 --yield-gpu
      lend the machine at night, and give the GPU back whenever another program (a game) uses it
  Ctrl-C (or kill <pid>)
      stop; if only this peer serves some of its stages, it first hands them to the peer that takes them over
      (at most a minute for one to start); a second Ctrl-C stops at once
  kill -USR1 <pid>   /   kill -USR2 <pid>
      pause a running peer (it drains, frees the GPU, stays in the swarm) / resume it (it catches up first);
      the peer prints its process id at start

exit codes: 0 a clean stop; 2 an error, at start or later (one line says what went wrong and what to do: flags,
manifest or its URL, initial peers, port in use, identity, device or CUDA driver, memory for no stage (with
--no-trainer or on a GPU), a clock more than 3 s off the peers', a full disk, --gpus without a GPU).
A CPU peer whose memory holds no stage, or that computes a block under 5% as fast as the serving peers, trains
only, and says so (pin a stage with --stage to serve anyway).
exit codes of --check: 0 this machine can join and serve a stage, 1 it can join only as a trainer (the table
says why: no stage fits in its memory, or --device fails), 2 it cannot join (manifest unreadable or of another
swarm, no initial peer answers, or a clock more than 3 s off the peers')
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
        "--check",
        action="store_true",
        help="check whether this machine can join the swarm and serve a stage, and exit (0: it can, 1: only as a "
        "trainer, 2: it cannot join); it joins nothing and changes nothing (with --json: one JSON object)",
    )
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
        help="save a checkpoint this often (default: 300), and as often back up a stage only one other peer "
        "serves (at most 1 MB/s on average); 0: only when the peer stops cleanly, and no backups",
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
    parser.add_argument(
        "--data-cache",
        default="4GB",
        metavar="SIZE",
        help="disk this machine gives to the swarm's data chunks (default: 4GB; least recently used go first; "
        "at least two chunks, e.g. 16MiB for 8 MiB chunks)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        type=_device,
        metavar="DEVICE",
        help="auto (default: the GPU if torch sees one), cpu, cuda, cuda:N (the N-th GPU: one peer per GPU, each "
        "with its own --identity and port), or mps",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        type=_gpus,
        metavar="all|N,M",
        help="one peer per GPU under this one command (all visible GPUs, or the listed ones), each with its own "
        "identity (PATH.gpuN with --identity, else in the cache folder) and port (a fixed port P becomes P+N)",
    )
    parser.add_argument(
        "--hours",
        default=None,
        type=_hours,
        metavar="START-END",
        help="run only between these hours of the local clock, e.g. 22-08; outside them the peer pauses itself "
        "(drained, its state in RAM, still in the swarm) and resumes when they come again",
    )
    parser.add_argument(
        "--yield-gpu",
        action="store_true",
        help="pause while another program computes on this peer's GPU (as nvidia-smi lists them), resume after",
    )
    parser.add_argument(
        "--span",
        type=int,
        default=1,
        metavar="N",
        help="with --stage S, in a swarm with spans (balancing.spans): serve stages S to S+N-1 (default 1)",
    )
    parser.add_argument(
        "--max-memory",
        type=_memory,
        default=None,
        metavar="SIZE",
        help="use at most this much GPU memory (RAM on a CPU), e.g. 6GB on a machine you share (default: what is "
        "free); the peer serves only stages that fit, and says so if none does",
    )
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="keep the optimizer's statistics (AdamW's moments, 8 bytes a parameter) in RAM between steps: a small "
        "GPU holds more blocks, each optimizer step copies them through the GPU (no effect on a CPU peer)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: never)")
    parser.add_argument("--status-every", type=float, default=10.0, help="print a status line this often (seconds)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print status lines and events (moves, state taken, averaging rounds) as JSON, one object per line "
        "(with --check: the checks as one JSON object)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the trainer's order of chunks and windows (default: its peer id's order)",
    )
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
    try:
        args.data_cache = parse_size(args.data_cache)
    except DataError as e:
        parser.error(f"--data-cache: {e}")
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
    if args.check and (args.new_swarm or args.write_manifest):
        parser.error("--check changes nothing: it goes with neither --new-swarm nor --write-manifest")
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
    if args.gpus is not None and (args.device != "auto" or args.check):
        parser.error("--gpus runs a peer on each GPU it names: it goes with neither --device nor --check")
    if args.yield_gpu and args.device in ("cpu", "mps"):
        parser.error(
            "--yield-gpu gives a CUDA GPU back to its owner's programs: it needs --device auto, cuda or cuda:N"
        )
    if args.metrics_host is not None and args.metrics_port is None:
        parser.error("--metrics-host needs --metrics-port (metrics are off without it)")
    args.metrics_host = args.metrics_host or "127.0.0.1"
    return args


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda", "mps") or re.fullmatch(r"cuda:\d{1,2}", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: write auto, cpu, cuda, cuda:N or mps")


def _gpus(text: str) -> str:
    if text == "all" or re.fullmatch(r"\d{1,2}(,\d{1,2})*", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: write all, or GPU numbers such as 0,1")


def _hours(text: str) -> Hours:
    try:
        return parse_hours(text)
    except PeerStartError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except CapacityError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
