"""Checkpoints: atomic writes, and clear refusals of corrupt, truncated and foreign files."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_stage
from swarm.errors import BadRequestError, CheckpointError
from swarm.manifests.validation import manifest_from_dict
from swarm.server.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from swarm.server.compute import StageCompute


def server(manifest, stage=0) -> StageCompute:
    """A stage's compute, owned by the test (no worker thread: nothing else touches it)."""
    return StageCompute(manifest, stage, build_stage(manifest, stage), torch.device("cpu"))


def trained_state(manifest):
    """A stage's state after one optimizer step, and its counters."""
    s = server(manifest)
    for p in s.params:
        p.grad = torch.ones_like(p)
    s.optimizer_step()
    return s.snapshot()


LLAMA = {"architecture": "llama", "width": 64, "depth": 2, "heads": 4, "kv_heads": 2}


@pytest.mark.parametrize("model", [{}, LLAMA], ids=["gpt", "llama"])
def test_a_saved_checkpoint_loads_into_a_fresh_server_exactly(tmp_path, model):
    manifest = manifest_from_dict(tiny_manifest_dict(model=model))
    items, counters = trained_state(manifest)
    path = save_checkpoint(tmp_path, manifest, 0, items, counters)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind

    checkpoint = find_checkpoint(tmp_path, manifest, 0)
    assert checkpoint is not None and checkpoint.counters == counters == {"optimizer_steps": 1, "averaging_round": 0}
    fresh = server(manifest)
    fresh.load_state(checkpoint.items, checkpoint.counters)
    loaded, loaded_counters = fresh.snapshot()
    assert loaded_counters == counters
    assert [name for name, _ in loaded] == [name for name, _ in items]
    for (_, a), (_, b) in zip(loaded, items):
        assert torch.equal(a, b)


def test_saving_again_replaces_the_checkpoint(tmp_path):
    manifest = manifest_from_dict(tiny_manifest_dict())
    items, _ = trained_state(manifest)
    save_checkpoint(tmp_path, manifest, 0, items, {"optimizer_steps": 1})
    save_checkpoint(tmp_path, manifest, 0, items, {"optimizer_steps": 2})
    assert load_checkpoint(tmp_path / "stage-0.safetensors", manifest, 0).optimizer_steps == 2
    assert len(list(tmp_path.iterdir())) == 1


def test_foreign_corrupt_and_truncated_checkpoints_are_refused_clearly(tmp_path):
    manifest = manifest_from_dict(tiny_manifest_dict())
    other_swarm = manifest_from_dict(tiny_manifest_dict(name="another-swarm"))
    items, counters = trained_state(manifest)
    path = save_checkpoint(tmp_path, manifest, 0, items, counters)

    with pytest.raises(CheckpointError, match="belongs to swarm"):
        load_checkpoint(path, other_swarm, 0)
    with pytest.raises(CheckpointError, match="holds stage 0, not stage 1"):
        load_checkpoint(path, manifest, 1)
    assert find_checkpoint(tmp_path, other_swarm, 0) is None  # found, reported, not used

    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"not a checkpoint at all", b""):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="corrupt or truncated"):
            load_checkpoint(path, manifest, 0)
        assert find_checkpoint(tmp_path, manifest, 0) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.safetensors", manifest, 0)


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_and_changes_nothing(tmp_path):
    manifest = manifest_from_dict(tiny_manifest_dict())
    items, counters = trained_state(manifest)
    fresh = server(manifest)
    before = [p.detach().clone() for p in fresh.params]
    broken = [(name, tensor[:1] if i == 0 else tensor) for i, (name, tensor) in enumerate(items)]
    nan = [
        (name, torch.full_like(tensor, float("nan")) if i == 1 else tensor) for i, (name, tensor) in enumerate(items)
    ]
    for bad in (broken, nan, items[1:]):
        with pytest.raises(BadRequestError):
            fresh.load_state(bad, counters)
        assert all(torch.equal(p, b) for p, b in zip(fresh.params, before))


# ------------------------------------------------------------------------ checkpoints kept for others, backups


