"""A decoder (GPT or Llama blocks: swarm/architectures/), split into pipeline stages.

Stage 0 holds the embeddings, the last stage the final norm, the LM head and the loss; every stage holds its own
contiguous range of transformer blocks. A stage computes in the manifest's precision (autocast: the weights stay
float32) and, with activation checkpointing, recomputes its blocks in backward instead of keeping their
activations. Building a stage builds only that stage's
parameters. Every component is initialised from its own generator, seeded from the manifest's seed and the
component's name, so a stage built alone is bit-identical to the same layers of the whole model, and every
fresh replica of a stage starts identical.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.architectures import architecture
from swarm.architectures.subspace import Subspace, SubspaceEmbeddings, into_subspace
from swarm.errors import ManifestError
from swarm.manifests.manifest import Manifest, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOSS_CHUNK_TOKENS = 2048  # tokens whose logits the last stage holds at once while training (forward_loss)


class StageModel(nn.Module):
    """The layers of one stage. Input: tokens (stage 0) or hidden states; output: hidden states or logits.

    In a subspace model (model.subspace_rank, swarm/architectures/subspace.py) the hidden states between stages
    are their `rank` coordinates, and a stage after the first also takes the microbatch's token ids."""

    def __init__(
        self,
        config: ModelConfig,
        layers: range,
        first: bool,
        last: bool,
        precision: str = "float32",
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        self.config = config
        self.layers = layers
        self.first = first
        self.last = last
        self.compute_dtype = DTYPES[precision]
        self.activation_checkpointing = activation_checkpointing
        parts = architecture(config.architecture)
        self.subspace = Subspace(config) if config.subspace_rank else None
        if first:
            self.embeddings = (
                parts.Embeddings(config) if self.subspace is None else SubspaceEmbeddings(config, self.subspace)
            )
        else:
            self.embeddings = None
        self.blocks = nn.ModuleList()
        for index in layers:
            block = parts.Block(config)
            if self.subspace is not None:
                into_subspace(block, self.subspace)
            _init_component(block, config, f"block{index}")
            self.blocks.append(block)
        self.head = parts.Head(config) if last else None
        if self.embeddings is not None:
            _init_component(self.embeddings, config, "embeddings")
        if self.head is not None:
            _init_component(self.head, config, "head")
            if config.tie_embeddings and self.embeddings is not None:
                self.head.lm_head.weight = self.embeddings.tokens.weight

    @property
    def takes_tokens(self) -> bool:
        """True if this stage needs the token ids besides its inputs: a stage after the first of a subspace model."""
        return self.subspace is not None and not self.first

    def forward(self, inputs: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits on the last stage (in the compute dtype), hidden states otherwise (float32: the residual stream
        stays float32 under autocast); `tokens` [batch, length] only where `takes_tokens`."""
        with self._autocast(inputs.device):
            x = self._blocks(inputs, tokens)
            if self.head is not None:
                return self.head(x)
            if self.subspace is not None:
                return self.subspace.to_boundary(x, inputs if self.first else tokens)
            return x

    def _blocks(self, inputs: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """The embeddings (stage 0) and the blocks, each recomputed in backward with activation checkpointing."""
        if self.embeddings is not None:
            x = self.embeddings(inputs)
        elif self.subspace is not None:
            assert tokens is not None, "a subspace stage after the first takes the token ids"
            x = self.subspace.from_boundary(inputs, tokens)
        else:
            x = inputs
        for block in self.blocks:
            x = _checkpointed(block, x) if self.activation_checkpointing and torch.is_grad_enabled() else block(x)
        return x

    def forward_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last stage's mean loss, `loss(self(inputs, tokens), targets)`, without ever holding all the logits:
        the head runs on LOSS_CHUNK_TOKENS tokens at a time, each chunk recomputed in backward (the logits of a
        microbatch of 8 x 1,024 tokens and a 32k vocabulary are 1.5 GB in bfloat16 and float32 together)."""
        assert self.head is not None, "only the last stage computes the loss"
        with self._autocast(inputs.device):
            x = self._blocks(inputs, tokens)
            hidden, flat = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
            if not torch.is_grad_enabled() or flat.numel() <= LOSS_CHUNK_TOKENS:
                return self.loss(self.head(hidden), flat)
            total = hidden.new_zeros((), dtype=torch.float32)
            for start in range(0, flat.numel(), LOSS_CHUNK_TOKENS):
                end = start + LOSS_CHUNK_TOKENS
                total = total + _checkpointed(_SummedLoss(self.head), hidden[start:end], flat[start:end])
            return total / flat.numel()

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats per token, computed in float32 whatever the compute dtype."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class _SummedLoss(nn.Module):
    """The head and the summed cross-entropy of a chunk of tokens (forward_loss checkpoints one per chunk)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(hidden).float(), targets, reduction="sum")


def _checkpointed(block: nn.Module, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
    """`block(x)`, recomputed in backward. The weights go in as explicit inputs: a stage's forward may run with
    stashed weights (server/compute.py, torch.func.functional_call), and its backward comes later, after that call
    has put the module's own parameters back (and maybe after an optimizer step changed them); recomputing with
    the module's attributes then would take the wrong weights."""
    names = [name for name, _ in block.named_parameters()]
    weights = [functools.reduce(getattr, name.split("."), block) for name in names]  # the stash, inside the call
    return checkpoint(_run_block, block, names, len(extra), x, *extra, *weights, use_reentrant=False)


def _run_block(block: nn.Module, names: list[str], extras: int, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    inputs, weights = (x, *rest[:extras]), rest[extras:]
    return torch.func.functional_call(block, dict(zip(names, weights)), inputs)


def build_stage(manifest: Manifest, stage: int) -> StageModel:
    """Build only stage `stage`'s parameters, deterministically from the manifest's seed."""
    if not 0 <= stage < manifest.num_stages:
        raise ManifestError(
            f"stage {stage} does not exist; the swarm's manifest has stages 0..{manifest.num_stages - 1}: pick one "
            "of those"
        )
    return StageModel(
        manifest.model,
        manifest.stage_layers(stage),
        first=stage == 0,
        last=stage == manifest.num_stages - 1,
        precision=manifest.training.precision,
        activation_checkpointing=manifest.training.activation_checkpointing,
    )


def build_full_model(config: ModelConfig) -> StageModel:
    """The whole model in one module (for single-process baselines and evaluation)."""
    return StageModel(config, range(config.depth), first=True, last=True)


def _init_component(module: nn.Module, config: ModelConfig, name: str) -> None:
    """GPT-2 style init (normal 0.02, residual projections 0.02 / sqrt(2 x depth), norms 1, biases 0) from a
    generator seeded by (seed, component name): independent of what else is built. On the meta device (shapes
    only) there is nothing to initialise."""
    if any(p.is_meta for p in module.parameters()):
        return
    parts = architecture(config.architecture)
    digest = hashlib.sha256(f"{config.seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    residual_std = 0.02 / math.sqrt(2 * config.depth)
    with torch.no_grad():
        for param_name, param in module.named_parameters():
            if _is_norm_parameter(module, param_name, parts.NORMS):
                param.fill_(1.0 if param_name.endswith("weight") else 0.0)
            elif param_name.endswith("bias"):
                param.zero_()
            else:
                std = residual_std if param_name.endswith(parts.RESIDUAL_WEIGHTS) else 0.02
                param.normal_(0.0, std, generator=generator)


def _is_norm_parameter(module: nn.Module, param_name: str, norms: tuple[type, ...]) -> bool:
    owner = module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module
    return isinstance(owner, norms)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def count_stage_parameters(manifest: Manifest) -> list[int]:
    """Parameters of each stage, by formula: instant even for a 1B model (tests check it against built stages)."""
    parts = architecture(manifest.model.architecture)
    block = parts.block_parameters(manifest.model)
    embeddings = parts.embedding_parameters(manifest.model)
    head = parts.head_parameters(manifest.model)
    last = manifest.num_stages - 1
    return [
        (embeddings if stage == 0 else 0) + len(manifest.stage_layers(stage)) * block + (head if stage == last else 0)
        for stage in range(manifest.num_stages)
    ]
