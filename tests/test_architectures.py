"""Llama and GPT blocks: the same logits as Hugging Face transformers' LlamaForCausalLM and GPT2LMHeadModel under
the exported names, grouped-query attention, partitioning into stages, parameter counts, mixed precision (bfloat16
and float16 autocast on the CPU, float32 master weights), activation checkpointing, tied embeddings, and the
manifest's checks of the new fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import (
    StageModel,
    build_full_model,
    build_stage,
    count_parameters,
    count_stage_parameters,
)
from swarm.errors import ManifestError
from swarm.hf.format import from_hf_state, hf_config, to_hf_state
from swarm.manifests.manifest import ModelConfig
from swarm.manifests.presets import new_manifest
from swarm.manifests.validation import manifest_from_dict

transformers = pytest.importorskip("transformers")

LLAMA = {"architecture": "llama", "vocab_size": 300, "width": 64, "depth": 3, "heads": 4, "kv_heads": 2}


def llama_manifest(stages=3, **model):
    raw = tiny_manifest_dict(model={**LLAMA, "intermediate_size": 96, **model}, stages={"count": stages})
    return manifest_from_dict(raw)


def hf_model(config: ModelConfig, state: dict[str, torch.Tensor]):
    raw = {k: v for k, v in hf_config(config).items() if k != "architectures"}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    missing, unexpected = model.load_state_dict(to_hf_state(config, state), strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("architecture", ["llama", "gpt"])
def test_logits_equal_transformers_models_under_the_exported_names(architecture):
    manifest = llama_manifest() if architecture == "llama" else manifest_from_dict(tiny_manifest_dict())
    ours = build_full_model(manifest.model).eval()
    with torch.no_grad():  # trained-looking weights: norms and biases away from their initial 1 and 0
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {name: p.detach() for name, p in ours.named_parameters()}
    theirs = hf_model(manifest.model, state)
    tokens = torch.randint(0, manifest.model.vocab_size, (2, manifest.model.context_length))
    with torch.no_grad():
        difference = (ours(tokens) - theirs(tokens).logits).abs().max()
    assert float(difference) < 1e-4
    back = from_hf_state(manifest.model, to_hf_state(manifest.model, state), list(state))
    assert all(torch.equal(back[name], state[name]) for name in state)


def test_grouped_query_attention_has_fewer_key_value_weights():
    manifest = llama_manifest()
    block = build_full_model(manifest.model).blocks[0]
    assert block.attention.k_proj.weight.shape == (2 * 16, 64)  # 2 KV heads of 16, against 4 query heads
    assert block.attention.q_proj.weight.shape == (64, 64)
    assert not any(name.endswith("bias") for name, _ in block.named_parameters())


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-150m", "llama-1b"])
def test_llama_presets_have_the_anchors_shapes(preset):
    manifest = new_manifest("x", preset)
    counts = count_stage_parameters(manifest)
    with torch.device("meta"):
        built = [count_parameters(build_stage(manifest, s)) for s in range(manifest.num_stages)]
    assert counts == built
    # the anchors' shapes are the exported model's: a subspace swarm trains fewer parameters (o_proj, down_proj and
    # the embeddings write rank coordinates) and its export folds the basis back into an ordinary Llama
    exported = dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, subspace_rank=0))
    if manifest.model.subspace_rank:
        assert sum(counts) < sum(count_stage_parameters(exported))
    total, model = sum(count_stage_parameters(exported)), manifest.model
    if preset == "llama-1b":  # TinyLlama: 1.1B
        assert 1.09e9 < total < 1.11e9 and model.key_value_heads == 4 and model.mlp_width == 5632
    elif preset == "llama-150m":  # OpenDiLoCo's 150M: without the embeddings and the head
        assert 1.45e8 < total - 2 * model.vocab_size * model.width < 1.55e8
    else:  # about the tiny GPT's size
        assert abs(total - sum(count_stage_parameters(new_manifest("x", "tiny")))) < 0.05 * total


def test_llama_stages_compose_to_the_whole_model_and_start_identical():
    manifest = llama_manifest()
    full = build_full_model(manifest.model)
    stages = [build_stage(manifest, s) for s in range(3)]
    assert sum(count_parameters(s) for s in stages) == count_parameters(full)
    for a, b in zip(build_stage(manifest, 1).parameters(), stages[1].parameters()):
        assert torch.equal(a, b)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        x = tokens
        for stage in stages:
            x = stage(x)
        assert torch.equal(x, full(tokens))


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_mixed_precision_on_the_cpu_keeps_float32_weights_and_close_gradients(precision):
    config = llama_manifest().model
    exact = StageModel(config, range(3), first=True, last=True)
    mixed = StageModel(config, range(3), first=True, last=True, precision=precision)
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    tokens = torch.randint(0, 300, (4, 32))
    logits = mixed(tokens)
    assert logits.dtype == getattr(torch, precision)
    losses = [StageModel.loss(model(tokens), tokens) for model in (exact, mixed)]
    assert losses[1].dtype == torch.float32 and abs(float(losses[0] - losses[1])) < 0.02
    grads = [torch.autograd.grad(loss, list(model.parameters())) for loss, model in zip(losses, (exact, mixed))]
    for g32, g16 in zip(*grads):
        assert g16.dtype == torch.float32
        assert float((g32 - g16).norm()) <= 0.05 * float(g32.norm()) + 1e-6
    middle = StageModel(config, range(1, 2), first=False, last=False, precision=precision)
    assert middle(torch.randn(2, 8, 64)).dtype == torch.float32  # the residual stream stays float32


def test_activation_checkpointing_gives_the_same_gradients():
    config = llama_manifest().model
    plain = StageModel(config, range(3), first=True, last=True)
    checkpointed = StageModel(config, range(3), first=True, last=True, activation_checkpointing=True)
    tokens = torch.randint(0, 300, (2, 16))
    grads = [
        torch.autograd.grad(StageModel.loss(m(tokens), tokens), list(m.parameters())) for m in (plain, checkpointed)
    ]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_tied_embeddings_share_one_tensor_and_need_one_stage():
    manifest = llama_manifest(stages=1, tie_embeddings=True)
    model = build_stage(manifest, 0)
    assert model.head.lm_head.weight is model.embeddings.tokens.weight
    assert "head.lm_head.weight" not in dict(model.named_parameters())
    assert count_stage_parameters(manifest) == [count_parameters(model)]
    with pytest.raises(ManifestError, match="different peers"):
        llama_manifest(stages=2, tie_embeddings=True)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"kv_heads": 3}, "multiple of kv_heads"),
        ({"architecture": "gpt", "kv_heads": 2}, "one key/value head"),
        ({"architecture": "mamba"}, "architecture"),
        ({"width": 60, "heads": 4}, "even head size"),
        ({"rope_theta": 0}, "rope_theta"),
    ],
)
def test_bad_model_fields_are_refused(model, message):
    with pytest.raises(ManifestError, match=message):
        llama_manifest(**model)


def test_precision_and_checkpointing_reach_the_stage():
    raw = tiny_manifest_dict(training={"precision": "bfloat16", "activation_checkpointing": True})
    stage = build_stage(manifest_from_dict(raw), 0)
    assert stage.compute_dtype == torch.bfloat16 and stage.activation_checkpointing
    with pytest.raises(ManifestError, match="precision"):
        manifest_from_dict(tiny_manifest_dict(training={"precision": "float8"}))


def test_activation_checkpointing_recomputes_with_the_stashed_weights():
    """A stage's forward runs with stashed weights (server/compute.py) and its backward later, after optimizer
    steps may have changed the module's own: the recomputation must use the weights forward used."""
    config = llama_manifest().model
    grads = []
    for checkpointing in (False, True):
        stage = StageModel(config, range(1, 2), first=False, last=False, activation_checkpointing=checkpointing)
        names = [name for name, _ in stage.named_parameters()]
        stash = [p.detach().clone().requires_grad_(True) for p in stage.parameters()]
        x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
        out = torch.func.functional_call(stage, dict(zip(names, stash)), (x,))
        with torch.no_grad():  # an optimizer step between forward and backward
            for p in stage.parameters():
                p.add_(1.0)
        grads.append(torch.autograd.grad(out.square().sum(), stash))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_published_swarms_keep_their_ids():
    """The settings issue 16 added are left out of the canonical form at their defaults: a manifest published
    before keeps its swarm id (a URL's #id fragment still matches). Only a new protocol version changes it
    (protocol 7: signed records and gradient fingerprints, which a protocol-6 peer cannot read)."""
    from conftest import ROOT
    from swarm.manifests.loading import load_manifest

    assert load_manifest(ROOT / "examples" / "demo.json").swarm_id == "199dee7bf0b8e87d"
    assert "precision" not in new_manifest("x", "tiny").to_dict()["training"]
    assert new_manifest("x", "llama-tiny").to_dict()["model"]["architecture"] == "llama"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_chunked_loss_equals_the_loss_of_all_logits(monkeypatch, checkpointing):
    import swarm.architectures.model

    monkeypatch.setattr(
        swarm.architectures.model, "LOSS_CHUNK_TOKENS", 50
    )  # 4 x 32 tokens: three chunks, the last one short
    config = llama_manifest().model
    last = StageModel(config, range(1, 3), first=False, last=True, activation_checkpointing=checkpointing)
    x = torch.randn(4, 32, 64, requires_grad=True)
    targets = torch.randint(0, 300, (4, 32))
    whole = StageModel.loss(last(x), targets)
    chunked = last.forward_loss(x, targets)
    assert abs(float(whole) - float(chunked)) < 1e-5
    for a, b in zip(*(torch.autograd.grad(loss, [x, *last.parameters()]) for loss in (whole, chunked))):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}}, "rotary"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rotary"),
        ({"attention_bias": True}, "no biases"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"model_type": "mistral"}, "Llama checkpoints"),
        ({"num_attention_heads": 0}, "positive integer"),
    ],
)
def test_pretrained_configs_swarm_cannot_run_are_refused(change, message):
    from swarm.hf.format import model_config_from_hf

    raw = {k: v for k, v in hf_config(llama_manifest().model).items() if k != "architectures"}
    assert model_config_from_hf(raw) == llama_manifest().model  # the round trip
    with pytest.raises(ManifestError, match=message):
        model_config_from_hf({**raw, **change})
