"""peer-status: look at a swarm from outside, as a DHT client that serves nothing and stores nothing."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from peers import runtime
from swarm import __version__
from swarm.capacity.budget import format_memory
from swarm.client import joining
from swarm.dht import node
from swarm.errors import SwarmError
from swarm.manifests.manifest import Manifest
from swarm.watch.reader import SwarmReader
from swarm.watch.status import DEGRADED, UNREACHABLE, exit_code, find_peer

MAX_FAILED_READS = 3  # --watch gives up after this many failed refreshes in a row

EXAMPLES = """\
examples:
  peer-status --join https://example.org/my-swarm.json
      the swarm's health, its stages and its peers, once
  peer-status --join my-swarm.json --watch 5
      the same, refreshed in place every 5 seconds (Ctrl-C to stop)
  peer-status --join /ip4/203.0.113.7/tcp/31337/p2p/QmXhR... --json
      one JSON document with everything shown (for scripts); with --watch, one per line
  peer-status --join my-swarm.json --peer 3xYzAbCd
      one peer in detail (a part of its id of at least 4 characters, or its public name)

exit codes: 0 healthy (every stage served by an online peer), 1 degraded (some stage has none; with --peer:
that peer is not online), 2 the swarm cannot be reached (bad manifest, no initial peer answers)
"""

STATUS_STYLES = {
    "online": "green",
    "joining": "cyan",
    "paused": "blue",
    "stale": "yellow",
    "offline": "red",
    "gone": "red",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="peer-status",
        description="Show a Swarm: its health, stages, peers and training progress, read from the DHT.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runtime.add_join_argument(parser)
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    parser.add_argument("--json", action="store_true", help="print JSON (one document; one line per refresh)")
    parser.add_argument("--peer", default=None, metavar="ID", help="show one peer in detail")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    args = parser.parse_args(argv)
    if args.watch is not None and not 0.5 <= args.watch <= 86400:
        parser.error("--watch must be between 0.5 and 86400 seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # like Ctrl-C: the finally below stops the DHT and its daemon
    runtime.setup_logging("ERROR")  # a monitor prints its view, not hivemind's chatter
    dht = None
    try:
        manifest, initial_peers = joining.reader_join(args.join)  # no manifest: --join names a peer, which has it
        # a monitor accepts no connections: it only reads, over the connections it opens
        dht = node.start_dht(
            initial_peers, [], client_mode=True, no_listen=True, secret=manifest.secret if manifest else None
        )
        return asyncio.run(watch(args, manifest, dht))
    except SwarmError as e:
        print(f"peer-status: error: {e}", file=sys.stderr)
        return UNREACHABLE
    except KeyboardInterrupt:
        return 0
    finally:
        if dht is not None:
            dht.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def watch(args: argparse.Namespace, manifest: Manifest | None, dht) -> int:
    if manifest is not None:
        return await show(args, manifest, dht)
    p2p = await dht.replicate_p2p()
    try:
        return await show(args, await joining.manifest_through_peer(p2p, args.join, manifest), dht)
    finally:
        await p2p.shutdown()  # else its p2pclient socket file stays behind in /tmp


async def show(args: argparse.Namespace, manifest: Manifest, dht) -> int:
    """Read the swarm and print it, once or (--watch) until interrupted; the exit code."""
    node.sign_records(dht, manifest, None)  # a reader: it checks every record's signature, writes none
    console = Console() if sys.stdout.isatty() else Console(width=160)  # piped: do not squeeze the tables
    reader = SwarmReader(manifest, args.join)  # it shows the peers that vanish since as "gone" (--watch)
    document, _ = await reader.read(dht)  # the first read must work: else exit 2
    if args.watch is None:
        return show_once(args, document, console)
    # in place on a terminal; piped or --json, one document per refresh
    in_place = console.is_terminal and not args.json
    live = Live(render(args, document), console=console, auto_refresh=False) if in_place else None
    code = verdict(args, document) if live is not None else show_once(args, document, console)
    failures = 0
    with live or contextlib.nullcontext():
        while True:
            await asyncio.sleep(args.watch)
            try:
                document, _ = await reader.read(dht)
                failures = 0
            except SwarmError as e:  # one slow read (a peer just died) must not end the watch
                failures += 1
                if failures >= MAX_FAILED_READS:
                    raise
                print(f"peer-status: refreshing failed ({e}); trying again", file=sys.stderr)
                continue
            if live is not None:
                live.update(render(args, document), refresh=True)
                code = verdict(args, document)
            else:
                code = show_once(args, document, console)
    return code


def verdict(args: argparse.Namespace, document: dict[str, Any]) -> int:
    """The exit code: the swarm's health; with --peer, 0 only if that one peer is online."""
    if args.peer is None:
        return exit_code(document)
    matches = find_peer(document, args.peer)
    return 0 if len(matches) == 1 and matches[0]["status"] == "online" else DEGRADED


