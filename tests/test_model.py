"""Stage partitioning: a stage holds only its own parameters, and the stages composed equal the whole model."""

from __future__ import annotations

import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_full_model, build_stage, count_parameters
from swarm.manifests.validation import manifest_from_dict


def manifest(depth=5, layers=((0, 1), (1, 4), (4, 5))):
    return manifest_from_dict(
        tiny_manifest_dict(model={"depth": depth}, stages={"count": len(layers), "layers": [list(r) for r in layers]})
    )


def test_each_stage_builds_only_its_own_parameters():
    m = manifest()
    full = build_full_model(m.model)
    stages = [build_stage(m, i) for i in range(m.num_stages)]
    assert stages[0].embeddings is not None and stages[0].head is None
    assert stages[1].embeddings is None and stages[1].head is None and len(stages[1].blocks) == 3
    assert stages[2].embeddings is None and stages[2].head is not None and len(stages[2].blocks) == 1
    assert sum(count_parameters(s) for s in stages) == count_parameters(full)
    assert count_parameters(stages[1]) == 3 * count_parameters(full.blocks[0])


def test_stages_composed_equal_the_full_model():
    m = manifest()
    full = build_full_model(m.model)
    stages = [build_stage(m, i) for i in range(m.num_stages)]
    tokens = torch.randint(0, 256, (3, m.model.context_length))
    with torch.no_grad():
        x = tokens
        for stage in stages:
            x = stage(x)
        expected = full(tokens)
    assert torch.equal(x, expected)


def test_initialisation_is_deterministic_and_seeded():
    m = manifest()
    a, b = build_stage(m, 1), build_stage(m, 1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    other = manifest_from_dict(tiny_manifest_dict(model={"depth": 5, "seed": 7}, stages={"count": 3}))
    c = build_stage(other, 1)
    assert not torch.equal(a.blocks[0].mlp[0].weight, c.blocks[0].mlp[0].weight)
    # different layers are initialised differently
    assert not torch.equal(a.blocks[0].mlp[0].weight, a.blocks[1].mlp[0].weight)


def test_backward_through_stages_matches_full_model():
    m = manifest(depth=2, layers=((0, 1), (1, 2)))
    full = build_full_model(m.model)
    s0, s1 = build_stage(m, 0), build_stage(m, 1)
    tokens = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    full.loss(full(tokens), targets).backward()
    hidden = s0(tokens)
    sent = hidden.detach().requires_grad_(True)
    s1.loss(s1(sent), targets).backward()
    hidden.backward(sent.grad)
    assert torch.allclose(s0.embeddings.tokens.weight.grad, full.embeddings.tokens.weight.grad, atol=1e-6)
    assert torch.allclose(s1.head.lm_head.weight.grad, full.head.lm_head.weight.grad, atol=1e-6)
