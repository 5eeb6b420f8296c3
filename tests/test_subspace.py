"""Subspace stages (model.subspace_rank, swarm/architectures/subspace.py): a boundary carries `rank` numbers per
token and loses nothing, stages chained through their boundaries compute what the whole model computes (forward
and gradients), the export is an ordinary Llama with the same logits in transformers, both sides of a boundary
build the same basis, the manifest refuses what cannot work, and token windows travel narrow and are checked."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_full_model, build_stage
from swarm.architectures.subspace import subspace_basis
from swarm.errors import BadRequestError, ManifestError
from swarm.manifests.validation import manifest_from_dict
from swarm.wire.boundary import boundary_width, check_token_tensor, split_window, token_tensor
from swarm.wire.messages import make_request
from swarm.wire.tensors import decode_tensor, encode_tensor
from swarm.wire.validation import check_inputs

LLAMA = {"architecture": "llama", "vocab_size": 300, "width": 64, "depth": 4, "heads": 4, "kv_heads": 2}
RANK = 8


def subspace_manifest(stages: int = 3, **model):
    raw = tiny_manifest_dict(
        model={**LLAMA, "intermediate_size": 96, "subspace_rank": RANK, **model}, stages={"count": stages}
    )
    return manifest_from_dict(raw)


def perturbed(module: torch.nn.Module, seed: int = 0) -> None:
    """Trained-looking weights: away from their initial values (norms away from 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def test_stages_chained_through_their_boundaries_compute_the_whole_model_and_its_gradients():
    manifest = subspace_manifest(stages=3)
    full = build_full_model(manifest.model)
    perturbed(full)
    stages = [build_stage(manifest, s) for s in range(3)]
    full_state = dict(full.named_parameters())
    for index, stage in enumerate(stages):  # the same weights, under the stage's own names
        first_block = manifest.stage_layers(index)[0]
        with torch.no_grad():
            for name, p in stage.named_parameters():
                if name.startswith("blocks."):
                    local, rest = name[len("blocks.") :].split(".", 1)
                    name = f"blocks.{int(local) + first_block}.{rest}"
                p.copy_(full_state[name])
    window = torch.randint(0, LLAMA["vocab_size"], (2, 17))
    tokens, targets = split_window(window)

    loss_full = full.loss(full(tokens), targets)
    loss_full.backward()

    x = stages[0](tokens)
    assert x.shape == (2, 16, RANK)  # the boundary carries rank numbers per token, not width
    sent = [x]
    for stage in stages[1:-1]:
        received = sent[-1].detach().requires_grad_(True)
        sent.append(received)
        sent.append(stage(received, tokens))
    received = sent[-1].detach().requires_grad_(True)
    loss = stages[-1].forward_loss(received, targets, tokens)
    assert abs(loss.item() - loss_full.item()) < 1e-5
    # backward stage by stage, with only the rank-sized gradients crossing the boundaries
    loss.backward()
    grad = received.grad
    assert grad.shape == (2, 16, RANK)
    sent[-1].backward(grad)  # stage 1's output
    stages[0](tokens).backward(sent[1].grad)
    for index, stage in enumerate(stages):
        first_block = manifest.stage_layers(index)[0]
        for name, p in stage.named_parameters():
            if name.startswith("blocks."):
                local, rest = name[len("blocks.") :].split(".", 1)
                name = f"blocks.{int(local) + first_block}.{rest}"
            assert torch.allclose(p.grad, full_state[name].grad, atol=1e-5, rtol=1e-4), name


def test_a_boundary_is_exact_and_its_coordinates_are_rank_sized():
    manifest = subspace_manifest(stages=2)
    stage = build_stage(manifest, 0)
    perturbed(stage)
    tokens = torch.randint(0, LLAMA["vocab_size"], (3, 16))
    with torch.no_grad():
        hidden = stage._blocks(tokens, None)
        coordinates = stage.subspace.to_boundary(hidden, tokens)
        rebuilt = stage.subspace.from_boundary(coordinates, tokens)
    assert coordinates.shape == (3, 16, RANK) and boundary_width(manifest) == RANK
    assert float((rebuilt - hidden).abs().max()) < 1e-5 * float(hidden.abs().max())


def test_both_sides_of_a_boundary_build_the_same_basis_from_the_seed_and_none_is_in_the_state():
    manifest = subspace_manifest(stages=2)
    sender, receiver = build_stage(manifest, 0), build_stage(manifest, 1)
    assert torch.equal(sender.subspace.basis, receiver.subspace.basis)
    assert torch.equal(sender.subspace.fixed, receiver.subspace.fixed)
    basis, fixed = subspace_basis(manifest.model)
    assert torch.allclose(basis.T @ basis, torch.eye(RANK), atol=1e-5)  # orthonormal
    assert float((fixed @ basis).abs().max()) < 1e-5  # the fixed embedding is orthogonal to the subspace
    other = subspace_manifest(stages=2, seed=1)
    assert not torch.equal(build_stage(other, 1).subspace.basis, receiver.subspace.basis)
    # rebuilt, never sent, saved or averaged: not in the state dict
    assert not any("basis" in name or "fixed" in name for name in receiver.state_dict())
    shapes = {name: tuple(p.shape) for name, p in receiver.named_parameters()}
    assert shapes["blocks.0.attention.o_proj.weight"] == (RANK, LLAMA["width"])
    assert shapes["blocks.0.mlp.down_proj.weight"] == (RANK, 96)


def test_the_export_is_an_ordinary_llama_with_the_same_logits_in_transformers():
    transformers = pytest.importorskip("transformers")
    from swarm.hf.format import hf_config, to_hf_state

    manifest = subspace_manifest()
    ours = build_full_model(manifest.model).eval()
    perturbed(ours)
    state = {name: p.detach() for name, p in ours.named_parameters()}
    raw = {k: v for k, v in hf_config(manifest.model).items() if k != "architectures"}
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    missing, unexpected = theirs.load_state_dict(to_hf_state(manifest.model, state), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 32))
    with torch.no_grad():
        difference = (ours(tokens) - theirs.eval()(tokens).logits).abs().max()
    assert float(difference) < 1e-4