def show_once(args: argparse.Namespace, document: dict[str, Any], console: Console) -> int:
    """Print the document (JSON or tables); the exit code it deserves."""
    if args.peer is not None:
        matches = find_peer(document, args.peer)
        if len(matches) != 1:
            names = ", ".join(p["short_id"] for p in matches[:10])
            message = f"no peer matches {args.peer!r}" if not matches else f"{args.peer!r} matches {names}"
            print(f"peer-status: {message}; give more of the peer id", file=sys.stderr)
            return DEGRADED
        if args.json:
            print(json.dumps(matches[0]), flush=True)
        else:
            console.print(peer_table(matches[0]))
        return verdict(args, document)
    if args.json:
        print(json.dumps(document), flush=True)
    else:
        console.print(render(args, document))
    return exit_code(document)


def render(args: argparse.Namespace, document: dict[str, Any]) -> Group:
    if args.peer is not None:
        matches = find_peer(document, args.peer)
        return Group(peer_table(matches[0]) if len(matches) == 1 else Text(f"no single peer matches {args.peer!r}"))
    swarm, health, training = document["swarm"], document["health"], document["training"]
    model = swarm["model"]
    header = Text.assemble(
        ("swarm ", "bold"),
        (swarm["name"], "bold cyan"),
        f" (id {swarm['swarm_id']})  ",
        f"model {model['parameters'] / 1e6:.1f}M parameters ({model['depth']} layers, width {model['width']}), ",
        f"{swarm['stages']} stages, {swarm['peers_online']} peers online",
        f" ({swarm['peers_unreachable']} not reachable: they dial out)\n" if swarm["peers_unreachable"] else "\n",
        f"manifest {swarm['manifest']}\n",
    )
    if health["healthy"]:
        verdict = Text("healthy: every stage is served", style="bold green")
    else:
        stages = ", ".join(map(str, health["unserved_stages"]))
        verdict = Text(f"degraded: no online peer serves stage {stages}", style="bold red")
    efficiency = health["balance_efficiency"]
    verdict.append(
        f"  bottleneck: stage {health['bottleneck_stage']} ({health['bottleneck_throughput']:.1f} samples/s)"
        + (f", balance efficiency {efficiency:.0%}" if efficiency is not None else ""),
        style="default",
    )
    loss = "-" if training["loss"] is None else f"{training['loss']:.3f}"
    progress = Text(
        f"training: {training['trainers']} trainers, {training['samples_per_second']:.1f} samples/s "
        f"({training['tokens_per_second']:.0f} tokens/s), recent loss {loss}, "
        f"{_count(training['tokens_trained'])} tokens trained so far"
    )
    tables = (stage_table(document), peers_table(document), contributors_table(document))
    return Group(header, verdict, *tables, progress, data_table(document))


def data_table(document: dict[str, Any]) -> Group | Text:
    """The swarm's reading of its data, and each trainer's (swarm/watch/data_progress.py)."""
    data = document.get("data")
    if data is None:
        return Text("data: the trainers' reading could not be read from the DHT")
    if not data["readers"]:
        return Text("data: no trainer has said what it reads yet")
    others = f"; {data['other_readers']} more read other data" if data["other_readers"] else ""
    summary = Text(  # Text(): the data's name comes from the network
        f"data {data['data'][:12]}: epoch {data['epoch']}, {data['epoch_read']:.1%} of it read "
        f"({data['chunks_finished']} of {data['chunks']} chunks finished, {data['chunks_reading']} being read); "
        f"{_count(data['tokens_read'])} tokens read by {data['readers']} trainer{'s' if data['readers'] > 1 else ''}, "
        f"{data['duplicates']} chunks read twice, {_count(data['bytes_fetched'])}B fetched{others}"
    )
    table = Table(title="trainers' reading", title_justify="left")
    numbers = ("epoch", "chunk", "windows", "tokens", "chunks read", "read twice", "fetched", "held")
    for column in ("trainer", *numbers, "cache"):
        table.add_column(column, justify="right" if column in numbers else "left")
    for t in data["trainers"]:
        table.add_row(
            Text(t["short_id"]),
            str(t["epoch"]),
            "-" if t["chunk"] is None else str(t["chunk"]),
            str(t["windows"]),
            _count(t["tokens_read"]),
            str(t["chunks_read"]),
            str(t["duplicates"]),
            f"{_count(t['bytes_fetched'])}B",
            str(t["chunks_held"]),  # chunks it can hand to other peers
            f"{_count(t['cache_bytes'])}B of {_count(t['cache_cap'])}B" if t["cache_cap"] else "-",
        )
    return Group(summary, table)


