"""The memory a peer may use, measured, and what it does when a stage does not fit (the I/O edge of capacity/).

A GPU peer reads its device's free memory (torch.cuda.mem_get_info: what other processes hold is already gone);
a CPU peer reads the RAM available to new processes (psutil: MemAvailable on Linux). `--max-memory` caps either (a machine that is shared), and
MARGIN of what is left stays free: allocator fragmentation and the estimate's own error (costs.py is within ~5% of
benchmarks/memory.py's measurement, but a real run has peaks no formula sees).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import psutil
import torch

from swarm.capacity.costs import MemorySettings, SpanCost, longest_span, span_cost
from swarm.errors import CapacityError
from swarm.manifests.manifest import Manifest

MARGIN = 0.10  # share of the usable memory kept free
UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
BINARY_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str) -> int:
    """'24GB', '7.5GiB', '512MB' or a number of bytes -> bytes. GB is 10^9 (as GPU makers count), GiB 2^30."""
    match = SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    scale = UNITS.get(unit) or BINARY_UNITS.get(unit)
    if match is None or scale is None:
        raise CapacityError(f"cannot read {text!r} as an amount of memory: write it as 24GB, 7.5GiB or 512MB")
    value = float(match.group(1)) * scale
    if not math.isfinite(value) or value < 1 or value > 1 << 50:
        raise CapacityError(f"{text!r} is not a usable amount of memory (between 1 byte and 1 PiB)")
    return int(value)


def format_memory(size: float) -> str:
    """Bytes in the unit people read: '7.51 GiB', '600 MiB'."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    return f"{size / (1 << 20):.0f} MiB"


@dataclass(frozen=True)
class MemoryBudget:
    """What a peer may use on its device: `available` (measured or given), `usable` after the cap and the margin."""

    device: str  # "cuda:0" or "cpu"
    available: int
    cap: int | None
    usable: int

    @property
    def limit(self) -> int:
        """What this peer may use: the available memory, or the cap if lower."""
        return self.available if self.cap is None else min(self.available, self.cap)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def describe(self) -> str:
        source = "free GPU memory" if self.cuda else "available RAM"
        capped = f", capped by --max-memory at {format_memory(self.cap)}" if self.cap is not None else ""
        return f"{format_memory(self.available)} {source}{capped}; {format_memory(self.usable)} usable"


def available_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device, or the RAM available to new processes on a CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _ram_available()


def memory_in_use(device: torch.device) -> int:
    """Bytes this peer holds now: reserved by torch's allocator on a GPU, or the process's resident memory."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    return int(psutil.Process().memory_info().rss)


def _ram_available() -> int:
    return int(psutil.virtual_memory().available)  # Linux's MemAvailable; macOS and Windows have their own


def usable_budget(device: torch.device, max_memory: int | None = None, available: int | None = None) -> MemoryBudget:
    """The budget a peer sizes its span by: the measured (or given) available memory, capped, less MARGIN."""
    measured = available_memory(device) if available is None else available
    limit = measured if max_memory is None else min(measured, max_memory)
    return MemoryBudget(str(device), measured, max_memory, int(limit * (1 - MARGIN)))


def check_fits(manifest: Manifest, stage: int, budget: MemoryBudget, settings: MemorySettings) -> SpanCost:
    """The cost of serving `stage`, or a CapacityError that says, in one line, the numbers and what to do."""
    cost = span_cost(manifest, stage, stage + 1, settings)
    if longest_span(manifest, stage, budget.usable, settings) >= 1:
        return cost
    remedies = [
        "a smaller model or more stages (swarm-plan shows what fits where)",
        "--trainer-only to train without serving",
    ]
    largest = max(cost.parts, key=lambda name: cost.parts[name])
    raise CapacityError(
        f"stage {stage} needs {format_memory(cost.device_bytes)} (most of it {largest}, "
        f"{format_memory(cost.parts[largest])}) but this peer has {budget.describe()}: try " + ", or ".join(remedies)
    )
