"""A peer's start-up, as one library call a program or a test makes: `start_node` (before any event loop: the
initial peers, the identity, whether others can dial this peer, the DHT node) and then `enter_swarm` (in the
event loop: the manifest from a peer if --join named one, signed records, the clock against the swarm's). What
each step finds goes to `say`, one line each: swarm-peer prints them.

start_node runs outside any event loop, before the DHT node forks its process (hivemind's DHT must start before
any thread exists); its steps may each wait on the network for a few seconds: they ask other peers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from hivemind import DHT
from hivemind.p2p import P2P

from swarm.client import joining
from swarm.dht import node
from swarm.errors import PeerStartError
from swarm.manifests.loading import write_manifest
from swarm.manifests.manifest import Manifest
from swarm.network.startup_cache import StartupCache, reachability_key
from swarm.peer.clock import check_clock
from swarm.preflight.checks import Status
from swarm.server.reachability import Verdict, check_reachability
from swarm.trust.identity import claim_identity, identity_taken, without_own_address
from swarm.trust.signing import IdentityKey

CACHED_REACHABILITY = "as found by a start within the last hour with these addresses"


@dataclass
class PeerIdentity:
    """The key this peer signs its records with and, with --identity, its file and the lock on that file (two peers
    must never share an identity): `release()` it when the peer has stopped."""

    key: IdentityKey
    path: Path | None = None  # None: a new identity for this run only
    lock: FileLock | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim_peer_identity(
    path: Path | None, initial_peers: list[str], startup: StartupCache
) -> tuple[PeerIdentity, list[str]]:
    """This peer's identity: kept in `path` (created if missing, locked while the peer runs), else a new one; and
    the initial peers to join through, without this peer's own address (a restart finds it in the manifest, where
    nobody answers). Raises PeerStartError if the file is unusable, or a peer with its id is in the swarm already."""
    if path is None:
        return PeerIdentity(IdentityKey.generate()), initial_peers
    own_id, lock = claim_identity(path)
    try:
        # asked with its own address among the initial peers: a live peer there with this id is a twin (not asked
        # when this identity last ran on this machine: the lock rules out a twin here)
        if not startup.identity_ran_here(path) and asyncio.run(identity_taken(path, initial_peers)):
            raise PeerStartError(
                f"--identity {path}: a peer with this id ({own_id}) is already in the swarm; two peers cannot share "
                "an identity: stop the other one, or give this peer its own file"
            )
        key = IdentityKey.from_file(path)
    except BaseException:
        lock.release()
        raise
    return PeerIdentity(key, path, lock), without_own_address(initial_peers, own_id)


def find_reachability(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None,
    manifest: Manifest | None,
    startup: StartupCache,
) -> tuple[Verdict, str]:
    """Whether other peers can dial this one, and how that was found out: a few of them are asked to dial it back,
    unless a start within the last hour with the same fixed addresses found out already (swarm/network/
    startup_cache.py). A verdict of None: nobody could be asked, or nobody answered."""
    key = reachability_key(host_maddrs, announce_maddrs)
    cached = startup.reachability(key) if initial_peers else None
    if cached is not None:
        return Verdict(*cached), CACHED_REACHABILITY
    started = time.monotonic()
    verdict = asyncio.run(check_reachability(initial_peers, host_maddrs, announce_maddrs, manifest))
    took = f"checked in {time.monotonic() - started:.1f} s"
    if verdict.reachable is not None:
        startup.remember_reachability(key, verdict.reachable, verdict.detail)
    return verdict, took


def publish_addresses(manifest: Manifest, addrs: list[str], path: Path, new_swarm: bool) -> None:
    """Write the manifest to `path` with this peer's addresses first among its initial peers (of a new swarm: only
    they), ready for the swarm's creator to publish. Raises ManifestError if it cannot be written."""
    own = node.publishable_maddrs(addrs)
    others = [] if new_swarm else [a for a in manifest.initial_peers if a not in own]
    write_manifest(manifest.with_initial_peers(own + others), path)


# ------------------------------------------------------------------------------------------------ the whole start


@dataclass(frozen=True)
class JoinOptions:
    """How a peer joins: what swarm-peer's --join, --new-swarm, --host-maddrs, --announce-maddrs, --no-listen and
    --identity say."""

    join: str  # a manifest's path or URL, or a running peer's multiaddr
    new_swarm: bool = False
    host_maddrs: Sequence[str] = tuple(node.ALL_INTERFACES)
    announce_maddrs: Sequence[str] = ()
    no_listen: bool = False
    identity_path: Path | None = None