def contributors_table(document: dict[str, Any]) -> Table:
    """The top volunteers by attested samples: what trainers vouch for in signed reports, not what peers claim."""
    table = Table(title="top contributors (samples attested by trainers)", title_justify="left")
    for column in ("rank", "peer", "name", "attested", "claimed"):
        table.add_column(column, justify="right" if column in ("rank", "attested", "claimed") else "left")
    for rank, p in enumerate(document["contributors"], start=1):
        table.add_row(
            str(rank),
            Text(p["short_id"]),
            Text(p["public_name"] or "-"),
            _count(p["attested_samples"]),
            _count(p["claimed_samples"]),
        )
    return table


def stage_table(document: dict[str, Any]) -> Table:
    table = Table(title="stages", title_justify="left")
    for column in ("stage", "layers", "online peers", "throughput", "delivered", "samples served", "rounds"):
        table.add_column(column, justify="left" if column in ("stage", "layers") else "right")
    for row in document["stages"]:
        start, end = row["layers"]
        online = str(row["online_peers"]) + (f" (+{row['joining_peers']} joining)" if row["joining_peers"] else "")
        style = "red" if row["online_peers"] == 0 else None
        table.add_row(
            str(row["stage"]),
            f"{start}..{end - 1}",
            online,
            f"{row['throughput']:.1f}/s",
            f"{row['delivered_throughput']:.1f}/s",
            _count(row["samples_served"]),
            str(row["averaging_rounds"]),
            style=style,
        )
    return table


def peers_table(document: dict[str, Any]) -> Table:
    table = Table(title="peers", title_justify="left")
    columns = (
        "peer", "name", "stages", "state", "behind", "speed", "delivered", "attested", "claimed", "queue", "memory", "uptime", "seen"
    )  # fmt: skip
    numbers = ("speed", "delivered", "attested", "claimed", "queue")
    for column in (*columns, "device", "version", "reachable"):
        table.add_column(column, justify="right" if column in numbers else "left")
    for p in document["peers"]:
        table.add_row(  # Text(): strings from the network are never read as rich markup
            Text(p["short_id"]),
            Text(p["public_name"] or "-"),
            _stages(p.get("span") or [p["stage"], p["stage"] + 1])
            + (f" -> {_stages(p['moving_to'])}" if p.get("moving_to") else ""),
            Text(_state(p), style=STATUS_STYLES.get(p["status"], "default")),
            _behind(p.get("steps_behind", 0)),
            f"{p['throughput']:.1f}/s",
            f"{p['delivered_throughput']:.1f}/s",
            _count(p["attested_samples"]),  # what trainers vouch for in their signed reports
            _count(p["samples_served"]),  # what the peer says of itself
            str(p["outstanding"]),
            _memory(p.get("memory_used", 0), p.get("memory_available", 0)),
            _duration(p["uptime"]),
            f"{_duration(p['last_seen'])} ago",
            Text(p["device"]),
            Text(p["version"]),
            "yes" if p["reachable"] else "no (dials out)",
        )
    return table


def peer_table(peer: dict[str, Any]) -> Table:
    table = Table("field", "value", title=Text(f"peer {peer['peer_id']}"), title_justify="left")
    for key, value in peer.items():
        table.add_row(key, Text(str(value), style=STATUS_STYLES.get(value, "default") if key == "status" else ""))
    return table


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _memory(used: int, available: int) -> str:
    """'5.20 GiB of 7.20 GiB': what the peer holds of what it may use; '-' from a peer that does not say."""
    return f"{format_memory(used)} of {format_memory(available)}" if available else "-"


def _state(peer: dict) -> str:
    """Its status; for a peer no longer announced, whether it said it left or just vanished."""
    return f"gone ({peer['departure']})" if peer["status"] == "gone" and peer.get("departure") else peer["status"]


def _behind(steps: int) -> str:
    """How stale the state a peer took over was (a checkpoint's optimizer steps behind the stage): what was lost."""
    return f"{steps} steps" if steps else "-"


def _stages(span: list[int]) -> str:
    """'3', or '3-7' for a peer serving a span."""
    start, end = span
    return str(start) if end - start == 1 else f"{start}-{end - 1}"


if __name__ == "__main__":
    sys.exit(main())
