"""The preflight's verdicts on the swarm's side: the manifest, the initial peers, reachability, bandwidth and the
clock. Pure functions of what swarm/preflight/probes.py measured; the result type is swarm/preflight/checks.py's."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from swarm.dht.node import NTP_REMEDY
from swarm.manifests.manifest import Manifest
from swarm.preflight.checks import Check, Status
from swarm.server.reachability import Verdict

# Psyche's published minimum for a node's link, and what it recommends (Mbit/s)
MIN_DOWNLOAD_MBITS, MIN_UPLOAD_MBITS = 10.0, 5.0
RECOMMENDED_DOWNLOAD_MBITS, RECOMMENDED_UPLOAD_MBITS = 50.0, 20.0
# hivemind's DHT refuses to bootstrap from peers whose clock is more than this far from its own (a ping's time is
# checked, hivemind/dht/protocol.py): past it a peer cannot even join
DHT_CLOCK_TOLERANCE = float(MAX_DHT_TIME_DISCREPANCY_SECONDS)
CLOCK_WARN_SECONDS = 1.0  # clocks drift: a third of the tolerance gone is worth fixing before it is all gone


def manifest_check(manifest: Manifest | None, error: str, source: str) -> Check:
    """`source`: where the manifest came from, as the table says it; `error`: why there is none (its message says
    what to check)."""
    if manifest is None:
        return Check("manifest", Status.FAIL, error, "see the message: it says what to check")
    private = ", private (its secret file was found)" if manifest.private else ""
    return Check(
        "manifest",
        Status.PASS,
        f"swarm {manifest.name!r} (id {manifest.swarm_id}), {manifest.num_stages} stages{private}, {source}",
        figures={"swarm_id": manifest.swarm_id, "name": manifest.name, "stages": manifest.num_stages},
    )


@dataclass(frozen=True)
class PeerAnswer:
    """One initial peer's answer to a DHT ping: its round trip, and its clock against this machine's."""

    address: str
    rtt: float | None = None  # seconds; None: it did not answer
    clock_offset: float | None = None  # its clock minus this machine's, seconds; None: it did not say
    error: str = ""


UNREACHABLE_REMEDY = (
    "check the machine's internet connection and firewall (outgoing TCP to the peers' ports); the swarm may be down: "
    "ask its creator for a current manifest"
)


def initial_peers_check(answers: list[PeerAnswer], start_error: str = "") -> Check:
    """Fail if no initial peer answers (nothing to join through), warn if some do not."""
    figures = {
        "peers": [{"address": a.address, "rtt_ms": _ms(a.rtt), "error": a.error or None} for a in answers],
    }
    if not answers:
        return Check(
            "initial_peers",
            Status.FAIL,
            "the manifest lists no initial peers, so there is no swarm to join yet",
            "use the manifest that the swarm's first peer wrote (swarm-peer --new-swarm), or --join a running peer",
            figures=figures,
        )
    answered = [a for a in answers if a.rtt is not None]
    silent = [a for a in answers if a.rtt is None]
    if not answered:
        # the DHT's start-up error ends with the daemon's own text, long and repeating the addresses: left out here
        without_daemon_text = re.sub(r" \(\w+: .*\)$", "", start_error, flags=re.DOTALL)[:300]
        why = without_daemon_text or "; ".join(f"{_short(a.address)}: {a.error}" for a in silent[:3])
        return Check(
            "initial_peers",
            Status.FAIL,
            f"cannot reach any of the {len(answers)} initial peers ({why})",
            UNREACHABLE_REMEDY,
            figures=figures,
        )
    times = ", ".join(f"{_short(a.address)} {_ms(a.rtt)} ms" for a in answered)
    if silent:
        return Check(
            "initial_peers",
            Status.WARN,
            f"{len(answered)} of {len(answers)} answer (round trip: {times}); silent: "
            + "; ".join(f"{_short(a.address)} ({a.error})" for a in silent[:3]),
            "nothing to do if one answers; tell the swarm's creator that some initial peers are down",
            figures=figures,
        )
    which = "the initial peer answers" if len(answers) == 1 else f"all {len(answers)} initial peers answer"
    return Check("initial_peers", Status.PASS, f"{which} (round trip: {times})", figures=figures)


def _peers(count: int) -> str:
    return f"{count} peer{'s' if count != 1 else ''}"


def _short(address: str) -> str:
    """An initial peer's address, shortened for a table: its IP and port, and the end of its peer id."""
    parts = address.split("/")
    where = f"{parts[2]}:{parts[4]}" if len(parts) > 4 else address[:40]
    return f"{where} (…{address[-6:]})" if "/p2p/" in address else where


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def reachability_check(verdict: Verdict | None, no_listen: bool) -> Check:
    """Never a failure: a peer that others cannot dial still serves, over the connections it opens."""
    remedy = (
        "to be dialable, open or forward a port (--host-maddrs /ip4/0.0.0.0/tcp/PORT) and announce your public "
        "address (--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT); a swarm needs some peers that can be dialed"
    )
    if no_listen:
        return Check("reachability", Status.WARN, "--no-listen: others cannot dial this peer (it dials them)", remedy)
    if verdict is None or verdict.reachable is None:
        detail = verdict.detail if verdict is not None else "not checked"
        return Check(
            "reachability",
            Status.WARN,
            f"unknown: {detail}",
            "nothing to do; swarm-peer checks again at its start",
            figures={"reachable": None},
        )
    if not verdict.reachable:
        return Check(
            "reachability",
            Status.WARN,
            f"others cannot dial this machine: {verdict.detail}. It still serves, over connections it opens itself",
            remedy,
            figures={"reachable": False},
        )
    return Check("reachability", Status.PASS, f"dialable: {verdict.detail}", figures={"reachable": True})


