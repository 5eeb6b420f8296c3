"""Llama blocks (as torchtitan, litgpt and Hugging Face's LlamaForCausalLM define them): RMSNorm, rotary position
embeddings, grouped-query attention, a SwiGLU MLP, no biases.

Rotary embeddings follow Hugging Face's convention (the two halves of each head are rotated together, not
interleaved pairs), so an export loads into transformers' LlamaForCausalLM unchanged. RMSNorm normalises in float32
whatever the compute dtype, as Hugging Face's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarm.manifests.manifest import ModelConfig

RESIDUAL_WEIGHTS = ("attention.o_proj.weight", "mlp.down_proj.weight")


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


NORMS = (RMSNorm,)


def rotary_tables(config: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] of the rotary embedding, in float32."""
    dim = config.head_dim
    inverse = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.heads, self.kv_heads, self.head_dim = config.heads, config.key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(self.config, length, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads != self.heads:  # each key/value head serves a group of query heads
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.width, config.mlp_width, bias=False)
        self.up_proj = nn.Linear(config.width, config.mlp_width, bias=False)
        self.down_proj = nn.Linear(config.mlp_width, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.width, config.norm_eps)
        self.attention = Attention(config)
        self.norm2 = RMSNorm(config.width, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens)


class Head(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.width, config.norm_eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def block_parameters(config: ModelConfig) -> int:
    width, kv = config.width, config.key_value_heads * config.head_dim
    written = config.subspace_rank or width  # o_proj and down_proj write rank coordinates in a subspace swarm
    attention = width * width + written * width + 2 * width * kv  # q and o; k and v
    return 2 * width + attention + 2 * width * config.mlp_width + written * config.mlp_width


def embedding_parameters(config: ModelConfig) -> int:
    return config.vocab_size * (config.subspace_rank or config.width)


def head_parameters(config: ModelConfig) -> int:
    return config.width + (0 if config.tie_embeddings else config.vocab_size * config.width)
