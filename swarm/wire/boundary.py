"""What crosses a stage boundary, by the kind of swarm: the shape of hidden states on the wire, and the token tensor
that travels with them.

An ordinary swarm sends hidden states [batch, length, width], and the last stage gets the targets [batch, length].
A subspace swarm (model.subspace_rank, swarm/architectures/subspace.py) sends their [batch, length, rank]
coordinates, and every stage after the first needs the token ids too: it gets the microbatch's *window*
[batch, length + 1] (the inputs and one more token) where an ordinary swarm sends the targets, so that one tensor
gives both (tokens = window[:, :-1], targets = window[:, 1:]). A middle stage of a subspace swarm takes
[inputs, window] where an ordinary one takes [inputs]. Token ids travel as int16 (int32 for vocabularies over
32,768) in a subspace swarm, where they are a sizeable share of the bytes; as int64 otherwise (protocol 7).
"""

from __future__ import annotations

import torch

from swarm.errors import BadRequestError
from swarm.manifests.manifest import Manifest


def boundary_width(manifest: Manifest) -> int:
    """Numbers per token in the hidden states (and their gradients) that stages send each other."""
    return manifest.model.subspace_rank or manifest.model.width


def sends_window(manifest: Manifest) -> bool:
    """True if the stages after the first take the token window besides their inputs (a subspace swarm)."""
    return manifest.model.subspace_rank > 0


def token_tensor(manifest: Manifest, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The token tensor a microbatch carries to the stages after the first: the window or the targets."""
    return torch.cat((inputs, targets[:, -1:]), dim=1) if sends_window(manifest) else targets


def middle_extras(manifest: Manifest, tokens: torch.Tensor) -> list[torch.Tensor]:
    """What a middle stage's forward (or recomputing backward) takes besides its inputs: the window, or nothing."""
    return [tokens] if sends_window(manifest) else []


def split_window(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of a window."""
    return window[:, :-1], window[:, 1:]


def check_token_tensor(manifest: Manifest, tensor: torch.Tensor, inputs: torch.Tensor) -> None:
    """A received token tensor: int64 ids in the vocabulary, of the inputs' [batch, length] (targets) or
    [batch, length + 1] (a window)."""
    batch, length = inputs.shape[:2]
    window = sends_window(manifest)
    shape = (batch, length + 1) if window else (batch, length)
    name = "window" if window else "targets"
    if tensor.dtype != torch.int64 or tuple(tensor.shape) != shape:
        shown = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
        raise BadRequestError(f"{name} must be token ids of shape {list(shape)}, got {shown}")
    vocab = manifest.model.vocab_size
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab):
        raise BadRequestError(f"{name} has token ids outside 0..{vocab - 1}")


def wire_token_dtype(manifest: Manifest) -> torch.dtype:
    """The dtype token ids travel in (receivers widen them to int64)."""
    if not sends_window(manifest):
        return torch.int64
    return torch.int16 if manifest.model.vocab_size <= 2**15 else torch.int32
