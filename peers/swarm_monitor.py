"""swarm-monitor: a web page (and API) that watches a swarm, with its history in SQLite.

A DHT client that serves nothing and stores nothing, like peer-status; it reads the swarm every few seconds,
writes each sample to its history, and serves the page. The library parts are in swarm/monitor/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

from peers import runtime
from swarm import __version__, lifetime
from swarm.client import joining
from swarm.dht import node
from swarm.errors import HistoryError, SwarmError
from swarm.manifests.manifest import Manifest
from swarm.monitor.history import History, default_history_path
from swarm.monitor.leaderboard import Leaderboard
from swarm.monitor.sampling import peer_rows, stage_rows, swarm_sample
from swarm.monitor.server import MonitorServer, MonitorState
from swarm.monitor.trackers import TensorBoardTracker, Tracker, Trackers, WandbTracker
from swarm.watch.reader import SwarmReader, found_anyone
from swarm.watch.status import UNREACHABLE

logger = logging.getLogger("swarm.monitor")

EXAMPLES = """\
examples:
  swarm-monitor --join https://example.org/my-swarm.json
      the page at http://127.0.0.1:8080/, history in ~/.cache/swarm/monitor/<swarm id>.sqlite
  swarm-monitor --join my-swarm.json --host 0.0.0.0 --port 8000 --history /var/lib/swarm/history.sqlite
      a public page (put it behind a reverse proxy with TLS), its history where you choose
  swarm-monitor --join /ip4/203.0.113.7/tcp/31337/p2p/QmXhR... --tensorboard runs/swarm
      also log loss, samples/s, peers and balance efficiency for TensorBoard (pip install 'swarm[tensorboard]')
  WANDB_MODE=offline swarm-monitor --join my-swarm.json --wandb my-project
      the same through wandb, to local files (pip install 'swarm[wandb]'; `wandb sync` uploads them later)

for scripts: curl -s http://127.0.0.1:8080/api/v1/state (peer-status --json's document),
  /api/v1/history?window=hour|day|week|all, /api/v1/leaderboard, /metrics (Prometheus), /healthz
  (HTTP 200 healthy, 503 degraded, 504 unreachable)

exit codes: 0 stopped (Ctrl-C or SIGTERM), 2 the swarm could not be reached at start, or a bad --history,
  --port or tracker
