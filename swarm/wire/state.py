"""A stage's training state as named tensors: what a peer sends to another that starts serving the stage (the reply
of rpc_download_state), what a checkpoint holds, and what an export reads.

This module is the one place that knows the state's layout (docs/STATE.md):
`param/<name>`, `optim/<name>/<statistic>` and, in DiLoCo mode, `outer/<name>/anchor` and `outer/<name>/momentum`,
plus the counters in STATE_COUNTERS. `stage_state_shapes` gives the layout from the manifest alone, which is what
a receiver accepts; `load_state_tensors` checks a received state against the stage before loading it.
"""

from __future__ import annotations

import math

import torch

from swarm.architectures.model import build_stage
from swarm.errors import BadRequestError
from swarm.manifests.manifest import Manifest

STATE_COUNTERS = ("optimizer_steps", "averaging_round")  # travel with a stage's state
# statistics each optimizer keeps per parameter; "step" is a scalar, the others have the parameter's shape
OPTIMIZER_STATISTICS = {
    torch.optim.AdamW: ("step", "exp_avg", "exp_avg_sq"),
    torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
}
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}  # the manifest's names


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a stage trains, averages and sends, by name, in a fixed order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def make_optimizer(manifest: Manifest, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    training = manifest.training
    return OPTIMIZERS[training.optimizer](params, lr=training.learning_rate, weight_decay=training.weight_decay)


def state_shapes(manifest: Manifest, parameter_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every name a valid state of a stage with these parameters may hold, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    statistics = OPTIMIZER_STATISTICS[OPTIMIZERS[manifest.training.optimizer]]
    for name, shape in parameter_shapes.items():
        shapes[f"param/{name}"] = shape
        for key in statistics:
            shapes[f"optim/{name}/{key}"] = () if key == "step" else shape
    shapes.update(outer_state_shapes(manifest, parameter_shapes))
    return shapes


def outer_state_shapes(manifest: Manifest, parameter_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of DiLoCo's outer state (an anchor and a momentum per parameter); none in other modes."""
    if manifest.averaging.mode != "diloco":
        return {}
    shapes = {f"outer/{n}/anchor": shape for n, shape in parameter_shapes.items()}
    shapes.update({f"outer/{n}/momentum": shape for n, shape in parameter_shapes.items()})
    return shapes


def stage_parameter_shapes(manifest: Manifest, stage: int) -> dict[str, tuple[int, ...]]:
    """The parameters `stage` trains, with their shapes, from the manifest alone: the model is built on the meta
    device (no memory, no initialisation)."""
    with torch.device("meta"):
        model = build_stage(manifest, stage)
    return {name: tuple(p.shape) for name, p in trainable_parameters(model)}


def stage_state_shapes(manifest: Manifest, stage: int) -> dict[str, tuple[int, ...]]:
    """The layout of `stage`'s state from the manifest alone."""
    return state_shapes(manifest, stage_parameter_shapes(manifest, stage))


def state_tensors(
    names: list[str], params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """Copies (on the CPU, float32) of the parameters and the optimizer's statistics, by name."""
    items = [(f"param/{name}", p.detach().float().cpu().clone()) for name, p in zip(names, params)]
    for name, p in zip(names, params):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                items.append((f"optim/{name}/{key}", value.detach().float().cpu().clone()))
    return items


def _inner_shapes(names: list[str], params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    """Names and shapes of the parameters and optimizer statistics (the state without DiLoCo's outer part)."""
    shapes: dict[str, tuple[int, ...]] = {}
    statistics = OPTIMIZER_STATISTICS.get(type(optimizer), ())
    for name, p in zip(names, params):
        shapes[f"param/{name}"] = tuple(p.shape)
        for key in statistics:
            shapes[f"optim/{name}/{key}"] = () if key == "step" else tuple(p.shape)
    return shapes


def load_state_tensors(
    items: list[tuple[str, torch.Tensor]],
    names: list[str],
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
) -> None:
    """Check a received state against this stage and load it (parameters and optimizer statistics).

    Raises BadRequestError, leaving the model and optimizer untouched, if anything does not fit."""
    allowed = _inner_shapes(names, params, optimizer)
    received: dict[str, torch.Tensor] = {}
    for key, tensor in items:
        if key not in allowed:
            raise BadRequestError(f"the state holds {key[:200]!r}, which this stage does not have")
        if key in received:
            raise BadRequestError(f"the state holds {key!r} twice")
        if tuple(tensor.shape) != allowed[key] or tensor.dtype != torch.float32:
            raise BadRequestError(
                f"state tensor {key!r} is {tensor.dtype} {list(tensor.shape)}, expected float32 {list(allowed[key])}"
            )
        if not math.isfinite(float(tensor.double().sum())):
            raise BadRequestError(f"state tensor {key!r} holds NaN or Inf")
        statistic = key.rsplit("/", 1)[-1]
        if statistic == "step" and not (0 <= float(tensor) <= 1e12 and float(tensor).is_integer()):
            raise BadRequestError(f"state tensor {key!r} is not a count of steps: {float(tensor)!r}")
        if statistic == "exp_avg_sq" and tensor.numel() and float(tensor.min()) < 0:
            raise BadRequestError(f"state tensor {key!r} has negative values (it is a mean of squares)")
        received[key] = tensor
    missing = [f"param/{name}" for name in names if f"param/{name}" not in received]
    if missing:
        raise BadRequestError(f"the state lacks {len(missing)} parameters, e.g. {missing[0]!r}")
    statistics = OPTIMIZER_STATISTICS.get(type(optimizer), ())
    for name in names:
        present = [key for key in statistics if f"optim/{name}/{key}" in received]
        if present and len(present) != len(statistics):
            raise BadRequestError(f"the state has only some optimizer statistics of {name!r}: {present}")

    with torch.no_grad():
        for name, p in zip(names, params):
            p.copy_(received[f"param/{name}"].to(p.device, p.dtype))
            p.grad = None
            state = {}
            for key in statistics:
                value = received.get(f"optim/{name}/{key}")
                if value is not None:
                    # AdamW keeps "step" as a float32 scalar tensor on the CPU; the rest on the parameter's device
                    state[key] = value.clone() if key == "step" else value.to(p.device, p.dtype).clone()
            optimizer.state[p] = state


def check_state_layout(items: list[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Check a received state against the layout `shapes` (stage_state_shapes) without a model: known names, each
    once, their shapes, float32, finite values, every parameter present. BadRequestError if anything does not fit.
    (What a backup checks before it keeps a state for others: the peer that loads it checks it again, fully.)"""
    seen: set[str] = set()
    for name, tensor in items:
        if name not in shapes or name in seen:
            raise BadRequestError(f"the state holds {name[:200]!r} unexpectedly (unknown, or twice)")
        if tuple(tensor.shape) != shapes[name] or tensor.dtype != torch.float32:
            raise BadRequestError(f"state tensor {name!r} is {tensor.dtype} {list(tensor.shape)}")
        if not math.isfinite(float(tensor.double().sum())):
            raise BadRequestError(f"state tensor {name!r} holds NaN or Inf")
        seen.add(name)
    missing = [name for name in shapes if name.startswith("param/") and name not in seen]
    if missing:
        raise BadRequestError(f"the state lacks {len(missing)} parameters, e.g. {missing[0]!r}")
