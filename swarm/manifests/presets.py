"""Model size presets and the settings of a new swarm (what `swarm-init` writes).

A preset is a starting point: a model shape plus training settings that suit it. Every explicit setting
given to `new_manifest` overrides the preset's, and the result goes through the same validation as any
manifest read from disk, so `swarm-init` can never write a manifest that peers would refuse.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from swarm import PROTOCOL_VERSION
from swarm.errors import ManifestError
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict


@dataclass(frozen=True)
class Preset:
    description: str
    model: dict[str, Any]
    stages: int
    training: dict[str, Any]
    averaging: dict[str, Any]
    network: dict[str, Any]


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        description="about 0.8M parameters; trains on a laptop CPU in minutes (the demo's model)",
        model={"vocab_size": 256, "width": 128, "depth": 4, "heads": 4, "context_length": 128},
        stages=2,
        training={"microbatch_size": 16, "microbatches_per_step": 2, "learning_rate": 0.002},
        averaging={"every_samples": 4096},
        network={"announce_period": 2.0},
    ),
    "small": Preset(
        description="about 25M parameters; a CPU swarm works, a consumer GPU per stage is comfortable",
        model={"vocab_size": 256, "width": 512, "depth": 8, "heads": 8, "context_length": 256},
        stages=2,
        training={"microbatch_size": 16, "microbatches_per_step": 4, "learning_rate": 0.001},
        averaging={"every_samples": 4096},
        network={"announce_period": 5.0},
    ),
    "1b": Preset(
        description="about 1.0B parameters for GPUs: 4 stages of ~250M (AdamW state ~4 GB per stage), "
        "8-bit activations for home links",
        model={"vocab_size": 256, "width": 2048, "depth": 20, "heads": 16, "context_length": 1024},
        stages=4,
        training={
            "microbatch_size": 4,
            "microbatches_per_step": 64,  # the step gate flushes once per step: large steps hide it
            "learning_rate": 0.0003,
            "activation_compression": "8bit",
            "timeouts": {"forward": 60, "backward": 120, "microbatch": 600},
        },
        averaging={"every_samples": 65536, "matchmaking_time": 15.0, "timeout": 300.0},
        network={"announce_period": 10.0},
    ),
    # Llama shapes (RMSNorm, rotary positions, SwiGLU, grouped-query attention): swarm/architectures/llama.py
    "llama-tiny": Preset(
        description="a Llama of about 0.8M parameters, as many as tiny's: for CPUs and tests",
        model={
            "architecture": "llama",
            "vocab_size": 256,
            "width": 128,
            "depth": 4,
            "heads": 4,
            "kv_heads": 2,
            "intermediate_size": 384,
            "context_length": 128,
        },
        stages=2,
        training={"microbatch_size": 16, "microbatches_per_step": 2, "learning_rate": 0.002},
        averaging={"every_samples": 4096},
        network={"announce_period": 2.0},
    ),
    "llama-150m": Preset(
        description="OpenDiLoCo's 150M Llama (width 1024, 12 layers, 16 heads; ~150M without the embeddings) in "
        "bfloat16, for consumer GPUs; give it a tokenizer (--tokenizer or --train-tokenizer)",
        model={
            "architecture": "llama",
            "vocab_size": 32000,
            "width": 1024,
            "depth": 12,
            "heads": 16,
            "intermediate_size": 2688,
            "context_length": 1024,
            "subspace_rank": 64,  # stage boundaries carry 64 numbers a token, not 1024 (docs/BENCHMARKS.md)
        },
        stages=2,
        training={
            "microbatch_size": 8,
            "microbatches_per_step": 64,  # the step gate flushes once per step: large steps hide it
            "learning_rate": 0.0004,
            "precision": "bfloat16",
            "activation_compression": "8bit",
        },
        averaging={"every_samples": 65536},
        network={"announce_period": 5.0},
    ),
    "llama-1b": Preset(
        description="the TinyLlama 1.1B shape (width 2048, 22 layers, 32 heads, 4 KV heads) in bfloat16 with "
        "activation checkpointing, 4 stages for GPUs; give it a tokenizer",
        model={
            "architecture": "llama",
            "vocab_size": 32000,
            "width": 2048,
            "depth": 22,
            "heads": 32,
            "kv_heads": 4,
            "intermediate_size": 5632,
            "context_length": 2048,
            "subspace_rank": 128,  # stage boundaries carry 128 numbers a token, not 2048 (docs/BENCHMARKS.md)
        },
        stages=4,
        training={
            "microbatch_size": 4,
            "microbatches_per_step": 64,  # the step gate flushes once per step: large steps hide it
            "learning_rate": 0.0003,
            "precision": "bfloat16",
            "activation_checkpointing": True,
            "activation_compression": "8bit",
            "timeouts": {"forward": 60, "backward": 120, "microbatch": 600},
        },
        averaging={"every_samples": 65536, "matchmaking_time": 15.0, "timeout": 300.0},
        network={"announce_period": 10.0},
    ),
}


def new_manifest(
    name: str,
    preset: str,
    stages: int | None = None,
    model: dict[str, int] | None = None,
    training: dict[str, Any] | None = None,
    averaging: dict[str, Any] | None = None,
    data_source: str | None = None,
    initial_peers: list[str] | None = None,
    secret_file: str | None = None,
    data: dict[str, Any] | None = None,
    pretrained: dict[str, str] | None = None,
    balancing: dict[str, Any] | None = None,
) -> Manifest:
    """A validated manifest from a preset, with explicit settings (None = the preset's) laid over it."""
    if preset not in PRESETS:
        raise ManifestError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    raw_model = {**base.model, "seed": 0, **(model or {})}
    raw_training = copy.deepcopy(base.training)
    raw_training.update(training or {})
    depth = raw_model["depth"]
    count = base.stages if stages is None else stages
    if isinstance(depth, int) and isinstance(count, int) and count > depth:
        raise ManifestError(f"{count} stages need at least {count} layers, but the model has depth {depth}")
    raw = {
        "name": name,
        "protocol_version": PROTOCOL_VERSION,
        "model": raw_model,
        "stages": {"count": count},
        "training": raw_training,
        "data": {"source": data_source or "stdlib", **(data or {})},
        "network": {**base.network, **({"secret_file": secret_file} if secret_file else {})},
        "averaging": {**base.averaging, **(averaging or {})},
        "initial_peers": list(initial_peers or []),
    }
    if balancing:
        raw["balancing"] = dict(balancing)
    if pretrained:
        raw["pretrained"] = dict(pretrained)
    return manifest_from_dict(raw)
