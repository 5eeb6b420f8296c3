"""The models a swarm trains.

- gpt.py, llama.py: the architectures a manifest can name (`model.architecture`); each defines the same three
  parts, `Embeddings`, `Block` and `Head`, how many parameters a block has and which weights are residual
  projections (initialised smaller).
- model.py: a decoder of either, split into pipeline stages: `build_stage` builds one stage's parameters only,
  `build_full_model` the whole model (export, tests).
- subspace.py: subspace stages (`model.subspace_rank`): a llama whose residual stream lives in a fixed low-rank
  subspace, so that a stage boundary carries rank numbers per token, exactly; folding it into an ordinary Llama.
"""

from __future__ import annotations

from types import ModuleType

from swarm.architectures import gpt, llama

ARCHITECTURES: dict[str, ModuleType] = {"gpt": gpt, "llama": llama}


def architecture(name: str) -> ModuleType:
    return ARCHITECTURES[name]