def bandwidth_check(measured: list[tuple[str, float, float]], error: str = "") -> Check:
    """`measured`: (peer, download, upload) in bytes/s, from bandwidth probes; the best link found counts."""
    if not measured:
        return Check(
            "bandwidth",
            Status.WARN,
            f"not measured: {error or 'no online stage peer to measure against'}",
            "nothing to do; swarm-peer measures it again at its start (or say it: --bandwidth MBITS)",
        )
    down = max(d for _, d, _ in measured) * 8e-6
    up = max(u for _, _, u in measured) * 8e-6
    figures = {"download_mbits": round(down, 1), "upload_mbits": round(up, 1), "peers": [p for p, _, _ in measured]}
    figure = f"{down:.0f} Mbit/s down, {up:.0f} up (against {_peers(len(measured))})"
    if down < MIN_DOWNLOAD_MBITS or up < MIN_UPLOAD_MBITS:
        return Check(
            "bandwidth",
            Status.WARN,
            f"{figure}: below the minimum of {MIN_DOWNLOAD_MBITS:.0f} down / {MIN_UPLOAD_MBITS:.0f} up",
            "use a faster or less busy link (wired rather than Wi-Fi); this machine would slow its stage down",
            figures=figures,
        )
    if down < RECOMMENDED_DOWNLOAD_MBITS or up < RECOMMENDED_UPLOAD_MBITS:
        recommended = f"{RECOMMENDED_DOWNLOAD_MBITS:.0f} / {RECOMMENDED_UPLOAD_MBITS:.0f}"
        return Check(
            "bandwidth", Status.PASS, f"{figure}: enough, below the recommended {recommended}", figures=figures
        )
    return Check("bandwidth", Status.PASS, figure, figures=figures)


# ---------------------------------------------------------------------------------------------------- clock


def offsets_from_records(expirations: list[float], lifetime: float, announce_period: float, now: float) -> list[float]:
    """Each record's writer's clock minus this machine's: a record expires `lifetime` after its writer's clock read
    when it was written, at most one announce period ago (taken as half of one, the middle)."""
    return [expiration - lifetime + announce_period / 2 - now for expiration in expirations]


def clock_check(ping_offsets: list[float], record_offsets: list[float], lifetime: float) -> Check:
    """The median offset of the peers' clocks against this one: from the DHT pings' times if any (within half a
    round trip), else from the records' expirations (within half an announce period). Off by more than the DHT's
    tolerance (by the pings) or a record's lifetime (by the records, which are that much vaguer): a failure, as the
    DHT would refuse this peer, or the others drop its records as expired; by more than CLOCK_WARN_SECONDS (by the
    pings) or the DHT's tolerance (by the records): a warning."""
    offsets, source = (ping_offsets, "DHT pings") if ping_offsets else (record_offsets, "DHT records")
    if not offsets:
        return Check(
            "clock",
            Status.WARN,
            "not estimated: no peer told its time and no record of the swarm could be read",
            "make sure the clock is synchronised: " + NTP_REMEDY,
        )
    offset = -statistics.median(offsets)  # this machine's clock minus the peers'
    figures = {"offset_seconds": round(offset, 3), "source": source, "samples": len(offsets)}
    said = clock_offset_said(offset, f"from {source} of {_peers(len(offsets))}")
    if ping_offsets:
        fail_past, warn_past = min(lifetime, DHT_CLOCK_TOLERANCE), CLOCK_WARN_SECONDS
        limit = f"more than the {DHT_CLOCK_TOLERANCE:g} s the DHT allows, so its peers would refuse this one"
    else:
        fail_past, warn_past = lifetime, DHT_CLOCK_TOLERANCE
        limit = f"more than a record's lifetime ({lifetime:g} s), so others would drop its records as expired"
    if abs(offset) > fail_past:
        return Check("clock", Status.FAIL, f"{said}: {limit}", NTP_REMEDY, figures=figures)
    if abs(offset) > warn_past:
        return Check("clock", Status.WARN, said, NTP_REMEDY, figures=figures)
    return Check("clock", Status.PASS, said, figures=figures)


def clock_offset_said(offset: float, source_said: str) -> str:
    """`offset`: this machine's clock minus the peers' (seconds)."""
    if abs(offset) < 0.05:
        return f"this machine's clock agrees with the peers' within 0.1 s ({source_said})"
    side = "ahead of" if offset > 0 else "behind"
    return f"this machine's clock is {abs(offset):.1f} s {side} the peers' ({source_said})"
