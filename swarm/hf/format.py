"""Hugging Face's format of a model: config.json, tensor names, and the way back (pure functions, no I/O).

Swarm's whole-model names are `swarm.architectures.model.build_full_model`'s (`embeddings.tokens.weight`,
`blocks.3.mlp...`, `head.lm_head.weight`). A Llama swarm maps one to one onto transformers' `LlamaForCausalLM`; a
GPT swarm onto `GPT2LMHeadModel`, whose linear layers are `Conv1D`s that store their weight transposed, and whose
MLP is exact GELU here (`activation_function: "gelu"`, not GPT-2's tanh approximation). Writing and reading the
files is swarm/hf/folder.py's and swarm/hf/pretrained.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from swarm.architectures.subspace import fold_subspace
from swarm.errors import ManifestError
from swarm.manifests.manifest import ModelConfig

# Swarm's block-local names -> transformers' (per architecture); {i} is the layer
_LLAMA_BLOCK = {
    "norm1.weight": "model.layers.{i}.input_layernorm.weight",
    "attention.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attention.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attention.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attention.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "norm2.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LLAMA_OUTER = {
    "embeddings.tokens.weight": "model.embed_tokens.weight",
    "head.norm.weight": "model.norm.weight",
    "head.lm_head.weight": "lm_head.weight",
}
_GPT_BLOCK = {
    "norm1.weight": "transformer.h.{i}.ln_1.weight",
    "norm1.bias": "transformer.h.{i}.ln_1.bias",
    "attention.qkv.weight": "transformer.h.{i}.attn.c_attn.weight",
    "attention.qkv.bias": "transformer.h.{i}.attn.c_attn.bias",
    "attention.proj.weight": "transformer.h.{i}.attn.c_proj.weight",
    "attention.proj.bias": "transformer.h.{i}.attn.c_proj.bias",
    "norm2.weight": "transformer.h.{i}.ln_2.weight",
    "norm2.bias": "transformer.h.{i}.ln_2.bias",
    "mlp.0.weight": "transformer.h.{i}.mlp.c_fc.weight",
    "mlp.0.bias": "transformer.h.{i}.mlp.c_fc.bias",
    "mlp.2.weight": "transformer.h.{i}.mlp.c_proj.weight",
    "mlp.2.bias": "transformer.h.{i}.mlp.c_proj.bias",
}
_GPT_OUTER = {
    "embeddings.tokens.weight": "transformer.wte.weight",
    "embeddings.positions.weight": "transformer.wpe.weight",
    "head.norm.weight": "transformer.ln_f.weight",
    "head.norm.bias": "transformer.ln_f.bias",
    "head.lm_head.weight": "lm_head.weight",
}
_GPT_TRANSPOSED = ("attention.qkv.weight", "attention.proj.weight", "mlp.0.weight", "mlp.2.weight")  # Conv1D


def _tables(architecture: str) -> tuple[dict[str, str], dict[str, str]]:
    return (_LLAMA_BLOCK, _LLAMA_OUTER) if architecture == "llama" else (_GPT_BLOCK, _GPT_OUTER)


def hf_name(config: ModelConfig, name: str) -> str:
    """transformers' name of Swarm's whole-model parameter `name`."""
    block, outer = _tables(config.architecture)
    if name.startswith("blocks."):
        index, rest = name[len("blocks.") :].split(".", 1)
        return block[rest].format(i=int(index))
    return outer[name]


def to_hf_state(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Swarm's whole-model state under transformers' names (GPT's Conv1D weights transposed), contiguous. A
    subspace model is written as the ordinary Llama it is: its basis folded into the weights that write into it."""
    if config.subspace_rank:
        state = fold_subspace(config, dict(state))
    result = {}
    for name, tensor in state.items():
        if config.tie_embeddings and name == "head.lm_head.weight":
            continue  # transformers ties it to the embeddings itself
        local = name.split(".", 2)[2] if name.startswith("blocks.") else name
        if config.architecture == "gpt" and local in _GPT_TRANSPOSED:
            tensor = tensor.t()
        result[hf_name(config, name)] = tensor.contiguous()
    return result


