"""The model architectures a manifest can name (`model.architecture`): each module defines the same three parts,
`Embeddings`, `Block` and `Head`, which swarm/architectures/model.py stacks into stages, plus how many parameters a block has
and which weights are residual projections (initialised smaller)."""

from __future__ import annotations

from types import ModuleType

from swarm.architectures import gpt, llama

ARCHITECTURES: dict[str, ModuleType] = {"gpt": gpt, "llama": llama}


def architecture(name: str) -> ModuleType:
    return ARCHITECTURES[name]
