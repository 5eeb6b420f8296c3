"""The preflight's order of work: what swarm-peer --check runs, and with what deadlines.

It reads the manifest the way swarm-peer does (swarm/client/joining.py), joins the DHT as a client that listens
on nothing and writes no record (as peer-status does), pings the initial peers, reads the swarm's records, asks
peers to dial a short-lived node of its own back (swarm/server/reachability.py), probes the bandwidth to a stage
peer or two, checks the training data's source (swarm/preflight/data_probes.py: its index, one chunk, room for
the data cache), then runs a test kernel and sizes what fits in memory and on disk. It serves nothing, announces
nothing, trains nothing and writes no lasting file (the data chunk goes to a temporary folder, removed after). The
DHT starts first, before CUDA, as in swarm-peer: hivemind forks its process; the data's reads start threads after
it stopped.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from swarm.capacity.budget import usable_budget
from swarm.capacity.costs import MemorySettings
from swarm.client import joining
from swarm.dataset.cache import DEFAULT_CAP
from swarm.dht import node
from swarm.dht.records import Announcement, announcement_lifetime
from swarm.errors import SwarmError
from swarm.manifests.manifest import Manifest
from swarm.preflight import checks, data_checks, probes, swarm_checks
from swarm.preflight.checks import Check, ExitCode, skipped
from swarm.preflight.data_probes import probe_data
from swarm.preflight.swarm_checks import PeerAnswer
from swarm.server.checkpoint import default_checkpoint_dir
from swarm.server.reachability import Verdict, check_reachability

DHT_START_TIMEOUT = 10.0  # seconds for the DHT to bootstrap through the initial peers
REACHABILITY_DEADLINE = 20.0  # seconds for the dial-back check (a helper answers within 15)
ORDER = (
    "software",
    "memory",
    "disk",
    "manifest",
    "initial_peers",
    "reachability",
    "bandwidth",
    "clock",
    *data_checks.NAMES,
)


@dataclass(frozen=True)
class PreflightOptions:
    """swarm-peer's flags that the checks depend on."""

    join: str
    device: str = "auto"
    max_memory: int | None = None
    offload_optimizer: bool = False
    stage: int | None = None
    span: int = 1
    host_maddrs: list[str] = field(default_factory=lambda: list(node.ALL_INTERFACES))
    announce_maddrs: list[str] | None = None
    no_listen: bool = False
    checkpoint_dir: Path | None = None
    trainer: bool = True
    data: str | None = None
    data_cache: int = DEFAULT_CAP  # --data-cache, bytes


@dataclass
class PreflightResult:
    checks: list[Check]  # in ORDER
    manifest: Manifest | None

    @property
    def exit_code(self) -> ExitCode:
        return checks.exit_code(self.checks)

    def to_dict(self) -> dict:
        swarm = None
        if self.manifest is not None:
            swarm = {"name": self.manifest.name, "swarm_id": self.manifest.swarm_id, "stages": self.manifest.num_stages}
        return {
            "exit_code": int(self.exit_code),
            "verdict": checks.VERDICTS[self.exit_code],
            "swarm": swarm,
            "checks": [check.to_dict() for check in self.checks],
        }


@dataclass
class SwarmFindings:
    """What the checks against the swarm found (None: not reached that far)."""

    manifest: Manifest | None = None
    manifest_error: str = ""
    answers: list[PeerAnswer] = field(default_factory=list)
    joined: bool = False  # whether the DHT was joined (the checks through it ran)
    start_error: str = ""  # why the DHT did not start
    announcements: list[Announcement] | None = None
    verdict: Verdict | None = None
    bandwidth: list[tuple[str, float, float]] | None = None
    bandwidth_error: str = ""


def run_preflight(options: PreflightOptions, progress: Callable[[str], None]) -> PreflightResult:
    """Run every check; `progress` is told what is being done, as it starts (the program prints it). Call it outside
    an event loop, before any thread or CUDA starts (the DHT forks)."""
    found = check_swarm(options, progress)
    manifest = found.manifest
    results: dict[str, Check] = {}
    through_peer = joining.is_peer_multiaddr(options.join)
    source = "handed out by the peer --join names" if through_peer else f"from {options.join}"
    results["manifest"] = swarm_checks.manifest_check(manifest, found.manifest_error, source)
    results.update(verdicts_on_swarm(found, options))
    results.update(data_rows(manifest, options, progress))
    progress("running a test kernel on the device")
    probe = probes.probe_device(options.device)
    results["software"] = checks.software_check(platform.python_version(), torch.__version__, probe)
    lengths: list[int] = []
    if manifest is None:
        results["memory"] = skipped("memory", "no manifest")
        results["disk"] = skipped("disk", "no manifest")
    else:
        if probe.ok or options.device == "auto":  # auto falls back to the CPU
            device = torch.device(probe.device if probe.ok else "cpu")
            progress(f"sizing what fits in {'GPU memory' if device.type == 'cuda' else 'RAM'}")
            cuda = device.type == "cuda"
            settings = MemorySettings(offload_optimizer=options.offload_optimizer and cuda, cuda=cuda)
            budget = usable_budget(device, options.max_memory)
            results["memory"], lengths = checks.memory_check(manifest, budget, settings, options.stage, options.span)
        else:
            results["memory"] = skipped("memory", f"--device {options.device} does not work")
        progress("measuring free disk space")
        checkpoint_dir = options.checkpoint_dir or default_checkpoint_dir(manifest)
        data = probes.data_cache_need(manifest, options.data, options.trainer)
        places = probes.disk_places(checkpoint_dir, checks.checkpoint_need(manifest, lengths), data)
        results["disk"] = checks.disk_check(places, data is not None)
    return PreflightResult([results[name] for name in ORDER], manifest)