"""


REJOIN_AFTER = 10.0  # seconds of an unreachable swarm before the monitor joins its DHT again, and between tries


class SwarmConnection:
    """The monitor's DHT node, which it replaces when the swarm has been unreachable for a while: a client-mode
    node whose every neighbour left knows nobody any more, even when peers come back at the initial addresses."""

    def __init__(self, initial_peers: list[str], secret):
        self.initial_peers, self.secret = initial_peers, secret
        self.dht = self._start()
        self.manifest: Manifest | None = None

    def _start(self):
        return node.start_dht(self.initial_peers, [], client_mode=True, no_listen=True, secret=self.secret)

    async def rejoin(self) -> bool:
        """Join again through the initial peers; False (the old node kept) if none of them answers."""
        try:
            dht = await asyncio.to_thread(self._start)
        except SwarmError:
            return False
        if self.manifest is not None:
            node.sign_records(dht, self.manifest, None)
        old, self.dht = self.dht, dht
        await asyncio.to_thread(old.shutdown)
        return True

    def shutdown(self) -> None:
        self.dht.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-monitor",
        description="Watch a Swarm in the browser: health, stages, peers, plots over time and a volunteer "
        "leaderboard, with an API for scripts. It reads the DHT and stores nothing there.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runtime.add_join_argument(parser)
    parser.add_argument("--port", type=int, default=8080, help="port of the page (default 8080; 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine)")
    parser.add_argument("--history", default=None, metavar="PATH",
                        help="SQLite file of the history (default $SWARM_CACHE_DIR or ~/.cache/swarm, then "
                        "monitor/<swarm id>.sqlite)")  # fmt: skip
    parser.add_argument("--every", type=float, default=5.0, metavar="SECONDS", help="seconds between samples (5)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard scalars to DIR")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to this wandb project")
    parser.add_argument("--json", action="store_true", help="print where the page is as one JSON line")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error("--port must be between 0 and 65535")
    if not 1.0 <= args.every <= 3600:
        parser.error("--every must be between 1 and 3600 seconds")
    return args


@runtime.program("swarm-monitor")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.setup_logging("ERROR")  # hivemind's chatter about peers that left is not the monitor's news
    logging.getLogger("swarm").setLevel(logging.WARNING)
    connection = None
    try:
        manifest, initial_peers = joining.reader_join(args.join)  # no manifest: --join names a peer, which has it
        connection = SwarmConnection(initial_peers, manifest.secret if manifest else None)
        lifetime.stop_when_parent_is_gone()  # started by swarm-demo: not past its end (after the DHT's fork)
        runtime.stop_by_keyboard_interrupt()  # from here a stop writes the history first
        return asyncio.run(run(args, manifest, connection))
    except SwarmError as e:
        print(f"swarm-monitor: error: {e}", file=sys.stderr)
        return UNREACHABLE
    except KeyboardInterrupt:
        return 0
    finally:
        if connection is not None:
            connection.shutdown()


async def run(args: argparse.Namespace, manifest: Manifest | None, connection: SwarmConnection) -> int:
    if manifest is None:
        p2p = await connection.dht.replicate_p2p()
        try:
            manifest = await joining.manifest_through_peer(p2p, args.join, manifest)
        finally:
            await p2p.shutdown()  # else its p2pclient socket file stays behind in /tmp
    return await monitor(args, manifest, connection)


def make_trackers(args: argparse.Namespace, manifest: Manifest) -> Trackers:
    trackers: list[Tracker] = []
    if args.tensorboard:
        trackers.append(TensorBoardTracker(args.tensorboard))
    if args.wandb:
        config = {"swarm_id": manifest.swarm_id, "stages": manifest.num_stages, "model": manifest.model.architecture}
        trackers.append(WandbTracker(args.wandb, f"{manifest.name}-{manifest.swarm_id[:8]}", config))
    return Trackers(trackers)


async def monitor(args: argparse.Namespace, manifest: Manifest, connection: SwarmConnection) -> int:
    connection.manifest = manifest
    node.sign_records(connection.dht, manifest, None)  # a reader: it checks every record's signature, writes none
    reader = SwarmReader(manifest, args.join)
    document, reports = await reader.read(connection.dht)  # the first read must work: else exit 2
    reachable = found_anyone(document)
    history = History(args.history or default_history_path(manifest.swarm_id), manifest.swarm_id)
    trackers = None
    server = None
    try:
        leaderboard = Leaderboard(history)
        state = MonitorState(document, reachable, "" if reachable else "no record of the swarm was found")
        server = MonitorServer(state, history, leaderboard, args.host, args.port)
        trackers = make_trackers(args, manifest)
        server.start()
        where = {"url": server.url, "history": str(history.path), "samples": history.sample_count(),
                 "swarm_id": manifest.swarm_id}  # fmt: skip
        if args.json:
            print(json.dumps(where), flush=True)
        else:
            print(f"swarm-monitor: watching swarm {manifest.name} (id {manifest.swarm_id}); the page: {server.url}")
            print(f"  history: {history.path} ({where['samples']} samples so far); Ctrl-C to stop", flush=True)
        await sample_forever(args, reader, connection, state, history, leaderboard, trackers, document, reports)
    finally:
        if server is not None:
            server.stop()
        if trackers is not None:
            trackers.close()
        history.close()
    return 0


async def sample_forever(
    args: argparse.Namespace,
    reader: SwarmReader,
    connection: SwarmConnection,
    state: MonitorState,
    history: History,
    leaderboard: Leaderboard,
    trackers: Trackers,
    document: dict[str, Any],
    reports: list,
) -> None:
    """Record a sample, wait, read the swarm again; a failed read shows the swarm as unreachable, never stops.
    After REJOIN_AFTER seconds unreachable, the monitor joins the DHT again through the initial peers."""
    reachable, history_failing, ever_reachable = state.reachable, False, state.reachable
    lost_since = None if reachable else time.monotonic()
    while True:
        now = time.time()
        try:
            history.record(swarm_sample(document, reachable, now), stage_rows(document, reachable),
                           peer_rows(document, reachable))  # fmt: skip
            if reachable:
                leaderboard.update(document, reports, now)
            if history_failing:
                print("swarm-monitor: the history is written again", file=sys.stderr, flush=True)
            history_failing = False
        except HistoryError as e:  # a full disk, say: the page goes on with the live state
            if not history_failing:
                print(f"swarm-monitor: {e}; the page still shows the live state", file=sys.stderr, flush=True)
            history_failing = True
        if reachable:
            trackers.log(document, now)
        await asyncio.sleep(max(0.0, args.every - (time.time() - now)))
        was_reachable = reachable
        if lost_since is not None and time.monotonic() - lost_since > REJOIN_AFTER:
            lost_since = time.monotonic()  # the next try, if this one finds nobody, is REJOIN_AFTER from now
            if await connection.rejoin():
                print("swarm-monitor: joined the swarm's DHT again", file=sys.stderr, flush=True)
        try:
            document, reports = await reader.read(connection.dht)
            reachable = found_anyone(document)
            error = "" if reachable else "the DHT answered, but holds no record of the swarm's peers or trainers"
        except SwarmError as e:
            reachable, error, reports = False, str(e), []
        state.update(document, reachable, error)
        if reachable:
            lost_since = None
        elif lost_since is None:
            lost_since = time.monotonic()
        if was_reachable != reachable:
            again = " again" if ever_reachable else ""
            ever_reachable = ever_reachable or reachable
            news = f"reachable{again}" if reachable else f"unreachable ({error}); still trying"
            print(f"swarm-monitor: {time.strftime('%H:%M:%S')} the swarm is {news}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
