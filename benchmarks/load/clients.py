"""The load benchmark's clients (__main__.py runs them): hivemind P2P identities in the benchmark's
process, each with tasks that send training forwards to one stage peer one after another, as trainers that keep
one microbatch in flight; a tally of what they saw (served, busy, other errors), the event loop's own lag, and
progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import sys
import time

import torch
from hivemind.p2p import P2P

from swarm.client.rpc import call_stage
from swarm.dht import node
from swarm.errors import RemoteStageError
from swarm.manifests.manifest import Manifest
from swarm.wire import messages, validation
from swarm.wire.codes import ErrorCode

PROGRESS_PERIOD = 10.0
BATCHES_PER_CLIENT = 8  # distinct random microbatches each client cycles through
RAMP = 1.0  # seconds over which the tasks send their first request: trainers do not all start at once
LAG_PERIOD = 0.05  # seconds between two looks at this process's event loop lag


class Tally:
    """What the clients saw: latencies of served requests and of busy replies, and every other outcome."""

    def __init__(self) -> None:
        self.sent = 0
        self.served: list[tuple[float, float]] = []  # (completion time, latency in seconds)
        self.busy: list[float] = []  # latencies in seconds
        self.busy_reasons: collections.Counter[str] = collections.Counter()  # the peer's messages
        self.error_replies: collections.Counter[str] = collections.Counter()
        self.exceptions: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}  # one message per kind of failure, for stderr
        self.loop_lags: list[float] = []  # seconds this process's event loop woke up late


async def client_task(
    p2p: P2P,
    peer_id: str,
    manifest: Manifest,
    stage: int,
    batches: list[list[torch.Tensor]],
    name: str,
    tally: Tally,
    end: float,
    busy_wait: float,
    delay: float,
) -> None:
    """Send forwards one after another from `delay` seconds on until `end`, as a trainer that keeps one
    microbatch in flight."""
    await asyncio.sleep(delay)
    timeout = manifest.training.timeouts.forward
    reply_elements = validation.max_request_elements(manifest)
    expected_batch = batches[0][0].shape[0]
    n = 0
    while time.monotonic() < end:
        request = messages.make_request(manifest, stage, f"{name}-{n}", batches[n % len(batches)], train=True)
        n += 1
        tally.sent += 1
        begin = time.monotonic()
        try:
            reply = await call_stage(p2p, peer_id, "forward", request, timeout, reply_elements)
            outputs = messages.decode_reply(reply, reply_elements)
            if len(outputs) != 2 or outputs[1].shape[0] != expected_batch:  # [loss, grad_inputs]
                raise RemoteStageError(f"malformed reply: {[list(t.shape) for t in outputs]}", "malformed_reply")
        except RemoteStageError as e:
            latency = time.monotonic() - begin
            if e.code == ErrorCode.BUSY:
                tally.busy.append(latency)
                tally.busy_reasons[re.sub(r"\d+(\.\d+)?", "N", str(e))[:80]] += 1  # one entry per kind
                await asyncio.sleep(busy_wait)
            else:
                tally.error_replies[e.code] += 1
                tally.examples.setdefault(e.code, str(e)[:300])
            continue
        except asyncio.CancelledError:
            raise
        except Exception as e:  # timeouts and transport errors: what this benchmark must not see
            kind = type(e).__name__
            tally.exceptions[kind] += 1
            tally.examples.setdefault(kind, repr(e)[:300])
            continue
        now = time.monotonic()
        tally.served.append((now, now - begin))


async def watch_loop_lag(lags: list[float]) -> None:
    """How late this process's event loop wakes up: latencies measured here include that much of our own delay."""
    while True:
        begin = time.monotonic()
        await asyncio.sleep(LAG_PERIOD)
        lags.append(time.monotonic() - begin - LAG_PERIOD)


async def report_progress(tally: Tally, start: float, memory: list[tuple[float, float]], rates: list[float]) -> None:
    served_before, then = 0, start
    while True:
        await asyncio.sleep(PROGRESS_PERIOD)
        now, served = time.monotonic(), len(tally.served)
        rates.append((served - served_before) / (now - then))
        served_before, then = served, now
        failures = sum(tally.error_replies.values()) + sum(tally.exceptions.values())
        rss = f"{memory[-1][1]:.0f} MB" if memory else "-"
        print(
            f"{now - start:5.0f}s: {tally.sent} sent, {served} served ({rates[-1]:.1f}/s), {len(tally.busy)} busy, "
            f"{failures} other failures; peer RSS {rss}",
            file=sys.stderr,
            flush=True,
        )


async def run_load(
    manifest: Manifest, stage: int, maddr: str, args: argparse.Namespace, memory: list[tuple[float, float]]
) -> tuple[Tally, float, list[float], float]:
    """Drive the peer at `maddr` for args.duration seconds. (tally, start, served/s per progress period, elapsed)"""
    peer_id = maddr.rsplit("/p2p/", 1)[1]
    config, training = manifest.model, manifest.training
    shape = (training.microbatch_size, config.context_length)
    generator = torch.Generator().manual_seed(0)
    clients: list[P2P] = []
    tally = Tally()
    try:
        for _ in range(args.clients):
            clients.append(await P2P.create(initial_peers=[maddr], host_maddrs=node.LOOPBACK))
        # one request first: a peer that cannot be reached at all fails here, with its reason
        probe = [torch.randn(*shape, config.width), torch.zeros(shape, dtype=torch.int64)]
        request = messages.make_request(manifest, stage, "warmup", probe, train=True)
        elements = validation.max_request_elements(manifest)
        messages.decode_reply(await call_stage(clients[0], peer_id, "forward", request, 30.0, elements), elements)

        start = time.monotonic()
        end = start + args.duration
        rates: list[float] = []
        progress = asyncio.create_task(report_progress(tally, start, memory, rates))
        lag = asyncio.create_task(watch_loop_lag(tally.loop_lags))
        tasks = []
        for c, p2p in enumerate(clients):
            batches = [
                [
                    torch.randn(*shape, config.width, generator=generator),
                    torch.randint(0, config.vocab_size, shape, generator=generator),
                ]
                for _ in range(BATCHES_PER_CLIENT)
            ]
            for t in range(args.concurrency):
                delay = RAMP * (t * args.clients + c) / (args.clients * args.concurrency)
                name = f"c{c}t{t}"
                task = client_task(p2p, peer_id, manifest, stage, batches, name, tally, end, args.busy_wait, delay)
                tasks.append(asyncio.create_task(task))
        await asyncio.gather(*tasks)  # each ends after its last request, at most a timeout past `end`
        elapsed = time.monotonic() - start
        for task in (progress, lag):
            task.cancel()
        await asyncio.gather(progress, lag, return_exceptions=True)
        return tally, start, rates, elapsed
    finally:
        for p2p in clients:
            try:
                await asyncio.wait_for(p2p.shutdown(), timeout=10)
            except Exception as e:  # its daemon is our child: it ends with this process anyway
                print(f"shutting a client's p2p down failed: {e!r}", file=sys.stderr)
