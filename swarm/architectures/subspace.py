"""Subspace stages: the residual stream confined to a fixed subspace, so that a stage boundary carries `rank` numbers
per token instead of `width`, and exactly (after Pluralis' subspace networks, arXiv 2506.01260).

With `model.subspace_rank` = k, the hidden state after any layer is `fixed[token] + U z`:
- U [width, k] is a fixed orthonormal basis, and `fixed` [vocab, width] a fixed token embedding orthogonal to it,
  both drawn from the swarm's seed: every peer builds the same ones, nothing about them is trained, downloaded,
  averaged or checkpointed, and both sides of a boundary agree whoever joins, leaves or moves;
- every layer writes into the subspace: the attention's output projection and the MLP's down projection are
  [k, inner] matrices followed by U (`SubspaceWrite`), and stage 0's trained token embedding is [vocab, k], also
  followed by U (`SubspaceEmbeddings`).
So `hidden - fixed[token]` lies in span(U): a stage sends z = U^T (hidden - fixed[token]) (`to_boundary`), the next
rebuilds hidden = fixed[token] + U z (`from_boundary`) with the token ids it receives, and the gradient that goes
back is the k numbers dL/dz = U^T dL/dhidden. Nothing is approximated at a boundary: what it costs is the capacity
of a residual stream of rank k (plus the fixed part), which benchmarks/stage_traffic.py measures in loss.

The model is still an ordinary Llama: `fold_subspace` multiplies U into the weights (o_proj = U o, down_proj = U d,
embeddings = fixed + e U^T), which is how the export writes it for transformers (swarm/hf/format.py).
"""

from __future__ import annotations

import functools
import hashlib

import torch
from torch import nn

from swarm.manifests.manifest import ModelConfig

SUBSPACE_WEIGHTS = ("attention.o_proj.weight", "mlp.down_proj.weight")  # block weights of shape [rank, inner]
FIXED_EMBEDDING_STD = 0.02  # as the trained embeddings start: neither part drowns the other at the start


@functools.lru_cache(maxsize=4)
def _basis(seed: int, width: int, rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    digest = hashlib.sha256(f"{seed}/subspace/{width}/{rank}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    basis, _ = torch.linalg.qr(torch.randn(width, rank, generator=generator, dtype=torch.float64))
    fixed = torch.randn(vocab, width, generator=generator, dtype=torch.float64) * FIXED_EMBEDDING_STD
    fixed -= (fixed @ basis) @ basis.T  # orthogonal to the subspace: the two parts of a hidden state never mix
    return basis.float().contiguous(), fixed.float().contiguous()


def subspace_basis(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [width, rank], fixed [vocab, width]) of a subspace model, the same on every peer (the swarm's seed)."""
    assert config.subspace_rank, "not a subspace model"
    return _basis(config.seed, config.width, config.subspace_rank, config.vocab_size)


class Subspace(nn.Module):
    """The basis and the fixed embedding as buffers (they move with the model to its device) that state dicts leave
    out: they are rebuilt from the seed, never sent or saved."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        basis, fixed = subspace_basis(config)  # shared with the cache, never written to: no copy (llama-1b's fixed
        self.register_buffer("basis", basis, persistent=False)  # embedding is 32,000 x 2,048 float32, 262 MB)
        self.register_buffer("fixed", fixed, persistent=False)

    def to_boundary(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, length, width] hidden states -> the [batch, length, rank] coordinates a boundary carries."""
        return (hidden.float() - self.fixed[tokens]) @ self.basis

    def from_boundary(self, coordinates: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states back from a boundary's coordinates and the token ids."""
        return self.fixed[tokens] + coordinates.float() @ self.basis.T


class SubspaceWrite(nn.Module):
    """A linear layer (no bias) whose outputs lie in the subspace: `inner -> rank` coordinates, then U. Its
    weight has the name of the layer it replaces (o_proj, down_proj), so it is initialised, averaged, stored and
    exported like it."""

    def __init__(self, inner: int, subspace: Subspace):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(subspace.basis.shape[1], inner))
        self.subspace = [subspace]  # a list: one shared module, not a child of every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        basis = self.subspace[0].basis
        return (x @ self.weight.T.to(x.dtype)) @ basis.T.to(x.dtype)


class SubspaceEmbeddings(nn.Module):
    """Stage 0's embeddings: fixed[token] + U e[token], with e [vocab, rank] trained."""

    def __init__(self, config: ModelConfig, subspace: Subspace):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.subspace_rank)
        self.subspace = [subspace]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        subspace = self.subspace[0]
        return subspace.from_boundary(self.tokens(tokens), tokens)


def into_subspace(block: nn.Module, subspace: Subspace) -> None:
    """Make a Llama block write into the subspace: its o_proj and down_proj become SubspaceWrites."""
    block.attention.o_proj = SubspaceWrite(block.attention.o_proj.in_features, subspace)
    block.mlp.down_proj = SubspaceWrite(block.mlp.down_proj.in_features, subspace)


def fold_subspace(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A subspace model's whole-model state (build_full_model's names) as the ordinary Llama it is: U multiplied
    into every layer that writes into the subspace, the fixed embedding added to the trained one."""
    basis, fixed = subspace_basis(config)
    folded = dict(state)
    for name, value in state.items():
        if name.endswith(SUBSPACE_WEIGHTS):
            folded[name] = (basis.double() @ value.double()).to(value.dtype)
        elif name == "embeddings.tokens.weight":
            folded[name] = (fixed.double() + value.double() @ basis.double().T).to(value.dtype)
    return folded