def from_hf_state(
    config: ModelConfig, hf_state: Mapping[str, torch.Tensor], names: list[str]
) -> dict[str, torch.Tensor]:
    """Swarm's whole-model state (the parameters `names`) from transformers' tensors. A tied LM head (no
    `lm_head.weight`) is taken from the embeddings. Raises ManifestError naming a missing tensor."""
    result = {}
    for name in names:
        key = hf_name(config, name)
        if key not in hf_state and key == "lm_head.weight":
            key = hf_name(config, "embeddings.tokens.weight")
        if key not in hf_state:
            raise ManifestError(f"the checkpoint has no tensor {key!r}, which a {config.architecture} model needs")
        tensor = hf_state[key]
        local = name.split(".", 2)[2] if name.startswith("blocks.") else name
        if config.architecture == "gpt" and local in _GPT_TRANSPOSED:
            tensor = tensor.t()
        result[name] = tensor.detach().to(torch.float32).contiguous()
    return result


def hf_config(config: ModelConfig, eos_id: int | None = None, bos_id: int | None = None) -> dict[str, Any]:
    """config.json for transformers."""
    if config.architecture == "llama":
        result: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": config.vocab_size,
            "hidden_size": config.width,
            "intermediate_size": config.mlp_width,
            "num_hidden_layers": config.depth,
            "num_attention_heads": config.heads,
            "num_key_value_heads": config.key_value_heads,
            "head_dim": config.head_dim,
            "max_position_embeddings": config.context_length,
            "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": config.tie_embeddings,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        }
    else:
        result = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_embd": config.width,
            "n_layer": config.depth,
            "n_head": config.heads,
            "n_inner": config.mlp_width,
            "n_positions": config.context_length,
            "layer_norm_epsilon": config.norm_eps,
            "activation_function": "gelu",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": config.tie_embeddings,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        }
    # written even when the swarm has none (null): transformers would fill in its own defaults, 50256 for a GPT-2
    # config (outside a small vocabulary, with a warning on every load) or 1 and 2 for a Llama one (real tokens)
    result["eos_token_id"] = eos_id
    result["bos_token_id"] = bos_id
    return result


def model_config_from_hf(raw: Mapping[str, Any], seed: int = 0) -> ModelConfig:
    """A Llama model config from a transformers config.json (the only architecture --from-pretrained reads).
    Raises ManifestError for other models or settings Swarm's Llama blocks do not have."""
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise ManifestError(
            f"config.json describes a {model_type!r} model; --from-pretrained reads Llama checkpoints "
            "(model_type 'llama')"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ManifestError(f"config.json sets {flag}; Swarm's Llama blocks have no biases")
    if raw.get("hidden_act", "silu") != "silu":
        raise ManifestError(
            f"config.json's hidden_act is {raw.get('hidden_act')!r}; Swarm's Llama MLP is SwiGLU (silu)"
        )
    rope_type = (raw.get("rope_parameters") or {}).get("rope_type", "default")
    if raw.get("rope_scaling") or rope_type != "default":
        raise ManifestError(
            "config.json scales its rotary embeddings (rope_scaling or a rope_type other than default), which "
            "Swarm's rotary embeddings do not implement"
        )
    heads = _int(raw, "num_attention_heads")
    width = _int(raw, "hidden_size")
    if raw.get("head_dim") not in (None, width // heads):
        raise ManifestError(f"config.json's head_dim {raw.get('head_dim')} is not hidden_size / num_attention_heads")
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return ModelConfig(
        architecture="llama",
        vocab_size=_int(raw, "vocab_size"),
        width=width,
        depth=_int(raw, "num_hidden_layers"),
        heads=heads,
        context_length=_int(raw, "max_position_embeddings"),
        kv_heads=int(raw.get("num_key_value_heads") or heads),
        intermediate_size=_int(raw, "intermediate_size"),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_theta=float(theta),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        seed=seed,
    )


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ManifestError(f"config.json's {key!r} must be a positive integer, got {str(value)[:50]!r}")
    return value
