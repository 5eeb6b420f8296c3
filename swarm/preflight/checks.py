"""The preflight's result type and the verdicts on this machine itself (software and device, memory, disk): each
check is a pure function of figures measured elsewhere (swarm/preflight/probes.py) that returns a `Check` (pass,
warn, fail or skip, a short detail, and for warn and fail what to do); `exit_code` turns the checks into
swarm-peer --check's exit code. The verdicts on the swarm's side are swarm/preflight/swarm_checks.py's.

A failed check blocks either joining at all (`Blocks.JOIN`: exit 2) or only serving a stage (`Blocks.SERVE`: exit
1, the machine can still train). Warnings never change the exit code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from swarm.capacity.budget import MemoryBudget, format_memory
from swarm.capacity.costs import FLOAT32, OPTIMIZER_FLOATS, MemorySettings, span_cost, span_lengths
from swarm.manifests.manifest import Manifest


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # not run: what it needs (the manifest, a device, the DHT) failed first


class Blocks(StrEnum):
    """What a failed check rules out."""

    JOIN = "join"  # the machine cannot take part at all
    SERVE = "serve"  # it cannot serve a stage, but it can train


class ExitCode(IntEnum):
    CAN_SERVE = 0
    TRAINER_ONLY = 1
    CANNOT_JOIN = 2


@dataclass(frozen=True)
class Check:
    name: str  # software, memory, disk, manifest, initial_peers, reachability, bandwidth, clock, data_*
    status: Status
    detail: str
    remedy: str = ""  # what to do; empty for pass and skip
    blocks: Blocks = Blocks.JOIN  # what a fail rules out (ignored for other statuses)
    figures: dict[str, Any] = field(default_factory=dict)  # the measured numbers, for scripts (--json)

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {"name": self.name, "status": str(self.status), "detail": self.detail}
        if self.remedy:
            document["remedy"] = self.remedy
        if self.status == Status.FAIL:
            document["blocks"] = str(self.blocks)
        document["figures"] = self.figures
        return document


def skipped(name: str, reason: str) -> Check:
    return Check(name, Status.SKIP, f"not checked: {reason}")


def exit_code(checks: list[Check]) -> ExitCode:
    """2 if a failure rules out joining, else 1 if one rules out serving a stage, else 0."""
    failed = {check.blocks for check in checks if check.status == Status.FAIL}
    if Blocks.JOIN in failed:
        return ExitCode.CANNOT_JOIN
    return ExitCode.TRAINER_ONLY if Blocks.SERVE in failed else ExitCode.CAN_SERVE


VERDICTS = {
    ExitCode.CAN_SERVE: "this machine can join the swarm and serve a stage",
    ExitCode.TRAINER_ONLY: "this machine can join the swarm only as a trainer (swarm-peer --trainer-only)",
    ExitCode.CANNOT_JOIN: "this machine cannot join the swarm",
}


# ------------------------------------------------------------------------------------------------ software


@dataclass(frozen=True)
class DeviceProbe:
    """What a tiny kernel on the asked-for device found (swarm/preflight/probes.py)."""

    asked: str  # --device: auto, cpu, cuda, cuda:N, mps
    device: str  # the device tried: cpu when auto saw no accelerator
    ok: bool = True
    error: str = ""  # the device's error, when not ok
    name: str = ""  # the GPU's name
    driver: str = ""  # NVIDIA driver version, "" if unknown
    cuda: str = ""  # the CUDA version torch was built with


TORCH_FOR_CUDA = "pip install torch from https://download.pytorch.org/whl/cuXYZ (pytorch.org's selector names XYZ)"


def no_cuda_reason(torch_version: str, built_for_cuda: str | None, driver: str) -> str:
    """Why torch sees no CUDA GPU, and what to do, from what the machine has: an NVIDIA driver loaded (its version;
    "" if none) and a torch build for CUDA (its CUDA version; None for a CPU-only build)."""
    if not driver:
        return (
            "torch sees no CUDA GPU and no NVIDIA driver is loaded (nvidia-smi should list the GPU): install the "
            "NVIDIA driver, or use --device auto or cpu"
        )
    if built_for_cuda is None:
        return (
            f"torch {torch_version} is a CPU-only build, but this machine has NVIDIA driver {driver}: install a CUDA "
            f"build ({TORCH_FOR_CUDA}), or use --device cpu"
        )
    return (
        f"torch {torch_version} was built for CUDA {built_for_cuda}, which NVIDIA driver {driver} cannot run (too old "
        f"for it, or not working): update the driver, or install a torch built for an older CUDA ({TORCH_FOR_CUDA}); "
        "or use --device cpu"
    )


def software_check(python: str, torch_version: str, probe: DeviceProbe) -> Check:
    versions = f"Python {python}, torch {torch_version}"
    figures = {"python": python, "torch": torch_version, "device": probe.device, "asked": probe.asked}
    if not probe.ok:
        figures["error"] = probe.error
        if probe.asked == "auto":
            return Check(
                "software",
                Status.WARN,
                f"{versions}; {probe.device} failed a test kernel ({probe.error}): serving falls back to the CPU, slowly",
                "update the GPU driver or install a torch build for it (pytorch.org), or pass --device cpu",
                figures=figures,
            )
        return Check(
            "software",
            Status.FAIL,
            f"{versions}; --device {probe.asked} failed a test kernel: {probe.error}",
            "update the GPU driver or install a torch build for it (pytorch.org); or serve with --device cpu",
            Blocks.SERVE,
            figures,
        )
    if probe.device.startswith("cuda"):
        figures.update(gpu=probe.name, driver=probe.driver, cuda=probe.cuda)
        driver = f"driver {probe.driver or 'unknown'}, CUDA {probe.cuda or 'unknown'}"
        return Check(
            "software", Status.PASS, f"{versions}; GPU {probe.name} ({driver}) ran a test kernel", figures=figures
        )
    if probe.device == "cpu" and probe.asked == "auto":
        return Check(
            "software",
            Status.WARN,
            f"{versions}; no GPU visible to torch: this machine would serve on the CPU, which is slow",
            "fine for small swarms; for large ones use a machine with a CUDA GPU and a torch build for it",
            figures=figures,
        )
    return Check("software", Status.PASS, f"{versions}; {probe.device} ran a test kernel", figures=figures)


# -------------------------------------------------------------------------------------------------- memory


def memory_remedy(budget: MemoryBudget, settings: MemorySettings) -> str:
    """What gives a peer room for a stage: a larger cap, more memory, the optimizer in RAM, or not serving."""
    options = ["a larger --max-memory"] if budget.cap is not None and budget.cap < budget.available else []
    options.append("a GPU with more free memory" if budget.cuda else "more free RAM (or a GPU)")
    if budget.cuda and not settings.offload_optimizer:
        options.append("--offload-optimizer")
    return ", ".join(options) + ", or --trainer-only to train without serving"


def memory_check(
    manifest: Manifest, budget: MemoryBudget, settings: MemorySettings, stage: int | None = None, span: int = 1
) -> tuple[Check, list[int]]:
    """(the check, how many stages fit from each start), as the peer sizes its span at start
    (swarm/server/rebalancer.py); a pinned --stage (and --span) must fit itself."""
    lengths = span_lengths(manifest, budget.usable, settings)
    if stage is not None and not (0 <= stage and 1 <= span <= manifest.num_stages - stage):
        last = manifest.num_stages - 1
        return Check(
            "memory",
            Status.FAIL,
            f"--stage {stage} --span {span}: the swarm has stages 0..{last}",
            f"pin stages within 0..{last}, or leave out --stage",
            Blocks.SERVE,
        ), lengths
    if not manifest.balancing.spans:
        lengths = [min(length, 1) for length in lengths]
    fitting = [start for start, length in enumerate(lengths) if length > 0]
    figures = {"available": budget.available, "usable": budget.usable, "cap": budget.cap, "fitting_stages": fitting}
    if stage is not None and lengths[stage] < span:
        wanted = f"stage {stage}" if span == 1 else f"stages {stage}-{stage + span - 1}"
        cost = span_cost(manifest, stage, stage + span, settings)
        return Check(
            "memory",
            Status.FAIL,
            f"{wanted} needs {format_memory(cost.device_bytes)} but this machine has {budget.describe()}",
            memory_remedy(budget, settings) + ("; or pin a shorter --span" if span > 1 else ""),
            Blocks.SERVE,
            {**figures, "needed": cost.device_bytes},
        ), lengths
    if not fitting:
        costs = [span_cost(manifest, s, s + 1, settings) for s in range(manifest.num_stages)]
        cheapest = min(costs, key=lambda cost: cost.device_bytes)
        largest = max(cheapest.parts, key=lambda name: cheapest.parts[name])
        return Check(
            "memory",
            Status.FAIL,
            f"no stage fits: the smallest (stage {cheapest.start}) needs {format_memory(cheapest.device_bytes)} "
            f"(most of it {largest}, {format_memory(cheapest.parts[largest])}) but this machine has {budget.describe()}",
            memory_remedy(budget, settings),
            Blocks.SERVE,
            {**figures, "needed": cheapest.device_bytes},
        ), lengths
    stages = "every stage fits" if len(fitting) == manifest.num_stages else f"stages that fit: {_listed(fitting)}"
    longest = max(lengths)
    together = f" (up to {longest} together)" if longest > 1 else ""
    return Check("memory", Status.PASS, f"{budget.describe()}; {stages}{together}", figures=figures), lengths


def _listed(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers))


# ---------------------------------------------------------------------------------------------------- disk


def stage_state_bytes(manifest: Manifest, stage: int) -> int:
    """A stage's checkpoint: its parameters, the optimizer's statistics and DiLoCo's outer state, in float32."""
    parameters = span_cost(manifest, stage, stage + 1).parameters
    floats = 1 + OPTIMIZER_FLOATS.get(manifest.training.optimizer, 2)
    floats += 2 if manifest.averaging.mode == "diloco" else 0
    return FLOAT32 * floats * parameters


