"""The manifest: a JSON document that defines a swarm, and its data model.

A manifest holds the model config, the stages (layer range of each), the training settings, the data
source and the initial peers. Each setting's default is stated once, in its dataclass field below; the validator
(swarm/manifests/validation.py, which turns a decoded document into a Manifest, or a ManifestError naming the
field) reads it from there. The swarm id is a hash of the canonical manifest *without* its initial peers, so the
same swarm can be published with different bootstrap addresses, while any change of settings makes a new swarm.

Getting a manifest from a file or a URL, and writing one, is swarm/manifests/loading.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from swarm import PROTOCOL_VERSION
from swarm.errors import ManifestError
from swarm.manifests.fields import validate_multiaddrs
from swarm.trust.secret import SwarmSecret

OPTIMIZERS = ("adamw", "sgd")
COMPRESSIONS = ("float32", "float16", "8bit")  # of activations and gradients between stages, and of averaging
ACTIVATION_COMPRESSIONS = (*COMPRESSIONS, "bfloat16", "4bit")  # 4bit: swarm/wire/four_bit.py; averaging's
# 4bit is another codec (swarm/averaging/quantization.py), and hivemind's averaging has no bfloat16 one
AVERAGING_COMPRESSIONS = (
    *COMPRESSIONS,
    "4bit",
)  # 4bit: for diloco's pseudo-gradients (swarm/averaging/quantization.py)
ARCHITECTURES = ("gpt", "llama")  # swarm/architectures/
PRECISIONS = ("float32", "bfloat16", "float16")  # autocast dtypes; weights and optimizer state stay float32
AVERAGING_MODES = ("parameters", "diloco", "none")


@dataclass(frozen=True, kw_only=True)  # keyword-only: a required field (the shape) may follow one with a default
class ModelConfig:
    """The model's shape. gpt: GPT-2 blocks (LayerNorm, learned positions, GELU MLP, biases). llama: RMSNorm,
    rotary positions (Hugging Face's convention), SwiGLU MLP, grouped-query attention, no biases."""

    architecture: str = "gpt"
    vocab_size: int = 256
    width: int  # a manifest must state its model's shape
    depth: int
    heads: int
    context_length: int
    kv_heads: int = 0  # heads of keys and values (grouped-query attention); 0: as many as heads
    intermediate_size: int = 0  # of the MLP; 0: 4 x width (gpt), or SwiGLU's 8/3 x width rounded up to 256 (llama)
    tie_embeddings: bool = False  # the LM head reuses the token embeddings (only a one-stage swarm can)
    rope_theta: float = 10000.0  # llama
    # llama: > 0 confines the residual stream to a fixed subspace of this rank, so that stage boundaries carry
    # `subspace_rank` numbers per token instead of `width` (swarm/architectures/subspace.py); 0: off
    subspace_rank: int = 0
    norm_eps: float = 1e-5
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def mlp_width(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        if self.architecture == "gpt":
            return 4 * self.width
        return 256 * -(-(8 * self.width // 3) // 256)  # Llama's rule: 2/3 of 4 x width, a multiple of 256


@dataclass(frozen=True)
class Timeouts:
    forward: float = 30.0
    backward: float = 60.0
    microbatch: float = 300.0


PIPELINES = ("forward", "relay")
WINDOW_STEPS = 2  # the automatic window limit, in optimizer steps' worth of microbatches (TrainingConfig.window_limit)
PIPELININGS = ("flush", "async")
ROUTINGS = ("network_aware", "compute_only")


@dataclass(frozen=True)
class TrainingConfig:
    microbatch_size: int = 16
    microbatches_per_step: int = 4
    optimizer: str = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    # the most microbatches a trainer keeps in flight; 0: automatic, WINDOW_STEPS steps' worth (window_limit).
    # Under the step gate (pipelining flush) more in flight costs no loss, and a step's microbatches plus the
    # next step's first ones waiting at stage 0 are all a pipe can use
    max_in_flight: int = 0
    # with the forward pipeline, the number in flight adapts to the route (swarm/client/window.py), up to the
    # limit; false: always the limit
    adaptive_window: bool = True
    # flush: a stage steps only when the microbatches it started on the current weights are all back, so no
    # gradient is stale however many are in flight (swarm/server/step_gate.py); async: it steps every
    # microbatches_per_step gradients, whenever their forwards ran (stale ones; see delay_scaled_lr)
    pipelining: str = "flush"
    # a stage whose gradients come back late steps with a smaller learning rate (swarm/server/staleness.py)
    delay_scaled_lr: bool = True
    # of activations and gradients between stages: 8-bit is 4x fewer bytes than float32 at no measured loss, and
    # faster even on loopback (docs/BENCHMARKS.md, "Over emulated internet links")
    activation_compression: str = "8bit"
    # the dtype stages compute in (autocast): weights, gradients and optimizer state stay float32; float16 runs
    # with a loss scaler at every stage (swarm/server/precision.py). Activations travel in it unless compressed more.
    precision: str = "float32"
    # recompute a stage's blocks in backward instead of keeping their activations: less memory, ~1/3 more compute
    activation_checkpointing: bool = False
    # forward: stages send activations to each other (server/forwarding.py); relay: the trainer carries them
    # between stages (the protocol before issue 14, kept to compare against)
    pipeline: str = "forward"
    # network_aware: routes count the transfers between hops (latency and bandwidth); compute_only: they do not
    routing: str = "network_aware"
    timeouts: Timeouts = field(default_factory=Timeouts)

    def window_limit(self) -> int:
        """The most microbatches a trainer keeps in flight: max_in_flight, or when it is 0 (automatic) enough to
        fill this step's slots at every stage and have the next step's waiting (WINDOW_STEPS steps)."""
        return self.max_in_flight or WINDOW_STEPS * self.microbatches_per_step


@dataclass(frozen=True)
class DataConfig:
    """What trainers read. `source` is "stdlib", a text file, a folder, a .jsonl or .parquet file (each peer
    tokenizes it into token chunks once, swarm/dataset/corpus.py), or a prepared folder that `swarm-data prepare`
    wrote, published anywhere: a path (relative to the manifest), an http(s) URL, or an fsspec URL (hf://, s3://);
    then `index_sha256` pins its index, so every trainer reads the same verified chunks (swarm/dataset/locations.py).
    `mirrors` are more places with the same prepared folder, tried in order after `source`."""

    source: str = "stdlib"
    heldout_fraction: float = 0.05
    shards: int = 8  # train chunks a raw source is cut into (a prepared folder has its own)
    index_sha256: str = ""  # of a prepared folder's index.json; "": the source is raw text
    mirrors: tuple[str, ...] = ()
    tokenizer: str = ""  # a tokenizer.json's name next to the manifest (or a URL); "": bytes (vocabulary 256)
    tokenizer_sha256: str = ""  # the tokenizer file's SHA-256: peers refuse any other file


@dataclass(frozen=True)
class NetworkConfig:
    announce_period: float = 5.0
    secret_file: str = ""  # a private swarm's secret is in this file (see swarm/trust/secret.py); "": a public swarm


@dataclass(frozen=True)
class BalancingConfig:
    check_period: float = 10.0  # mean seconds between a peer's checks of the balance (each randomized 0.5-1.5x)
    min_gain: float = 0.1  # peers move only if that raises the swarm's bottleneck by more than this fraction
    # each peer serves as many consecutive stages as its memory holds (a span), where the swarm is weakest; false:
    # one stage each (docs/BALANCING.md, "Spans and memory"). Swarms made for spans have one block a stage
    spans: bool = False
    # spans: where memory allows, every stage is held by at least this many peers before throughput counts, so that
    # one peer that vanishes takes no stage's trained state with it (swarm/balancing/spans.py)
    min_holders: int = 2


@dataclass(frozen=True)
class AveragingConfig:
    """How the peers of a stage average with each other (see swarm/averaging/rules.py).

    parameters: each round averages the parameters (and, with optimizer_state, the optimizer's statistics),
                weighted by the samples each peer processed since its last round.
    diloco:     each round averages the pseudo-gradient (parameters at the last round minus now) and applies it
                to the last round's parameters with an outer SGD with Nesterov momentum (DiLoCo, Douillard et
                al. 2023); the replicas share that anchor.
    none:       replicas never average (a baseline for benchmarks; replicas drift apart).

    The defaults were chosen with benchmarks/convergence.py (docs/BENCHMARKS.md, "Against synchronous data
    parallel"): diloco at 4 bits every 4096 samples, outer lr 1.0 without momentum, was within 1% of synchronous
    data parallel at over 500x less traffic; DiLoCo's published 0.7 with Nesterov 0.9 overshot at these horizons.
    """

    mode: str = "diloco"
    every_samples: int = 4096  # samples processed by the stage, across the swarm, between two rounds
    optimizer_state: bool = False  # parameters mode: also average the optimizer's statistics
    compression: str = "4bit"  # when the manifest names none: 4bit in diloco mode, 8bit in the others
    outer_learning_rate: float = 1.0  # diloco mode
    outer_momentum: float = 0.0  # diloco mode (Nesterov)
    matchmaking_time: float = 5.0  # seconds a round waits for the stage's other peers to join it
    timeout: float = 60.0  # a round that has not finished by then is given up


@dataclass(frozen=True)
class PretrainedConfig:
    """Where the initial weights come from: "" (the seeded initialisation, swarm/architectures/model.py) or a
    Hugging Face Llama folder (config.json, model.safetensors), whose weights' SHA-256 is pinned
    (swarm/hf/pretrained.py)."""

    path: str = ""  # relative to the manifest's folder, or absolute
    sha256: str = ""


@dataclass(frozen=True)
class Manifest:
    name: str
    model: ModelConfig
    stages: tuple[tuple[int, int], ...]
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    balancing: BalancingConfig = field(default_factory=BalancingConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    pretrained: PretrainedConfig = field(default_factory=PretrainedConfig)
    initial_peers: tuple[str, ...] = ()
    protocol_version: int = PROTOCOL_VERSION
    # a private swarm's secret, read from network.secret_file when the manifest is loaded; never written out
    secret: SwarmSecret | None = field(default=None, compare=False, repr=False)
    # where the manifest was read from (a file's folder or a URL), to find the files it names; never written out
    origin: str = field(default="", compare=False, repr=False)

    @property
    def private(self) -> bool:
        return bool(self.network.secret_file)

    def proof(self, peer_id: str) -> str | None:
        """What a request from `peer_id` carries to prove membership of a private swarm (None: a public one)."""
        if not self.private:
            return None
        if self.secret is None:
            raise ManifestError(
                "this swarm is private, but its secret was not loaded (load the manifest from its file)"
            )
        return self.secret.proof(peer_id)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_layers(self, stage: int) -> range:
        start, end = self.stages[stage]
        return range(start, end)

    def to_dict(self, with_peers: bool = True) -> dict[str, Any]:
        """The canonical JSON-compatible form (stages written out explicitly). Settings added after swarms were
        published (LATER_FIELDS) are left out while they have their defaults, so those swarms keep their ids."""
        result = {
            "name": self.name,
            "protocol_version": self.protocol_version,
            "model": _without_later_defaults(self.model),
            "stages": {"count": self.num_stages, "layers": [list(r) for r in self.stages]},
            "training": _without_later_defaults(self.training),
            # mirrors are places, like initial peers, not what the swarm trains on (every chunk is pinned by hash)
            "data": {k: v for k, v in _without_later_defaults(self.data).items() if with_peers or k != "mirrors"},
            # a public swarm's manifest does not mention the secret file (its swarm id stays as it was)
            "network": {k: v for k, v in dataclasses.asdict(self.network).items() if k != "secret_file" or v},
            "balancing": _without_later_defaults(self.balancing),
            "averaging": dataclasses.asdict(self.averaging),
        }
        if self.pretrained.path:  # written only when set
            result["pretrained"] = dataclasses.asdict(self.pretrained)
        if with_peers:
            result["initial_peers"] = list(self.initial_peers)
        return result

    @functools.cached_property
    def swarm_id(self) -> str:
        """Hash of the canonical manifest without initial peers: prefixes every DHT key of this swarm."""
        canonical = json.dumps(self.to_dict(with_peers=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def with_initial_peers(self, peers: list[str]) -> Manifest:
        return dataclasses.replace(self, initial_peers=tuple(validate_multiaddrs(peers, "initial_peers")))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


# settings added since issue 16: written out only when they differ from their defaults
LATER_FIELDS = {
    ModelConfig: (
        "architecture",
        "kv_heads",
        "intermediate_size",
        "tie_embeddings",
        "rope_theta",
        "subspace_rank",
        "norm_eps",
    ),
    TrainingConfig: ("precision", "activation_checkpointing", "pipelining"),
    DataConfig: ("index_sha256", "tokenizer", "tokenizer_sha256", "mirrors"),
    BalancingConfig: ("spans", "min_holders"),
}


def _without_later_defaults(section: Any) -> dict[str, Any]:
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    later = LATER_FIELDS[type(section)]
    return {k: v for k, v in dataclasses.asdict(section).items() if k not in later or v != defaults[k]}


def even_stages(depth: int, count: int) -> tuple[tuple[int, int], ...]:
    """Split `depth` layers into `count` contiguous ranges whose sizes differ by at most one."""
    bounds = [round(i * depth / count) for i in range(count + 1)]
    return tuple((bounds[i], bounds[i + 1]) for i in range(count))
