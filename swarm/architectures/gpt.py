"""GPT-2 blocks: pre-LayerNorm, learned position embeddings, a GELU MLP, biases everywhere (nanoGPT's shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarm.manifests.manifest import ModelConfig

# weights that write into the residual stream: initialised with std 0.02 / sqrt(2 x depth) (GPT-2)
RESIDUAL_WEIGHTS = ("attention.proj.weight", "mlp.2.weight")
NORMS = (nn.LayerNorm,)


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
        self.norm1 = nn.LayerNorm(config.width, eps=config.norm_eps)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.width, eps=config.norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, config.mlp_width),
            nn.GELU(),
            nn.Linear(config.mlp_width, config.width),
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
        self.norm = nn.LayerNorm(config.width, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def block_parameters(config: ModelConfig) -> int:
    width, mlp = config.width, config.mlp_width
    attention = 3 * width * width + 3 * width + width * width + width  # qkv and proj with biases
    return 4 * width + attention + 2 * width * mlp + mlp + width  # two norms, the MLP with biases


def embedding_parameters(config: ModelConfig) -> int:
    return (config.vocab_size + config.context_length) * config.width


def head_parameters(config: ModelConfig) -> int:
    return 2 * config.width + (0 if config.tie_embeddings else config.vocab_size * config.width)
