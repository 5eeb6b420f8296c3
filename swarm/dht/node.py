"""Starting a hivemind DHT node with clear errors, and what its process leaves on this machine and shows others.

`start_dht` starts a node (its own process and p2pd daemon) under a known libp2p identity, turning every failure
into a PeerStartError that says what to check; `sign_records` makes the node sign this peer's records and refuse
unsigned ones (swarm/trust/signing.py); `daemon_sockets` and `remove_stale_sockets` clean up the socket files a
failed or killed daemon leaves behind; `visible_maddrs` and `publishable_maddrs` are the addresses worth giving to
other peers. What --join names, and whom a node bootstraps through, is swarm/client/joining.py's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import tempfile
from pathlib import Path

from hivemind import DHT
from multiaddr import Multiaddr

from swarm import lifetime
from swarm.dht.records import DHT_CALL_TIMEOUT, is_loopback, protected_keys, without_loopback_unless_only
from swarm.errors import PeerStartError
from swarm.manifests.manifest import Manifest
from swarm.trust.secret import SwarmSecret
from swarm.trust.signing import IdentityKey, protect_records

ALL_INTERFACES = ["/ip4/0.0.0.0/tcp/0"]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class GroupedDHT(DHT):
    """hivemind's DHT, whose process (and the p2pd daemon it starts) runs in a process group of its own.

    A terminal's Ctrl-C goes to the whole foreground process group at once, and p2pd stops on SIGINT even where it
    is ignored: it would be gone before the peer could announce that it leaves, hand its stages over or save them.
    Out of the group, only the peer hears the Ctrl-C, and it stops the DHT process itself (DHT.shutdown) last."""

    def run(self) -> None:
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # not the peer's handlers, which it inherits: a plain end
            signal.signal(sig, signal.SIG_DFL)
        lifetime.end_group_when_parent_is_gone()  # a peer killed outright leaves no DHT process or p2pd behind
        super().run()


def start_dht(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None = None,
    client_mode: bool = False,
    startup_timeout: float = 20.0,
    no_listen: bool = False,
    identity_path: Path | None = None,
    secret: SwarmSecret | None = None,
    identity: IdentityKey | None = None,
) -> DHT:
    """Start a hivemind DHT node (its own process and p2pd daemon), turning failures into PeerStartError.
    With a private swarm's `secret`, the node talks only to nodes that hold it (see swarm/trust/secret.py).

    The node's libp2p key is the one in `identity_path`, else `identity` (else a new one): the key must be
    known here, because the peer signs its records with it (swarm/trust/signing.py); p2pd reads it from a file, which
    for a key without a path lives only until the daemon has started."""
    check_listen_maddrs(host_maddrs, "--host-maddrs")
    check_listen_maddrs(announce_maddrs or [], "--announce-maddrs")
    sockets_before = daemon_sockets()
    with tempfile.TemporaryDirectory(prefix="swarm-identity-") as folder:
        if identity_path is None:
            identity_path = Path(folder) / "identity.key"
            (identity or IdentityKey.generate()).write(identity_path)
        return _start_dht(
            initial_peers,
            host_maddrs,
            announce_maddrs,
            client_mode,
            startup_timeout,
            no_listen,
            identity_path,
            secret,
            sockets_before,
        )


DHT_READY_SLACK = 15.0  # seconds past the daemon's startup timeout for the bootstrap (its pings are bounded too)


def _start_dht(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None,
    client_mode: bool,
    startup_timeout: float,
    no_listen: bool,
    identity_path: Path,
    secret: SwarmSecret | None,
    sockets_before: set[Path],
) -> DHT:
    dht = None
    try:
        dht = GroupedDHT(
            initial_peers=list(initial_peers),
            start=False,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            client_mode=client_mode or no_listen,  # nobody could reach its DHT requests' handlers
            startup_timeout=startup_timeout,
            **({"no_listen": True} if no_listen else {}),
            # the peer checked that the identity is free itself (swarm/trust/identity.py), with a clearer error
            identity_path=str(identity_path),
            check_if_identity_free=False,
            wait_timeout=DHT_CALL_TIMEOUT,  # what records' lifetimes allow for (swarm/dht/records.py)
            **({"authorizer": secret.authorizer()} if secret is not None else {}),
        )
        # hivemind's DHT(start=True) waits for its process with no deadline: one that died starting would hang us
        dht.run_in_background(await_ready=True, timeout=startup_timeout + DHT_READY_SLACK)
        return dht
    except Exception as e:
        if dht is not None and dht.is_alive():  # it did not get ready in time
            dht.shutdown()
        remove_stale_sockets(daemon_sockets() - sockets_before)
        if isinstance(e, TimeoutError):
            raise PeerStartError(
                f"could not join the DHT: it did not get ready in {startup_timeout + DHT_READY_SLACK:g} s (this "
                "machine is very busy, or its initial peers answer too slowly); try again"
            ) from None
        refusal = clock_refusal(str(e))
        if refusal:
            raise PeerStartError(refusal) from None
        hint = start_failure_hint(str(e), initial_peers, host_maddrs)
        raise PeerStartError(f"could not join the DHT: {hint} ({type(e).__name__}: {e})") from None


NTP_REMEDY = "enable NTP time synchronisation (on Linux: sudo timedatectl set-ntp true)"
CLOCK_REFUSED = re.compile(r"local time must be within (\d+) seconds.*local: ([\d.]+), peer: ([\d.]+)", re.S)


def clock_refusal(error: str) -> str | None:
    """hivemind's DHT refuses to bootstrap from a peer whose clock is more than 3 s from its own, and says only that
    no initial peer could be reached, with the two times in the ping's ValidationError: say what it means."""
    refused = CLOCK_REFUSED.search(error)
    if not refused:
        return None
    tolerance, local, peer = int(refused.group(1)), float(refused.group(2)), float(refused.group(3))
    offset = local - peer
    side = "ahead of" if offset > 0 else "behind"
    return (
        f"this machine's clock is {abs(offset):.0f} s {side} the peers' (an initial peer's DHT told its time): the DHT "
        f"refuses peers more than {tolerance} s off; {NTP_REMEDY}, then start again"
    )