def check_swarm(options: PreflightOptions, progress: Callable[[str], None]) -> SwarmFindings:
    """The manifest, then (with a client DHT node of its own) the initial peers, the records, reachability and
    bandwidth."""
    found = SwarmFindings()
    progress(f"reading the manifest ({options.join})")
    try:
        found.manifest = joining.read_join(options.join)  # None: --join names a peer, which hands it out
    except SwarmError as e:
        found.manifest_error = str(e)
        return found
    initial = joining.bootstrap_peers(options.join, found.manifest)
    found.answers = [PeerAnswer(address, error="not reached") for address in initial]
    if not initial:
        return found
    progress(f"joining the DHT through {len(initial)} initial peer{'s' if len(initial) > 1 else ''}")
    try:
        dht = node.start_dht(
            initial,
            [],
            client_mode=True,
            no_listen=True,  # it only reads, over connections it opens
            startup_timeout=DHT_START_TIMEOUT,
            secret=found.manifest.secret if found.manifest is not None else None,
        )
    except SwarmError as e:
        found.start_error = str(e)
        if found.manifest is None:
            found.manifest_error = f"could not get the manifest from the peer --join names: {e}"
        return found
    found.joined = True
    try:
        asyncio.run(check_through_dht(dht, options, initial, found, progress))
    finally:
        dht.shutdown()
    return found


async def check_through_dht(
    dht, options: PreflightOptions, initial: list[str], found: SwarmFindings, progress: Callable[[str], None]
) -> None:
    p2p = await dht.replicate_p2p()
    try:
        progress("pinging the initial peers")
        secret = found.manifest.secret if found.manifest is not None else None
        found.answers = await probes.ping_initial_peers(p2p, initial, secret.authorizer() if secret else None)
        if found.manifest is None:
            progress("asking the peer for the manifest")
            try:
                found.manifest = await joining.manifest_through_peer(p2p, options.join, None)
            except SwarmError as e:
                found.manifest_error = str(e)
                return
        manifest = found.manifest
        node.sign_records(dht, manifest, None)  # a reader: only records signed by the peers they name count
        progress("reading the swarm's records")
        found.announcements = await probes.read_announcements(dht, manifest)
        if options.no_listen:
            found.verdict = Verdict(False, "--no-listen")
        else:
            progress("asking peers to dial this machine back")
            found.verdict = await reachability(initial, options, manifest)
        progress("measuring bandwidth to the swarm's peers")
        found.bandwidth, found.bandwidth_error = await probes.measure_bandwidth(
            p2p, manifest, found.announcements or []
        )
    finally:
        await p2p.shutdown()  # else its p2pclient socket file stays behind in /tmp


async def reachability(initial: list[str], options: PreflightOptions, manifest: Manifest) -> Verdict:
    check = check_reachability(initial, options.host_maddrs, options.announce_maddrs, manifest)
    try:
        return await asyncio.wait_for(check, REACHABILITY_DEADLINE)
    except TimeoutError:
        return Verdict(None, f"no verdict within {REACHABILITY_DEADLINE:g} s")


def data_rows(
    manifest: Manifest | None, options: PreflightOptions, progress: Callable[[str], None]
) -> dict[str, Check]:
    """The checks of the data a trainer of this machine would read (swarm/preflight/data_probes.py), within their
    deadline; skipped for a peer that does not train."""
    if manifest is None or not options.trainer:
        reason = "no manifest" if manifest is None else "--no-trainer"
        return {name: skipped(name, reason) for name in data_checks.NAMES}
    progress("checking the training data's source")
    return data_checks.data_rows(probe_data(manifest, options.data, options.data_cache, progress))


def verdicts_on_swarm(found: SwarmFindings, options: PreflightOptions) -> dict[str, Check]:
    """The verdicts on what check_swarm found; the ones it did not get to are skipped, saying why."""
    names = ("initial_peers", "reachability", "bandwidth", "clock")
    if found.manifest is None and not found.start_error:
        return {name: skipped(name, "no manifest") for name in names}
    results = {"initial_peers": swarm_checks.initial_peers_check(found.answers, found.start_error)}
    if not found.joined or found.manifest is None:
        reason = "no manifest" if found.joined else "no initial peer to join through"
        reason = "the DHT could not be joined" if found.start_error else reason
        return results | {name: skipped(name, reason) for name in names[1:]}
    manifest = found.manifest
    results["reachability"] = swarm_checks.reachability_check(found.verdict, options.no_listen)
    results["bandwidth"] = swarm_checks.bandwidth_check(found.bandwidth or [], found.bandwidth_error)
    period = manifest.network.announce_period
    lifetime = announcement_lifetime(period)
    expirations = [ann.expiration for ann in found.announcements or []]
    record_offsets = swarm_checks.offsets_from_records(expirations, lifetime, period, get_dht_time())
    ping_offsets = [a.clock_offset for a in found.answers if a.clock_offset is not None]
    results["clock"] = swarm_checks.clock_check(ping_offsets, record_offsets, lifetime)
    return results
