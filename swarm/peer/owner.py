"""The owner's rules: the hours a peer may run (`--hours 22-08`) and yielding the GPU to the owner's own programs
(`--yield-gpu`). Outside those hours, or while another process uses the GPU, the peer pauses itself (swarm/peer/
peer.py: drained, its state parked in RAM, still in the swarm) and resumes once the rule allows it again. A pause
the owner asked for by signal is the owner's: these rules never resume it.

Hours are local clock hours, `START-END` (whole hours, 0-23, or HH:MM): `22-08` runs from 22:00 to 08:00 the next
morning, `09-17` during office hours; START equal to END means all day. The GPU's other users come from
`nvidia-smi` (present wherever the NVIDIA driver is): any compute process on the peer's GPU that is not this peer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from swarm.errors import PeerStartError

logger = logging.getLogger(__name__)

RULES_PERIOD = 10.0  # seconds between two looks at the rules
NVIDIA_SMI_TIMEOUT = 5.0
HOURS_PATTERN = re.compile(r"^(\d{1,2})(?::(\d{2}))?-(\d{1,2})(?::(\d{2}))?$")


@dataclass(frozen=True)
class Hours:
    """From `start` to `end`, in minutes after midnight (local time); across midnight when end < start."""

    start: int
    end: int

    def allow(self, moment: datetime) -> bool:
        minute = moment.hour * 60 + moment.minute
        if self.start == self.end:
            return True
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def describe(self) -> str:
        return f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"


def parse_hours(text: str) -> Hours:
    """'22-08' or '22:30-07:15'; PeerStartError saying what a spec looks like otherwise."""
    match = HOURS_PATTERN.match(text.strip())
    if match is None:
        raise PeerStartError(f"--hours {text!r}: give START-END in hours of the local clock, e.g. 22-08 or 22:30-07:00")
    start_h, start_m, end_h, end_m = (int(part) if part else 0 for part in match.groups())
    if start_h > 23 or end_h > 23 or start_m > 59 or end_m > 59:
        raise PeerStartError(f"--hours {text!r}: hours go from 0 to 23 and minutes from 0 to 59")
    return Hours(start_h * 60 + start_m, end_h * 60 + end_m)


def other_gpu_processes(gpu_index: int, own: set[int]) -> list[int] | None:
    """Process ids of the compute processes on GPU `gpu_index` other than `own`; None if nvidia-smi cannot tell."""
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--id={gpu_index}", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    pids = [int(line) for line in result.stdout.split() if line.strip().isdigit()]
    return [pid for pid in pids if pid not in own]


@dataclass
class OwnerRules:
    """Pauses and resumes a peer by the owner's rules; `run` looks at them every RULES_PERIOD seconds."""

    pause: Callable[[str], Awaitable[None]]  # (reason)
    resume: Callable[[], Awaitable[None]]
    is_paused: Callable[[], bool]
    hours: Hours | None = None
    yield_gpu: int | None = None  # the index of the GPU to yield, or None
    paused_by_rules: bool = False

    def reason_to_pause(self, now: datetime) -> str | None:
        """Why the rules want the peer paused now, or None."""
        if self.hours is not None and not self.hours.allow(now):
            return f"outside the hours it may run ({self.hours.describe()})"
        if self.yield_gpu is not None:
            others = other_gpu_processes(self.yield_gpu, {os.getpid()})
            if others:
                return f"another program uses GPU {self.yield_gpu} (process {', '.join(map(str, others[:3]))})"
        return None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reason = await asyncio.to_thread(self.reason_to_pause, datetime.now())
                if reason is not None and not self.is_paused():
                    logger.info(f"pausing: {reason}")
                    self.paused_by_rules = True
                    await self.pause(reason)
                elif reason is None and self.paused_by_rules:
                    if self.is_paused():
                        logger.info("resuming: the owner's rules allow it again")
                        await self.resume()
                    self.paused_by_rules = False
            except Exception as e:  # never fatal: the peer goes on as it is
                logger.warning(f"applying the owner's rules failed: {e!r}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=RULES_PERIOD)
            except TimeoutError:
                pass