def checkpoint_need(manifest: Manifest, lengths: list[int]) -> int:
    """Disk for this peer's checkpoints: the largest span it could serve (the largest stage if none fits), twice
    over (a new checkpoint is written beside the old one before it replaces it)."""
    states = [stage_state_bytes(manifest, stage) for stage in range(manifest.num_stages)]
    spans = [sum(states[start : start + length]) for start, length in enumerate(lengths) if length > 0]
    return 2 * max(spans or states)


@dataclass(frozen=True)
class DiskPlace:
    """A folder the peer writes to, with the free space of its file system and what it would put there."""

    path: str
    free: int
    need: int
    holds: str  # what: "checkpoints", "the dataset's token cache", or both


def disk_check(places: list[DiskPlace], data_known: bool) -> Check:
    """Warn where a file system has less free space than the estimate (never a failure: the estimate is rough)."""
    short = [place for place in places if place.free < place.need]
    described = "; ".join(
        f"{format_memory(p.free)} free at {p.path}, about {format_memory(p.need)} needed for {p.holds}" for p in places
    )
    unknown = "" if data_known else " (the dataset's cache size is not known here: not counted)"
    figures = {"places": [{"path": p.path, "free": p.free, "need": p.need, "holds": p.holds} for p in places]}
    if short:
        return Check(
            "disk",
            Status.WARN,
            described + unknown,
            "free some space, or point --checkpoint-dir (checkpoints) or SWARM_CACHE_DIR (the cache) at a larger disk",
            figures=figures,
        )
    return Check("disk", Status.PASS, described + unknown, figures=figures)