def test_the_checkpoints_a_peer_keeps_are_announced_from_their_metadata_and_bounded_on_disk(tmp_path):
    import os

    from swarm.server.checkpoint import prune_checkpoints
    from swarm.server.checkpoint_sharing import KeptCheckpoint, kept_checkpoints

    manifest = manifest_from_dict(tiny_manifest_dict(model={"depth": 4}, stages={"count": 4}))
    for stage in range(4):
        items, counters = server(manifest, stage).snapshot()
        path = save_checkpoint(tmp_path, manifest, stage, items, {**counters, "optimizer_steps": 10 * stage})
        os.utime(path, (1000 + stage, 1000 + stage))  # stage 3 saved last
    (tmp_path / "stage-7.safetensors").write_bytes(b"not a checkpoint")  # a stage this swarm does not have
    os.utime(tmp_path / "stage-7.safetensors", (500, 500))
    (tmp_path / "stage-2.safetensors.tmp").write_bytes(b"")  # not a checkpoint's name
    kept = kept_checkpoints(tmp_path, manifest)
    assert [(k.stage, k.optimizer_steps) for k in kept] == [(0, 0), (1, 10), (2, 20), (3, 30)]
    assert all(isinstance(k, KeptCheckpoint) and k.saved_at > 0 for k in kept)
    # at most 1 checkpoint of a stage not served now: the most recent (3) and the served one (0) stay
    assert sorted(prune_checkpoints(tmp_path, keep=1, served={0})) == [1, 2, 7]
    assert [k.stage for k in kept_checkpoints(tmp_path, manifest)] == [0, 3]


def test_checkpoint_records_from_the_network_are_validated_and_the_freshest_comes_first():
    from swarm.server.checkpoint_sharing import CheckpointRecord, KeptCheckpoint, freshest, parse_checkpoint_record

    good = CheckpointRecord("QmPeerA", (KeptCheckpoint(1, 50, 2, 1000.0), KeptCheckpoint(0, 9, 1, 999.0)))
    assert parse_checkpoint_record("QmPeerA", good.to_record(), 2, 5.0) == CheckpointRecord("QmPeerA", good.kept, 5.0)
    record = good.to_record()
    bad = [
        ("QmOther", record),  # under another peer's subkey
        ("QmPeerA", {**record, "kept": [[2, 1, 1, 1.0]]}),  # a stage the swarm does not have
        ("QmPeerA", {**record, "kept": [[0, -1, 1, 1.0]]}),  # a negative count
        ("QmPeerA", {**record, "kept": [[0, 1, 1, float("nan")]]}),
        ("QmPeerA", {**record, "kept": [[0, True, 1, 1.0]]}),
        ("QmPeerA", {**record, "kept": [[0, 1, 1]]}),
        ("QmPeerA", {**record, "kept": [[0, 1, 1, 1.0]] * 5000}),  # too many
        ("QmPeerA", {**record, "kept": "all of them"}),
        ("QmPeerA", ["not", "a", "dict"]),
        ("QmPeerA", {"peer_id": "QmPeerA"}),
    ]
    for subkey, value in bad:
        assert parse_checkpoint_record(subkey, value, 2, 5.0) is None, value
    other = CheckpointRecord("QmPeerB", (KeptCheckpoint(1, 60, 2, 900.0),))
    older_round = CheckpointRecord("QmPeerC", (KeptCheckpoint(1, 500, 1, 2000.0),))
    ranked = freshest([good, other, older_round], 1, exclude="QmPeerB")
    assert [peer for peer, _ in ranked] == ["QmPeerA", "QmPeerC"]  # a later round beats more local steps
    assert [peer for peer, _ in freshest([good, other, older_round], 1)] == ["QmPeerB", "QmPeerA", "QmPeerC"]


def test_backup_keepers_are_one_choice_at_every_peer_and_change_little_when_peers_come_and_go():
    from swarm.server.backups import backup_interval, backup_keepers

    peers = [f"QmPeer{i}" for i in range(12)]
    keepers = backup_keepers("swarm", 3, peers)
    assert len(keepers) == 1 and keepers == backup_keepers("swarm", 3, list(reversed(peers)))
    bystander = next(p for p in peers if p not in keepers)
    assert backup_keepers("swarm", 3, [p for p in peers if p != bystander]) == keepers
    assert len({backup_keepers("swarm", stage, peers)[0] for stage in range(24)}) >= 4  # spread over peers
    assert backup_interval(300.0, 3_000_000_000) == 3000.0 and backup_interval(300.0, 1_000_000) == 300.0