def start_failure_hint(error: str, initial_peers: list[str], host_maddrs: list[str] | None) -> str:
    """What went wrong when the DHT did not start, and what to do, from the daemon's error text."""
    listening = ", ".join(host_maddrs or []) or "the default address"
    port = re.search(r"(?:tcp|udp)4?6? [^ ]*:(\d+): bind", error)
    if "address already in use" in error:
        what = f"port {port.group(1)}" if port else "the port"
        return (
            f"{what} of {listening} is in use by another program (another swarm-peer?): stop it, or choose another "
            "port in --host-maddrs (tcp/0 takes a free one)"
        )
    if "cannot assign requested address" in error:
        return f"{listening} is not an address of this machine: listen on /ip4/0.0.0.0/tcp/PORT or one of its own"
    if initial_peers:
        named = ", ".join(initial_peers[:3]) + (f" and {len(initial_peers) - 3} more" if len(initial_peers) > 3 else "")
        return (
            f"no initial peer could be reached ({named}); check that they are running and that their addresses "
            "are reachable from here"
        )
    return "the DHT daemon did not start"


def sign_records(dht: DHT, manifest: Manifest, identity: IdentityKey | None) -> None:
    """Make `dht` sign this peer's records of the swarm with `identity` (None: a reader that writes none) and refuse
    the swarm's records that are not signed by the peer they name (swarm/trust/signing.py)."""
    protect_records(dht, protected_keys(manifest.swarm_id, manifest.num_stages), identity)


def daemon_sockets() -> set[Path]:
    """The p2pd socket files in the temporary folder now: taken before a start, to tell which ones it left."""
    return set(Path(tempfile.gettempdir()).glob("hivemind-p2p*.sock"))


def remove_stale_sockets(paths: set[Path]) -> None:
    """hivemind 1.1.12 leaves the p2pd socket file behind when the daemon fails to start, and a killed daemon
    cannot remove its own; remove the ones that nobody listens on any more (a live daemon answers, and is left
    alone)."""
    for path in paths:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                path.unlink(missing_ok=True)
            except OSError:
                pass


def check_listen_maddrs(values: list[str], flag: str) -> None:
    """PeerStartError naming `flag` unless every value is a multiaddr (one to listen on or announce: no /p2p/ part
    needed)."""
    for value in values:
        try:
            Multiaddr(value)
        except Exception as e:  # the multiaddr library raises several unrelated types
            raise PeerStartError(f"{flag}: {value!r} is not a valid multiaddr ({e})") from None


def visible_maddrs(dht: DHT) -> list[str]:
    """Multiaddrs other peers can dial, loopback and wildcard addresses last."""
    try:
        addrs = [str(a) for a in dht.get_visible_maddrs()]
    except ValueError:  # hivemind raises this for a node that does not listen (--no-listen)
        return []
    return sorted(addrs, key=lambda a: (is_loopback(a), a))


def publishable_maddrs(addrs: list[str]) -> list[str]:
    """The addresses worth giving to peers on other machines: all but loopback ones, unless only those exist."""
    return without_loopback_unless_only(addrs)