@pytest.mark.parametrize(
    "model, message",
    [
        ({"subspace_rank": 64}, "not smaller than the width 64"),
        ({"subspace_rank": -1}, "subspace_rank"),
        ({"architecture": "gpt", "kv_heads": 0}, "built for llama blocks"),
    ],
)
def test_the_manifest_refuses_a_subspace_that_cannot_work(model, message):
    with pytest.raises(ManifestError, match=message):
        subspace_manifest(**model)


def test_the_manifest_refuses_a_subspace_with_tied_embeddings_or_a_pretrained_model():
    with pytest.raises(ManifestError, match="tie_embeddings"):
        subspace_manifest(stages=1, tie_embeddings=True)
    raw = tiny_manifest_dict(model={**LLAMA, "subspace_rank": RANK}, stages={"count": 2})
    raw["pretrained"] = {"path": "model", "sha256": "0" * 64}
    with pytest.raises(ManifestError, match="pretrained"):
        manifest_from_dict(raw)


def test_the_swarm_id_of_a_manifest_without_a_subspace_is_unchanged():
    raw = tiny_manifest_dict(model=LLAMA)
    same = {**raw, "model": {**raw["model"], "subspace_rank": 0}}
    assert manifest_from_dict(raw).swarm_id == manifest_from_dict(same).swarm_id
    assert "subspace_rank" not in manifest_from_dict(raw).to_dict()["model"]


def test_token_windows_travel_as_int16_and_bad_ones_are_refused():
    manifest = subspace_manifest()
    inputs = torch.randint(0, LLAMA["vocab_size"], (2, 16))
    targets = torch.randint(0, LLAMA["vocab_size"], (2, 16))
    window = token_tensor(manifest, inputs, targets)
    assert window.shape == (2, 17) and torch.equal(split_window(window)[0], inputs)
    request = make_request(manifest, 1, "m", [torch.zeros(2, 16, RANK), window])
    assert request.tensors[1].dtype == "int16" and len(request.tensors[1].buffer) == 2 * 2 * 17
    back = decode_tensor(request.tensors[1], 10_000, "window")
    assert back.dtype == torch.int64 and torch.equal(back, window)
    coordinates = torch.zeros(2, 16, RANK)
    check_token_tensor(manifest, window, coordinates)
    check_inputs(coordinates, manifest, 1)
    with pytest.raises(BadRequestError, match="window must be token ids of shape"):
        check_token_tensor(manifest, targets, coordinates)  # targets where the window belongs
    with pytest.raises(BadRequestError, match="outside 0..299"):
        check_token_tensor(manifest, window + 300, coordinates)
    with pytest.raises(BadRequestError, match=f"hidden states \\[batch, length, {RANK}\\]"):
        check_inputs(torch.zeros(2, 16, 64), manifest, 1)  # full-width hidden states in a subspace swarm
    # an int16 buffer whose size does not match its shape is refused before it is read
    bad = encode_tensor(window, token_dtype=torch.int16)
    bad.buffer = bad.buffer[:-2]
    with pytest.raises(BadRequestError, match="buffer has"):
        decode_tensor(bad, 10_000, "window")


