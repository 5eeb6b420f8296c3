"""A peer that runs out of memory while serving survives it (issue 32; swarm/server/shedding.py): a real peer
process, whose allocations really fail, answers the requests that run out `busy`, halves its window of kept
microbatches down to one, drops the last stage of its span when that is not enough, reports each step as an
`out_of_memory` event, and serves on once memory is there again, while the swarm trains on.

How memory runs out, for real and without touching the code under test: the test lowers the peer process's
address-space limit (RLIMIT_AS, through prlimit on the peer's pid alone: its DHT process and p2pd daemon, started
before, keep theirs) to a little above what it has mapped, and keeps lowering it as the peer frees memory, so that
the next large allocation fails in torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory"). The
swarm's model has an MLP wide enough that each block of one microbatch's hidden activations is more than glibc
ever serves from its heap (32 MiB: larger blocks are always fresh mappings), and two of them, alive together, more
than the headroom left above the limit, while the small allocations of the event loop, the RPCs and the status
lines fit in that headroom. Then the limit goes back to what it was.
"""

from __future__ import annotations

import re
import resource
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import tiny_manifest_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow(60)]

# width 8, 8 x 64 tokens a microbatch, an MLP of 32,768: one microbatch's MLP activations are two blocks of 64 MiB
# alive together (more than HEADROOM), a message between stages 16 KiB; its 1.1M parameters train at about a
# microbatch a second
MODEL = {"width": 8, "heads": 2, "context_length": 64, "intermediate_size": 32768}
# bytes above what the peer has mapped: thread stacks, and what the event loop, the RPCs and the status lines
# allocate meanwhile, fit with room to spare (the limit hits every allocation of the process, not only the model's)
HEADROOM = 96 << 20
SQUEEZE_PERIOD = 0.05  # seconds between two looks at what the peer has mapped


def out_of_memory_manifest() -> dict:
    """Two one-block stages, with spans, no averaging (its rounds are not what is tested here)."""
    return tiny_manifest_dict(
        model=MODEL,
        training={"microbatch_size": 8},
        balancing={"spans": True},
        averaging={"mode": "none"},
    )


def mapped_bytes(pid: int) -> int:
    """The process's address space in use now (VmSize), which RLIMIT_AS bounds."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmSize:\s*(\d+) kB", status, re.M).group(1)) * 1024


def squeeze(pid: int, until: Callable[[], bool], timeout: float) -> None:
    """Keep the process `pid` at HEADROOM above the least address space it has had since this began, until
    `until()` (AssertionError after `timeout` seconds); then give it back its limit. The limit only ever goes down
    meanwhile: memory the peer frees (a kept microbatch dropped, a stage left) is not there for it again."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    limit = None
    deadline = time.monotonic() + timeout
    try:
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"the squeezed peer did not do what was waited for in {timeout:g} s")
            tighter = mapped_bytes(pid) + HEADROOM
            if limit is None or tighter < limit:
                limit = tighter
                resource.prlimit(pid, resource.RLIMIT_AS, (limit, hard))
            time.sleep(SQUEEZE_PERIOD)
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))


def test_a_peer_out_of_memory_sheds_its_window_then_a_stage_reports_it_and_training_goes_on(start_peer, write_manifest):
    raw = out_of_memory_manifest()
    # a stated throughput (about what they measure, a block of this wide MLP at 6-8 samples/s on one loaded core):
    # the stage peers are pinned, and their measurement alone took 20 s of both cores under load
    stated = ("--throughput", "8")
    helper = start_peer(write_manifest(raw), "--stage", "1", "--no-trainer", "--status-every", "1", *stated)
    raw["initial_peers"] = [helper.maddr()]
    joined = write_manifest(raw, "joined.json")
    peer = start_peer(joined, "--stage", "0", "--span", "2", "--no-trainer", "--status-every", "1", *stated)
    trainer = start_peer(joined, "--trainer-only", "--status-every", "1")
    peer.wait_for_json(lambda line: line.get("span") == [0, 2] and line.get("state") == "online", 120, "the span")
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= 16, 120, "training")
    assert peer.events("out_of_memory") == []

    def shortened() -> bool:
        return any(event.get("to_span") == [0, 1] for event in peer.events("moved"))

    squeeze(peer.pid, shortened, timeout=90)

    # each request that ran out was answered busy, and its stage shed: the window halved down to one microbatch,
    # then, as requests kept running out there, the peer dropped the last stage of its span; each step reported
    events = peer.events("out_of_memory")
    assert events and all("can't allocate memory" in event["error"] for event in events), events
    for stage in {event["stage"] for event in events}:
        of_stage = [event for event in events if event["stage"] == stage]
        kept = [event["kept_microbatches"] for event in of_stage]
        assert kept == sorted(kept, reverse=True), of_stage
        assert [event["out_of_memory"] for event in of_stage] == list(range(1, len(of_stage) + 1))
    first = [event for event in events if event["stage"] == 0]  # the last stage keeps no activations: no window
    assert first and first[0]["action"] == "smaller_window" and first[0]["kept_microbatches"] > 1, first
    shorter = next(event for event in events if event["action"] == "shorter_span")
    assert shorter["kept_microbatches"] == 1  # only once the window was at its smallest
    assert peer.process.poll() is None, peer.tail()

    # memory is there again: the peer serves its shorter span, the helper the stage it dropped, and the swarm
    # trains on through them
    online = peer.wait_for_json(lambda line: line.get("span") == [0, 1] and line.get("state") == "online", 60)
    assert online["busy_replies"] >= sum(event["stage"] == 0 for event in events)
    # the status line counts them, and shows the window it shrank to
    # (at least the events read above: more may have come since)
    assert online["out_of_memory"] >= sum(event["stage"] == 0 for event in events) > 0, online
    assert online["kept_microbatches"] == 1, online
    helped = helper.status_lines()[-1]["samples_served"]
    before = trainer.status_lines()[-1].get("trainer_samples") or 0
    trainer.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= before + 48, 120, "training on")
    peer.wait_for_json(lambda line: line.get("samples_served", 0) > online["samples_served"], 60, "serving again")
    helper.wait_for_json(lambda line: line.get("samples_served", 0) > helped, 60, "the helper serving stage 1")
    for process in (peer, helper, trainer):
        assert process.process.poll() is None, process.tail()
