"""A GPT-style decoder, split into pipeline stages.

Stage 0 holds the token and position embeddings, the last stage the final norm, the LM head and the loss;
every stage holds its own contiguous range of transformer blocks. Building a stage builds only that stage's
parameters. Every component is initialised from its own generator, seeded from the manifest's seed and the
component's name, so a stage built alone is bit-identical to the same layers of the whole model, and every
fresh replica of a stage starts identical.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.manifest import Manifest, ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, length, width))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.width)
        self.positions = nn.Embedding(config.context_length, config.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Head(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class StageModel(nn.Module):
    """The layers of one stage. Input: tokens (stage 0) or hidden states; output: hidden states or logits."""

    def __init__(self, config: ModelConfig, layers: range, first: bool, last: bool):
        super().__init__()
        self.config = config
        self.layers = layers
        self.first = first
        self.last = last
        self.embeddings = Embeddings(config) if first else None
        self.blocks = nn.ModuleList()
        for index in layers:
            block = Block(config)
            _init_component(block, config, f"block{index}")
            self.blocks.append(block)
        self.head = Head(config) if last else None
        if self.embeddings is not None:
            _init_component(self.embeddings, config, "embeddings")
        if self.head is not None:
            _init_component(self.head, config, "head")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(inputs) if self.embeddings is not None else inputs
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_stage(manifest: Manifest, stage: int) -> StageModel:
    """Build only stage `stage`'s parameters, deterministically from the manifest's seed."""
    if not 0 <= stage < manifest.num_stages:
        raise ValueError(f"stage {stage} does not exist; the swarm has stages 0..{manifest.num_stages - 1}")
    return StageModel(
        manifest.model,
        manifest.stage_layers(stage),
        first=stage == 0,
        last=stage == manifest.num_stages - 1,
    )


def build_full_model(config: ModelConfig) -> StageModel:
    """The whole model in one module (for single-process baselines and evaluation)."""
    return StageModel(config, range(config.depth), first=True, last=True)


def _init_component(module: nn.Module, config: ModelConfig, name: str) -> None:
    """GPT-2 style init from a generator seeded by (seed, component name): independent of what else is built."""
    digest = hashlib.sha256(f"{config.seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    residual_std = 0.02 / math.sqrt(2 * config.depth)
    with torch.no_grad():
        for param_name, param in module.named_parameters():
            if _is_norm_parameter(module, param_name):
                param.fill_(1.0 if param_name.endswith("weight") else 0.0)
            elif param_name.endswith("bias"):
                param.zero_()
            else:
                std = residual_std if param_name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                param.normal_(0.0, std, generator=generator)


def _is_norm_parameter(module: nn.Module, param_name: str) -> bool:
    owner = module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module
    return isinstance(owner, nn.LayerNorm)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def count_stage_parameters(manifest: Manifest) -> list[int]:
    """Parameters of each stage, by formula: instant even for a 1B model (tests check it against built stages)."""
    width, vocab = manifest.model.width, manifest.model.vocab_size
    block = 12 * width * width + 13 * width  # two norms, qkv and proj with biases, a 4x MLP with biases
    embeddings = (vocab + manifest.model.context_length) * width
    head = 2 * width + vocab * width  # final norm, LM head without bias
    last = manifest.num_stages - 1
    return [
        (embeddings if stage == 0 else 0) + len(manifest.stage_layers(stage)) * block + (head if stage == last else 0)
        for stage in range(manifest.num_stages)
    ]
