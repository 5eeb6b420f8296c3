"""A peer's throughput for a stage: compute (measured once and cached on disk) and network (measured against
another peer's bandwidth probe, or stated with --bandwidth). The figures' math is swarm/throughput.py's; this
module decides what to measure, against whom, and when a figure is only an assumption."""

from __future__ import annotations

import logging
import random

import torch
from hivemind.p2p import P2P

from swarm.client.rpc import probe_bandwidth
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import PeerState
from swarm.manifests.manifest import Manifest
from swarm.server.stage import ServingOptions
from swarm.throughput import (
    DEFAULT_BANDWIDTH_MBITS,
    SimulatedSpeed,
    Throughput,
    cached_compute_throughput,
    default_cache_path,
    measure_compute_throughput,
    network_throughput,
)

logger = logging.getLogger(__name__)

PROBED_PEERS = 2  # online peers tried, at random, for a bandwidth measurement


class ThroughputMeter:
    def __init__(
        self,
        manifest: Manifest,
        p2p: P2P,
        peer_id: str,
        device: torch.device,
        options: ServingOptions,
        view: AnnouncementCache,
    ):
        self.manifest, self.p2p, self.peer_id, self.device = manifest, p2p, peer_id, device
        self.options, self.view = options, view
        self.rng = random.Random()
        self._bandwidth: tuple[float, float] | None = None  # (download, upload) bytes/s
        self.bandwidth_measured = False  # False while it is the stated default (nobody to measure against)
        self.simulated: dict[int, SimulatedSpeed] = {}  # per stage, with --simulated-speed

    @property
    def network_is_assumed(self) -> bool:
        """True until a measurement replaced the default bandwidth (never with --bandwidth)."""
        return not self.bandwidth_measured and self.options.bandwidth_mbits is None

    async def measure(self, stage: int, model: torch.nn.Module) -> Throughput:
        if self.options.throughput not in ("auto", "eval"):
            value = float(self.options.throughput)
            return Throughput(compute=value, network=value)
        compute = self._compute_throughput(stage, model)
        download, upload = await self.bandwidth()
        return Throughput(compute=compute, network=network_throughput(self.manifest, stage, download, upload))

    async def network_figure(self, stage: int) -> float | None:
        """The stage's network throughput once a measurement replaced the assumed bandwidth; else None."""
        download, upload = await self.bandwidth()
        return network_throughput(self.manifest, stage, download, upload) if self.bandwidth_measured else None

    def _compute_throughput(self, stage: int, model: torch.nn.Module) -> float:
        value, cached = cached_compute_throughput(
            model, self.manifest, stage, self.device, remeasure=self.options.throughput == "eval"
        )
        source = f"cached in {default_cache_path()}" if cached else "measured"
        logger.info(f"compute throughput of stage {stage}: {value:.1f} samples/s ({source})")
        if self.options.simulated_speed < 1.0:
            simulated = SimulatedSpeed(self.options.simulated_speed, reference=value)
            self.simulated[stage] = simulated
            value = measure_compute_throughput(model, self.manifest, self.device, simulated=simulated, rounds=1)
            logger.info(f"simulating a device {simulated.speed:g}x as fast: measured {value:.1f} samples/s")
        return value

    async def bandwidth(self) -> tuple[float, float]:
        """(download, upload) bytes/s: --bandwidth, else measured against an online peer, else the default."""
        if self.options.bandwidth_mbits is not None:
            both = self.options.bandwidth_mbits * 1e6 / 8
            return both, both
        if self.bandwidth_measured and self._bandwidth is not None:
            return self._bandwidth
        others = [a for anns in await self.view.all_stages() for a in anns if a.state == PeerState.ONLINE]
        others = [a for a in others if a.peer_id != self.peer_id]
        for ann in self.rng.sample(others, k=min(len(others), PROBED_PEERS)):
            logger.info(f"measuring the bandwidth to peer {ann.peer_id[-8:]} (seconds on a home link)")
            try:
                self._bandwidth = await probe_bandwidth(self.p2p, ann.peer_id, self.manifest)
                self.bandwidth_measured = True
                down, up = self._bandwidth
                logger.info(f"bandwidth to peer {ann.peer_id[-8:]}: {down * 8e-6:.0f} Mbit/s down, {up * 8e-6:.0f} up")
                return self._bandwidth
            except Exception as e:  # that peer may be gone; try another
                logger.info(f"bandwidth probe of peer {ann.peer_id[-8:]} failed: {e!r}")
        default = DEFAULT_BANDWIDTH_MBITS * 1e6 / 8
        if self._bandwidth is None:  # said once; checks try again quietly until a peer is there
            logger.info(f"no peer to measure bandwidth against; assuming {DEFAULT_BANDWIDTH_MBITS:.0f} Mbit/s for now")
        self._bandwidth = (default, default)
        return self._bandwidth
