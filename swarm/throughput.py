"""How many samples per second a peer can serve for its stage: the figures' math.

A peer serves at the lower of two limits: compute (what the stage server does per sample on this device, timed)
and network (bytes per second to another peer, divided by the bytes a sample of the stage moves). This module
times compute, turns probe exchanges into bandwidth, computes bytes per sample, caches compute figures on disk,
keeps the delivered EMA (`DeliveredThroughput`) and pads compute steps for `--simulated-speed`
(`SimulatedSpeed`); what to measure against whom is swarm/server/measurement.py's. Details, and why simulated
speed pads to the measured time rather than multiplying each step's duration: docs/BALANCING.md,
"Throughput".
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from swarm.architectures.model import StageModel
from swarm.files import atomic_write, cache_root
from swarm.manifests.manifest import Manifest
from swarm.wire import boundary, tensors

logger = logging.getLogger(__name__)

DEFAULT_BANDWIDTH_MBITS = 100.0  # assumed when no other peer is there to measure against: a typical home link
PROBE_BYTES = 2 * 1024 * 1024  # one bandwidth probe message; fits a unary message
DELIVERED_HALF_LIFE = 30.0  # seconds; the delivered-throughput EMA forgets at this pace


# ---------------------------------------------------------------------------------------------- compute


FORWARD_SHARE = 1 / 3  # of a sample's forward+backward time that its forward takes (backward: the rest)


@dataclass(frozen=True)
class SimulatedSpeed:
    """Testing aid: make this device behave as if it were `speed` times as fast (speed <= 1)."""

    speed: float
    reference: float  # this device's real forward+backward samples per second for the stage

    def pad(self, begin: float, samples: int, share: float = 1.0) -> None:
        """Sleep until work on `samples` samples, begun at `begin` (perf_counter) and `share` of a full
        forward+backward, has lasted as long as it would on the emulated device."""
        delay = begin + share * samples / (self.reference * self.speed) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def measure_compute_throughput(
    model: StageModel,
    manifest: Manifest,
    device: torch.device,
    repetitions: int = 3,
    simulated: SimulatedSpeed | None = None,
    rounds: int = 3,
) -> float:
    """Samples per second of forward + backward of one microbatch on a copy of the inputs (weights untouched),
    in the best of `rounds` rounds of `repetitions` steps after a warm-up step.

    This is what the stage server does per sample: forward keeps its activations (weight stashing), so backward
    does not recompute it; recomputation happens only after failures and is not part of the figure."""
    config, batch = manifest.model, manifest.training.microbatch_size
    length = config.context_length
    tokens = torch.randint(0, config.vocab_size, (batch, length), device=device)
    if model.first:
        inputs = tokens
    else:  # hidden states as they arrive: [width], or [subspace_rank] coordinates (swarm/wire/boundary.py)
        width = config.subspace_rank or config.width
        inputs = torch.randn(batch, length, width, device=device, requires_grad=True)
    params = [p for p in model.parameters() if p.requires_grad]

    def once(timed: bool = True) -> None:
        begin = time.perf_counter()
        out = model(inputs, tokens if model.takes_tokens else None)
        torch.autograd.grad(out.float().square().mean(), params)  # grads are returned, never accumulated
        _synchronize(device)
        if simulated is not None and timed:
            simulated.pad(begin, batch)

    once(timed=False)  # warm-up (not timed: a simulated slow device need not wait through it)
    best = float("inf")
    for _ in range(rounds):  # the best round: a moment of contention from other processes should not stick
        start = time.perf_counter()
        for _ in range(repetitions):
            once()
        best = min(best, time.perf_counter() - start)
    return batch * repetitions / max(best, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A human name of the device, also part of the cache key (e.g. 'cpu', 'cuda:NVIDIA H200')."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


# ---------------------------------------------------------------------------------------------- network


def stage_bytes_per_sample(manifest: Manifest, stage: int) -> tuple[int, int]:
    """(bytes received, bytes sent) by a peer of `stage` per trained sample, as the protocol encodes them."""
    config = manifest.model
    element = {"float32": 4, "float16": 2, "bfloat16": 2, "8bit": 1, "4bit": 0.5}[tensors.wire_compression(manifest)]
    # one sample's activations, or their gradient: a subspace swarm's boundary carries rank numbers per token
    hidden = round(config.context_length * boundary.boundary_width(manifest) * element)
    tokens = config.context_length * 8  # int64 token ids
    first, last = stage == 0, stage == manifest.num_stages - 1
    received = (tokens if first else hidden) + (tokens if last else hidden)  # inputs; targets or output gradient
    sent = (0 if first else hidden) + (0 if last else hidden)  # input gradient; outputs
    if boundary.sends_window(manifest):  # the token window travels with the coordinates, onward to the last stage
        window = (config.context_length + 1) * boundary.wire_token_dtype(manifest).itemsize
        received += 0 if first else window
        sent += 0 if first or last else window
    return received, max(sent, 4)  # the last stage of a one-stage swarm sends only the loss


def network_throughput(manifest: Manifest, stage: int, download_bps: float, upload_bps: float) -> float:
    """Samples per second the links allow for `stage` (bps: bytes per second)."""
    received, sent = stage_bytes_per_sample(manifest, stage)
    return min(download_bps / received, upload_bps / sent)


async def measure_bandwidth(
    exchange: Callable[[int, int], Awaitable[None]], probe_bytes: int = PROBE_BYTES, repetitions: int = 2
) -> tuple[float, float]:
    """(download, upload) bytes per second through `exchange(upload_bytes, download_bytes)`, one round trip
    that sends and receives that many payload bytes. The time of an empty round trip is taken off, so that
    latency does not count as bandwidth; the best of `repetitions` is kept."""

    async def timed(up: int, down: int) -> float:
        begin = time.perf_counter()
        await exchange(up, down)
        return time.perf_counter() - begin

    await timed(0, 0)  # opens the connection
    latency = min([await timed(0, 0) for _ in range(repetitions)])
    upload = min([await timed(probe_bytes, 0) for _ in range(repetitions)])
    download = min([await timed(0, probe_bytes) for _ in range(repetitions)])
    return probe_bytes / max(download - latency, 1e-6), probe_bytes / max(upload - latency, 1e-6)


# ------------------------------------------------------------------------------------------------ cache


def default_cache_path() -> Path:
    """$SWARM_CACHE_DIR/throughput.json, or ~/.cache/swarm/throughput.json."""
    return cache_root() / "throughput.json"


def compute_cache_key(manifest: Manifest, stage: int, device: torch.device) -> str:
    """What a compute figure depends on: device, model config, stage shape, microbatch size."""
    parts = {
        "device": device_name(device),
        "model": asdict(manifest.model),
        "layers": len(manifest.stage_layers(stage)),
        "first": stage == 0,
        "last": stage == manifest.num_stages - 1,
        "microbatch_size": manifest.training.microbatch_size,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cached_compute_throughput(
    model: StageModel,
    manifest: Manifest,
    stage: int,
    device: torch.device,
    remeasure: bool = False,
    path: Path | None = None,
) -> tuple[float, bool]:
    """(samples/s, whether it came from the cache): the cached figure, or a new measurement, then cached."""
    path = path or default_cache_path()
    key = compute_cache_key(manifest, stage, device)
    if not remeasure and (cached := read_cached(path, key)) is not None:
        return cached, True
    value = measure_compute_throughput(model, manifest, device)
    write_cached(path, key, value)
    return value, False


def read_cached(path: Path, key: str) -> float | None:
    """A cached figure, or None if there is none (or the cache file is unreadable: it is only a cache)."""
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def write_cached(path: Path, key: str, value: float) -> None:
    """Add one figure to the cache, atomically (swarm/files.py); a failure is logged (it is only a cache)."""
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(entries, indent=1, sort_keys=True))
    except OSError as e:
        logger.warning(f"could not write the throughput cache {path}: {e}")


# --------------------------------------------------------------------------------------------- delivered


class DeliveredThroughput:
    """EMA of the samples per second a peer actually served, updated from its running count of samples."""

    def __init__(self, half_life: float = DELIVERED_HALF_LIFE):
        self.half_life = half_life
        self.value = 0.0
        self._last: tuple[float, int] | None = None

    def update(self, samples_served: int, now: float) -> float:
        if self._last is not None:
            last_time, last_samples = self._last
            elapsed = now - last_time
            if elapsed > 0:
                rate = max(samples_served - last_samples, 0) / elapsed
                keep = 0.5 ** (elapsed / self.half_life)
                self.value = keep * self.value + (1 - keep) * rate
        self._last = (now, samples_served)
        return self.value


@dataclass(frozen=True)
class Throughput:
    """A peer's measured limits for its stage, in samples per second; it serves at the lower one."""

    compute: float
    network: float

    @property
    def serving(self) -> float:
        return min(self.compute, self.network)