@dataclass
class StartedNode:
    """A peer's DHT node, started and not yet in its swarm (enter_swarm)."""

    dht: DHT
    identity: PeerIdentity
    manifest: Manifest | None  # None: --join named a peer, which hands the manifest out (enter_swarm asks it)
    reachable: bool  # whether other peers can dial this one (as far as the start-up could tell)
    sockets_before: set[Path]  # p2pd's socket files that were there before this node started

    def stop(self) -> None:
        """Stop the DHT node and release the identity (once the peer has stopped)."""
        self.dht.shutdown()
        # a Ctrl-C to the whole process group can end p2pd before it removes its socket file: remove the ones
        # that appeared since this peer started and that nobody listens on any more (live daemons are left alone)
        node.remove_stale_sockets(node.daemon_sockets() - self.sockets_before)
        self.identity.release()


def start_node(options: JoinOptions, manifest: Manifest | None, say: Callable[[str], None]) -> StartedNode:
    """Everything before the event loop, in order: the initial peers (of `manifest`, or the peer --join names), this
    peer's identity (claimed: two peers never share one), whether others can dial it, and its DHT node. Raises
    PeerStartError with a line that says what to do; whatever it had started is stopped then."""
    initial_peers = [] if options.new_swarm else joining.bootstrap_peers(options.join, manifest)
    sockets_before = node.daemon_sockets()
    startup = StartupCache()  # answers of earlier starts on this machine (swarm/network/startup_cache.py)
    identity, initial_peers = claim_peer_identity(options.identity_path, initial_peers, startup)
    try:
        if not initial_peers and not options.new_swarm:
            say("the manifest lists no initial peers: starting a new swarm")
        reachable = _decide_reachability(options, initial_peers, manifest, startup, say)
        dht = node.start_dht(
            initial_peers,
            list(options.host_maddrs),
            list(options.announce_maddrs) or None,
            client_mode=not reachable,
            no_listen=options.no_listen,
            identity_path=options.identity_path,
            secret=manifest.secret if manifest is not None else None,
            identity=identity.key,
        )
    except BaseException:
        identity.release()
        raise
    if options.identity_path is not None:
        startup.remember_identity(options.identity_path)
    return StartedNode(dht, identity, manifest, reachable, sockets_before)


def _decide_reachability(
    options: JoinOptions,
    initial_peers: list[str],
    manifest: Manifest | None,
    startup: StartupCache,
    say: Callable[[str], None],
) -> bool:
    if options.no_listen:
        say("--no-listen: others cannot dial this peer; it opens connections to them instead")
        return False
    announce = list(options.announce_maddrs) or None
    verdict, took = find_reachability(initial_peers, list(options.host_maddrs), announce, manifest, startup)
    if verdict.reachable is False:
        say(
            f"this peer is NOT reachable from other peers: {verdict.detail} ({took}). It takes part anyway: it opens "
            "connections to the peers that call it, and announces that it does. To be reachable, open or forward "
            "a port (--host-maddrs /ip4/0.0.0.0/tcp/PORT) and announce your public address (--announce-maddrs)"
        )
        return False
    if verdict.reachable is None:
        say(f"reachability not checked ({verdict.detail}); assuming other peers can dial this one")
    else:
        say(f"reachable: {verdict.detail} ({took})")
    return True


async def enter_swarm(started: StartedNode, join: str, say: Callable[[str], None]) -> tuple[Manifest, P2P]:
    """In the event loop: this peer's P2P handle, the manifest (asked of the peer --join names, if it was not read
    before), records signed with the peer's key, and its clock checked against the swarm's (off by more than the
    DHT allows: PeerStartError; off a little: a warning said)."""
    dht = started.dht
    p2p = await dht.replicate_p2p()
    manifest = started.manifest
    if manifest is None:
        manifest = await joining.manifest_through_peer(p2p, join, manifest)
    node.sign_records(dht, manifest, started.identity.key)  # before any record is written or read
    say(f"swarm {manifest.name!r} (id {manifest.swarm_id}), peer {dht.peer_id}")
    clock = await check_clock(p2p, manifest, str(dht.peer_id))
    if clock is not None and clock.status == Status.WARN:
        say(f"warning: {clock.detail}; {clock.remedy}")
    return manifest, p2p
