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
