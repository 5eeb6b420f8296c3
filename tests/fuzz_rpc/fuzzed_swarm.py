"""The fuzzed swarm's two peers, their client identities, and what the tests measure of them: their state and
memory at the start, and a slow case started early (checked by a later test)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from conftest import PeerProcess
from fuzzing import FIRST, FORWARD_TIMEOUT, LAST, MANIFEST, RAW_MANIFEST
from swarm.client.rpc import download_state
from swarm.local import processes
from swarm.wire.state import stage_state_shapes

from .clients import CALL_TIMEOUT, Clients, open_stream, stage_outcome
from .messages import DOWNLOAD_STATE, FORWARD, state_request, valid_forward

# of a peer's process group over all the cases: its p2pd daemon grows by some 30 MiB and a reachability check starts
# a probe daemon (60 MiB, kept for later checks); the peer's own process, by a few MiB
RSS_GROWTH_LIMIT = 256 * 2**20


def group_rss(pgid: int) -> int:
    """Bytes of resident memory of a peer's processes (the peer, its DHT process, its p2pd daemons)."""
    return round(sum(processes.memory_mb(pgid).values()) * 2**20)


def memory_report(pgid: int) -> dict[str, int]:
    return {name: round(mb) for name, mb in processes.memory_mb(pgid).items()}


def state_shapes(stage: int) -> dict[str, tuple[int, ...]]:
    return stage_state_shapes(MANIFEST, stage)


@dataclass
class Swarm:
    peers: dict[int, PeerProcess]
    ids: dict[int, str]
    clients: Clients
    shapes: dict[int, dict[str, tuple[int, ...]]]
    states: dict[int, list[tuple[str, torch.Tensor]]]  # at the start
    rss: dict[int, int]  # at the start, after one valid request each

    def alive(self) -> None:
        for stage, peer in self.peers.items():
            assert peer.process.poll() is None, f"the stage {stage} peer exited:\n{peer.output()[-3000:]}"

    def state(self, stage: int, p2p: P2P) -> list[tuple[str, torch.Tensor]]:
        coroutine = download_state(p2p, self.ids[stage], MANIFEST, stage, self.shapes[stage], timeout=CALL_TIMEOUT)
        items, _ = self.clients.run(coroutine, CALL_TIMEOUT + 5)
        return items

    def served(self, stage: int, p2p: P2P) -> runtime_pb2.ExpertResponse:
        """A valid (non-training) forward from `p2p`; asserts that it is served."""
        data = valid_forward(stage).SerializeToString()
        raw = self.clients.run(p2p._client.call_unary_handler(self.clients.targets[stage], FORWARD, data))
        reply = runtime_pb2.ExpertResponse.FromString(raw)
        assert stage_outcome(reply) == "ok"
        return reply


def fuzzed_swarm(folder: Path) -> Iterator[Swarm]:
    """One peer per stage (--no-trainer, so nothing but a request could change their weights), each a swarm of
    its own so that both start at once; clients reach them directly. Yields the swarm once; stops it after."""
    path = folder / "manifest.json"
    path.write_text(json.dumps(RAW_MANIFEST))
    peers: dict[int, PeerProcess] = {}
    clients: Clients | None = None
    try:
        for stage in (FIRST, LAST):
            # as the start_peer fixture does; a stated throughput and bandwidth skip the measurements
            args = [*processes.loopback_args(path, stage, trainer=False), "--duration", "900"]
            args += ["--throughput", "100", "--bandwidth", "1000"]
            peers[stage] = processes.start_peer(args, folder / f"peer{stage}.log", cache_dir=folder / "cache")
        ids = {stage: peer.peer_id(timeout=90) for stage, peer in peers.items()}
        clients = Clients(ids, [peer.maddr() for peer in peers.values()])
        clients.prefetch()  # while the peers build their models
        for peer in peers.values():
            peer.wait_for("serving stage", timeout=90)
        shapes = {stage: state_shapes(stage) for stage in peers}
        swarm = Swarm(peers, ids, clients, shapes, {}, {})
        clients.check_alive = swarm.alive
        first = clients.identity(FIRST)
        for stage in peers:
            swarm.states[stage] = swarm.state(stage, first)
            swarm.served(stage, first)
            swarm.rss[stage] = group_rss(peers[stage].pgid)
            print(f"\nstage {stage}: memory at the start (MiB): {memory_report(peers[stage].pgid)}")
        BACKGROUND["stalled download"] = start_stalled_download(clients)  # checked by a later test, done by then
        yield swarm
    finally:
        if clients is not None:
            clients.close()
        processes.stop_peers(list(peers.values()))  # all at once: each takes seconds


BACKGROUND: dict[str, concurrent.futures.Future] = {}  # slow cases started early, checked by a later test


def start_stalled_download(clients: Clients) -> concurrent.futures.Future:
    """A state request whose stream never ends (no end-of-stream message)."""
    chunks = [state_request(stage=FIRST)]
    coroutine = open_stream(
        clients.fresh(), clients.targets[FIRST], DOWNLOAD_STATE, chunks, "none", FORWARD_TIMEOUT + 4
    )
    return asyncio.run_coroutine_threadsafe(coroutine, clients.loop)