def hostile_requests(manifest, stage: int):
    """Requests a subspace stage after the first must refuse (label, kind, tensors)."""
    batch, length = 2, 16
    x = torch.randn(batch, length, RANK)
    window = torch.randint(0, LLAMA["vocab_size"], (batch, length + 1))
    nan = x.clone()
    nan[0, 0, 0] = float("nan")
    return [
        ("no window", "forward", [x]),
        ("targets in place of the window", "forward", [x, window[:, 1:]]),
        ("a window one token too long", "forward", [x, torch.zeros(batch, length + 2, dtype=torch.int64)]),
        ("a window of another batch", "forward", [x, window[:1]]),
        ("window ids past the vocabulary", "forward", [x, window + LLAMA["vocab_size"]]),
        ("negative window ids", "forward", [x, window - LLAMA["vocab_size"]]),
        ("a float window", "forward", [x, window.float()]),
        ("full-width hidden states", "forward", [torch.randn(batch, length, LLAMA["width"]), window]),
        ("coordinates of rank + 1", "forward", [torch.randn(batch, length, RANK + 1), window]),
        ("NaN coordinates", "forward", [nan, window]),
        ("three tensors", "forward", [x, window, window]),
        ("recompute without the window", "backward", [x, x]),
        ("recompute with a bad window", "backward", [x, x, window[:, :-1]]),
        ("recompute with a gradient of full width", "backward", [torch.randn(batch, length, 64), x, window]),
    ]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_subspace_stage_refuses_malformed_coordinates_and_windows_and_is_unharmed(stage):
    from swarm.server.compute import StageCompute
    from swarm.wire.messages import StageRequest

    manifest = subspace_manifest(stages=3)
    compute = StageCompute(manifest, stage, build_stage(manifest, stage), torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in compute.model.named_parameters()}
    for label, kind, tensors in hostile_requests(manifest, stage):
        if kind == "backward" and stage == 2:
            continue  # the last stage takes no backward at all (refused, as tested elsewhere)
        with pytest.raises(BadRequestError):
            compute.process(kind, StageRequest(stage, "m", True, tensors), "fuzz")
            pytest.fail(f"accepted: {label}")
    assert all(torch.equal(p, before[name]) for name, p in compute.model.named_parameters())
    # and it still serves a valid request
    x = torch.randn(2, 16, RANK)
    window = torch.randint(0, LLAMA["vocab_size"], (2, 17))
    outputs = compute.process("forward", StageRequest(stage, "ok", False, [x, window]), "fuzz")
    assert outputs[0].shape == ((2, 16, RANK) if stage == 1 else ())


def test_a_stage_state_taken_by_a_fresh_peer_gives_the_same_coordinates():
    """What a joining or moving peer (or a restart from a checkpoint) loads is the weights and optimizer state;
    the basis it rebuilds from the seed, so its outputs at the boundary equal the trained peer's."""
    from swarm.server.compute import StageCompute
    from swarm.wire.messages import StageRequest

    manifest = subspace_manifest(stages=3)
    trained = StageCompute(manifest, 1, build_stage(manifest, 1), torch.device("cpu"))
    x, window = torch.randn(2, 16, RANK), torch.randint(0, LLAMA["vocab_size"], (2, 17))
    for step in range(3):  # a few optimizer steps, so the state differs from a fresh one
        trained.process("forward", StageRequest(1, f"m{step}", True, [x, window]), "trainer")
        trained.process("backward", StageRequest(1, f"m{step}", True, [torch.randn(2, 16, RANK)]), "trainer")
    items, counters = trained.snapshot()
    fresh = StageCompute(manifest, 1, build_stage(manifest, 1), torch.device("cpu"))
    fresh.load_state(items, counters)
    ask = StageRequest(1, "eval", False, [x, window])
    assert torch.equal(fresh.process("forward", ask, "t")[0], trained.process("forward", ask, "t")[0])
    assert fresh.counters.optimizer_steps == trained.counters.optimizer_steps == 3
