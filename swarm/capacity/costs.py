"""What serving a span of stages costs in memory: pure arithmetic over the manifest (no I/O, no torch allocation).

A peer that serves stages [start, end) holds, on its device (the GPU, or RAM for a CPU peer):
- the span's weights, their gradients and a stash of the weights its forwards ran with (float32, 4 bytes each per
  parameter: server/compute.py keeps the stash so that a backward uses the forward's weights);
- the optimizer's statistics (AdamW: two float32 per parameter), unless `offload_optimizer` keeps them in RAM;
- in 16-bit precision, autocast's copies of the weights while a forward runs (2 bytes per parameter);
- the activations of the microbatches it keeps for their backward (`kept_microbatches`): with activation
  checkpointing each block keeps only its input (float32, the residual stream), without it every tensor autograd
  saves (ACTIVATION_BYTES_PER_TOKEN's formula, calibrated on benchmarks/memory.py's measurement);
- transients of one backward: with checkpointing one block's full activations while it is recomputed; the last
  stage's logits of one loss chunk; the gradient of the input;
- the runtime itself (CUDA context and workspaces, or torch's own memory on a CPU).
And in RAM besides (`host_bytes`): the averager's float32 copy of the parameters, DiLoCo's anchor and outer momentum,
and the offloaded optimizer statistics.

`span_cost` adds these up; `longest_span` is how many stages from a start fit in a budget. Both peers (when they
choose a span) and `swarm-init --plan` (swarm/capacity/plan.py) use these functions, so the plan says what peers
then do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from swarm.architectures.model import LOSS_CHUNK_TOKENS, count_stage_parameters
from swarm.manifests.manifest import Manifest

FLOAT32 = 4
COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_FLOATS = {"adamw": 2, "sgd": 1}  # float32 statistics per parameter
KEPT_MICROBATCHES = 8  # microbatches whose activations a peer keeps for backward by default (more recompute)
CUDA_RUNTIME_BYTES = 1 << 30  # CUDA context, cuBLAS/cuDNN workspaces and allocator slack: ~0.5-1 GB in practice
CPU_RUNTIME_BYTES = 600 << 20  # torch and hivemind in a peer's processes: 519-609 MB measured (docs/BENCHMARKS.md)


def activation_bytes_per_token(manifest: Manifest) -> int:
    """Bytes autograd saves for backward per token and block without checkpointing: the float32 residual stream
    and norms (about 24 bytes per unit of width), and in the compute dtype the attention's inputs and outputs and the
    MLP's intermediates. 62.5 KB for llama-150m's blocks in bfloat16 against 60.2 KB measured by saved-tensor hooks
    (benchmarks/memory.py); tests/test_capacity.py checks it against built blocks (llama within 15%, GPT's a
    little over: erring high is the safe side)."""
    config, size = manifest.model, COMPUTE_BYTES[manifest.training.precision]
    width, kv, inner = config.width, config.key_value_heads * config.head_dim, config.mlp_width
    fp32_part = 24 * width if size < FLOAT32 else 12 * width  # in float32 the casts to the compute dtype vanish
    intermediates = 4 if config.architecture == "llama" else 2  # SwiGLU: gate, up, silu(gate), product; GELU: 2
    return fp32_part + size * (5 * width + 3 * kv + intermediates * inner)


@dataclass(frozen=True)
class MemorySettings:
    """A peer's choices that change what a span costs (command-line flags, not the manifest's)."""

    offload_optimizer: bool = False  # optimizer statistics in RAM (a small GPU serves more blocks, steps slower)
    kept_microbatches: int = KEPT_MICROBATCHES
    cuda: bool = True  # False: a CPU peer, whose device memory is its RAM (runtime overhead and host parts add up)


@dataclass(frozen=True)
class SpanCost:
    """Memory of one span, in bytes: `device_bytes` on the GPU (or RAM of a CPU peer, everything included),
    `host_bytes` in RAM besides (0 for a CPU peer: its host parts are in device_bytes); `parts` names the pieces."""

    start: int
    end: int
    parameters: int
    device_bytes: int
    host_bytes: int
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        return self.end - self.start


def span_cost(manifest: Manifest, start: int, end: int, settings: MemorySettings = MemorySettings()) -> SpanCost:
    """What serving stages [start, end) of `manifest` costs."""
    if not 0 <= start < end <= manifest.num_stages:
        raise ValueError(f"span [{start}, {end}) is not within the manifest's {manifest.num_stages} stages")
    config, training = manifest.model, manifest.training
    per_stage, layers = _stage_figures(manifest)
    parameters, blocks = sum(per_stage[start:end]), sum(layers[start:end])
    tokens = training.microbatch_size * config.context_length
    compute = COMPUTE_BYTES[training.precision]
    optimizer = OPTIMIZER_FLOATS.get(training.optimizer, 2) * FLOAT32 * parameters
    full_block = activation_bytes_per_token(manifest) * tokens  # one block's saved tensors, one microbatch
    if training.activation_checkpointing:
        kept = blocks * tokens * config.width * FLOAT32  # each block's input
        recompute = full_block
    else:
        kept = blocks * full_block
        recompute = 0
    last = end == manifest.num_stages
    loss_chunk = min(tokens, LOSS_CHUNK_TOKENS) * config.vocab_size * (compute + FLOAT32) if last else 0
    device = {
        "weights": FLOAT32 * parameters,
        "gradients": FLOAT32 * parameters,
        "stash": FLOAT32 * parameters,
        "compute_copies": (compute * parameters) if compute < FLOAT32 else 0,
        "optimizer": 0 if settings.offload_optimizer else optimizer,
        "activations": settings.kept_microbatches * kept,
        "transients": recompute + loss_chunk + 2 * tokens * config.width * FLOAT32,
        "runtime": CUDA_RUNTIME_BYTES if settings.cuda else CPU_RUNTIME_BYTES,
    }
    averaging = manifest.averaging
    host = {
        "averaging": 0 if averaging.mode == "none" else FLOAT32 * parameters,
        "outer_state": 2 * FLOAT32 * parameters if averaging.mode == "diloco" else 0,
        "offloaded_optimizer": optimizer if settings.offload_optimizer else 0,
    }
    if not settings.cuda:  # one memory: everything counts against it
        device.update(host)
        host = {name: 0 for name in host}
    return SpanCost(start, end, parameters, sum(device.values()), sum(host.values()), {**device, **host})


@functools.lru_cache(maxsize=16)
def _stage_figures(manifest: Manifest) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Parameters and transformer blocks of each stage (computed once per manifest: plans call span_cost often)."""
    stages = range(manifest.num_stages)
    return tuple(count_stage_parameters(manifest)), tuple(len(manifest.stage_layers(s)) for s in stages)


