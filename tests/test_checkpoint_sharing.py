"""Checkpoints handed from peer to peer over RPC (swarm/server/checkpoint_sharing.py), between real hivemind p2p
nodes on loopback: a peer hands the state of a stage it keeps a checkpoint of, refuses what it does not keep, and a
state taken this way loads into a stage exactly."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.client.rpc import download_state
from swarm.errors import RemoteStageError
from swarm.manifests.validation import manifest_from_dict
from swarm.server.checkpoint import save_checkpoint
from swarm.server.checkpoint_sharing import CheckpointService
from swarm.server.compute import StageCompute
from swarm.wire.codes import ErrorCode
from swarm.wire.state import stage_state_shapes


def trained(manifest, stage: int):
    compute = StageCompute(manifest, stage, build_stage(manifest, stage), torch.device("cpu"))
    for p in compute.params:
        p.grad = torch.ones_like(p)
    compute.optimizer_step()
    return compute.snapshot()


def test_a_peer_hands_out_the_checkpoint_of_a_stage_it_keeps_and_refuses_others(tmp_path):
    manifest = manifest_from_dict(tiny_manifest_dict())
    items, counters = trained(manifest, 1)
    counters = {**counters, "optimizer_steps": 42}
    save_checkpoint(tmp_path, manifest, 1, items, counters)

    async def run():
        keeper = await P2P.create()
        asker = await P2P.create(initial_peers=await keeper.get_visible_maddrs())
        try:
            service = CheckpointService(manifest, tmp_path)
            await service.add_p2p_handlers(keeper, namespace=CheckpointService.NAMESPACE)
            shapes = stage_state_shapes(manifest, 1)
            got, got_counters = await download_state(
                asker, str(keeper.peer_id), manifest, 1, shapes, 60, from_checkpoint=True
            )
            assert got_counters == {"optimizer_steps": 42, "averaging_round": counters.get("averaging_round", 0)}
            received, kept = dict(got), dict(items)  # (a checkpoint file keeps its tensors sorted by name)
            assert sorted(received) == sorted(kept) and len(got) == len(items)
            assert all(torch.equal(received[name], kept[name]) for name in kept)
            # it loads into a fresh stage exactly, as any state does
            fresh = StageCompute(manifest, 1, build_stage(manifest, 1), torch.device("cpu"))
            fresh.load_state(got, got_counters)
            assert fresh.counters.optimizer_steps == 42
            # stage 0: not kept here
            with pytest.raises(RemoteStageError) as refused:
                await download_state(
                    asker, str(keeper.peer_id), manifest, 0, stage_state_shapes(manifest, 0), 60, from_checkpoint=True
                )
            assert refused.value.code == ErrorCode.WRONG_STAGE
            assert service.sent == 1
        finally:
            await asker.shutdown()
            await keeper.shutdown()

    asyncio.run(run())


def test_a_checkpoint_newer_than_its_record_is_taken_and_one_older_is_refused():
    """A backup saved since the peer's record (backups every few seconds, records every announce period) is
    further than announced, and must be taken: refusing it once started a vanished stage afresh, 151 steps lost."""
    from swarm.server.takeover import sent_what_it_announced

    announced = (0, 91)  # (averaging round, optimizer steps)
    assert sent_what_it_announced(announced, {"averaging_round": 0, "optimizer_steps": 166})
    assert sent_what_it_announced(announced, {"averaging_round": 0, "optimizer_steps": 91})
    assert sent_what_it_announced(announced, {"averaging_round": 1, "optimizer_steps": 3})  # a round later
    assert not sent_what_it_announced(announced, {"averaging_round": 0, "optimizer_steps": 90})