def longest_span(manifest: Manifest, start: int, budget: int, settings: MemorySettings = MemorySettings()) -> int:
    """How many stages from `start` fit in `budget` bytes of device memory (0: not even one)."""
    fitting = 0
    for end in range(start + 1, manifest.num_stages + 1):
        if span_cost(manifest, start, end, settings).device_bytes > budget:
            break
        fitting = end - start
    return fitting


def kept_microbatches(manifest: Manifest, start: int, end: int, budget: int, settings: MemorySettings) -> int:
    """How many microbatches' activations fit in `budget` beside the span's other costs (at least 1: a peer that
    keeps none recomputes every forward; server/compute.py recomputes the ones beyond)."""
    bare = span_cost(manifest, start, end, _with_kept(settings, 0))
    one = span_cost(manifest, start, end, _with_kept(settings, 1))
    per_microbatch = max(one.device_bytes - bare.device_bytes, 1)
    return max(1, (budget - bare.device_bytes) // per_microbatch)


def _with_kept(settings: MemorySettings, kept: int) -> MemorySettings:
    return MemorySettings(settings.offload_optimizer, kept, settings.cuda)


def span_lengths(manifest: Manifest, budget: int, settings: MemorySettings = MemorySettings()) -> list[int]:
    """longest_span for every start: the first and the last stages cost more (embeddings, head, loss chunk)."""
    return [longest_span(manifest, start, budget, settings) for start in range(manifest.num_stages)]
