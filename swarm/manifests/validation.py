"""The manifest's rules: a decoded JSON document becomes a validated Manifest, or a ManifestError that names the
first bad field (its type, range, choices, and the rules between fields). A missing field takes its dataclass
field's default (swarm/manifests/manifest.py); the typed reading of fields is swarm/manifests/fields.py's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from swarm import PROTOCOL_VERSION
from swarm.errors import ManifestError
from swarm.manifests.fields import Fields, shown, validate_multiaddrs
from swarm.manifests.manifest import (
    ACTIVATION_COMPRESSIONS,
    ARCHITECTURES,
    AVERAGING_COMPRESSIONS,
    AVERAGING_MODES,
    OPTIMIZERS,
    PIPELINES,
    PIPELININGS,
    PRECISIONS,
    ROUTINGS,
    AveragingConfig,
    BalancingConfig,
    DataConfig,
    Manifest,
    ModelConfig,
    NetworkConfig,
    PretrainedConfig,
    Timeouts,
    TrainingConfig,
    even_stages,
)


def parse_manifest(text: str, origin: str = "manifest") -> Manifest:
    """Validate a manifest given as JSON text; `origin` names it in the error if the text is not JSON."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, integers of thousands of digits, deep nesting
        raise ManifestError(f"{origin} is not valid JSON: {str(e)[:200] or type(e).__name__}") from None
    return manifest_from_dict(raw)


def manifest_from_dict(raw: Any) -> Manifest:
    """Validate a decoded manifest; raise ManifestError naming the first bad field. A missing field takes its
    dataclass field's default."""
    obj = Fields(raw, "manifest", Manifest)
    version = obj.integer("protocol_version", minimum=1)
    if version != PROTOCOL_VERSION:
        raise ManifestError(
            f"manifest field 'protocol_version': this Swarm speaks protocol {PROTOCOL_VERSION}, the manifest "
            f"asks for {version}; upgrade or downgrade swarm to match the swarm you are joining"
        )
    name = obj.string("name")

    m = obj.section("model", ModelConfig)
    model = ModelConfig(
        architecture=m.choice("architecture", ARCHITECTURES),
        vocab_size=m.integer("vocab_size", minimum=2, maximum=1_000_000),
        width=m.integer("width", minimum=1, maximum=65536),
        depth=m.integer("depth", minimum=1, maximum=1024),
        heads=m.integer("heads", minimum=1, maximum=1024),
        context_length=m.integer("context_length", minimum=1, maximum=1_000_000),
        kv_heads=m.integer("kv_heads", minimum=0, maximum=1024),
        intermediate_size=m.integer("intermediate_size", minimum=0, maximum=1_000_000),
        tie_embeddings=m.boolean("tie_embeddings"),
        rope_theta=m.number("rope_theta", minimum=1.0, maximum=1e9),
        subspace_rank=m.integer("subspace_rank", minimum=0, maximum=65536),
        norm_eps=m.number("norm_eps", minimum=1e-12, maximum=0.1),
        seed=m.integer("seed", minimum=0, maximum=2**63 - 1),
    )
    m.no_unknown()
    _check_model(model)

    stages = _parse_stages(obj.section("stages"), model.depth)
    if model.tie_embeddings and len(stages) > 1:
        raise ManifestError(
            f"manifest field 'model.tie_embeddings': the embeddings (stage 0) and the LM head (stage "
            f"{len(stages) - 1}) are on different peers, so they cannot share one tensor; set it to false (a tied "
            "pretrained model is untied when it is split into stages)"
        )

    t = obj.section("training", TrainingConfig)
    tt = t.section("timeouts", Timeouts)
    timeouts = Timeouts(
        forward=tt.number("forward", minimum=0.1),
        backward=tt.number("backward", minimum=0.1),
        microbatch=tt.number("microbatch", minimum=0.1),
    )
    tt.no_unknown()
    training = TrainingConfig(
        microbatch_size=t.integer("microbatch_size", minimum=1, maximum=65536),
        microbatches_per_step=t.integer("microbatches_per_step", minimum=1, maximum=1_000_000),
        optimizer=t.choice("optimizer", OPTIMIZERS),
        learning_rate=t.number("learning_rate", minimum=0.0, maximum=100.0),
        weight_decay=t.number("weight_decay", minimum=0.0, maximum=100.0),
        # clipping bounds what one (possibly hostile) gradient can do to the weights: it cannot be turned off
        max_grad_norm=t.number("max_grad_norm", minimum=1e-6),
        max_in_flight=t.integer("max_in_flight", minimum=0, maximum=1024),
        adaptive_window=t.boolean("adaptive_window"),
        pipelining=t.choice("pipelining", PIPELININGS),
        delay_scaled_lr=t.boolean("delay_scaled_lr"),
        activation_compression=t.choice("activation_compression", ACTIVATION_COMPRESSIONS),
        precision=t.choice("precision", PRECISIONS),
        activation_checkpointing=t.boolean("activation_checkpointing"),
        pipeline=t.choice("pipeline", PIPELINES),
        routing=t.choice("routing", ROUTINGS),
        timeouts=timeouts,
    )
    t.no_unknown()

    d = obj.section("data", DataConfig)
    data = DataConfig(
        source=d.string("source"),
        heldout_fraction=d.number("heldout_fraction", minimum=0.001, maximum=0.5),
        shards=d.integer("shards", minimum=1, maximum=100_000),
        index_sha256=_sha256(d, "index_sha256"),
        mirrors=_mirrors(d),
        tokenizer=_file_name(d, "tokenizer"),
        tokenizer_sha256=_sha256(d, "tokenizer_sha256"),
    )
    d.no_unknown()
    if data.mirrors and not data.index_sha256:
        raise ManifestError(
            "manifest field 'data.mirrors': mirrors hold a prepared folder, pinned by 'data.index_sha256'; a raw "
            "source has none (prepare it with swarm-data, then swarm-init --data)"
        )
    if bool(data.tokenizer) != bool(data.tokenizer_sha256):
        raise ManifestError(
            "manifest fields 'data.tokenizer' and 'data.tokenizer_sha256': give both (a tokenizer file and its "
            "SHA-256) or neither (bytes); swarm-init --tokenizer writes both"
        )
    if not data.tokenizer and model.vocab_size < 256:
        raise ManifestError(
            f"manifest field 'model.vocab_size': {model.vocab_size} is fewer than the 256 byte values the swarm's "
            "byte vocabulary needs (it names no tokenizer)"
        )

    p = obj.section("pretrained", PretrainedConfig)
    pretrained = PretrainedConfig(path=_file_name(p, "path"), sha256=_sha256(p, "sha256"))
    p.no_unknown()
    if bool(pretrained.path) != bool(pretrained.sha256):
        raise ManifestError(
            "manifest fields 'pretrained.path' and 'pretrained.sha256': give both or neither; swarm-init "
            "--from-pretrained writes both"
        )
    if pretrained.path and model.subspace_rank:
        raise ManifestError(
            "manifest field 'model.subspace_rank': a pretrained model's layers do not write into a subspace, so its "
            "stages cannot send subspace coordinates; set it to 0 to fine-tune a pretrained model"
        )

    n = obj.section("network", NetworkConfig)
    secret_file = n.string("secret_file", empty=True)  # "": a public swarm
    if len(secret_file) > 1024 or not secret_file.isprintable():
        raise ManifestError("network.secret_file: must be a path of at most 1024 printable characters")
    network = NetworkConfig(
        announce_period=n.number("announce_period", minimum=0.2, maximum=600.0),
        secret_file=secret_file,
    )
    n.no_unknown()

    b = obj.section("balancing", BalancingConfig)
    balancing = BalancingConfig(
        check_period=b.number("check_period", minimum=1.0, maximum=86400.0),
        min_gain=b.number("min_gain", minimum=0.0, maximum=10.0),
        spans=b.boolean("spans"),
        min_holders=b.integer("min_holders", minimum=1, maximum=16),
    )
    b.no_unknown()

    a = obj.section("averaging", AveragingConfig)
    mode = a.choice("mode", AVERAGING_MODES)
    compression = a.choice("compression", AVERAGING_COMPRESSIONS) if "compression" in a.raw else None
    if compression is None:  # 4 bits suit diloco's pseudo-gradients, not parameters (swarm/averaging/quantization.py)
        compression = "4bit" if mode == "diloco" else "8bit"
    elif compression == "4bit" and mode == "parameters":  # (mode none never averages: any codec will do)
        raise ManifestError(
            f"{a._name('compression')}: 4bit is for diloco mode (it would cut the parameters themselves into 16 "
            "levels every round); use 8bit with parameters mode"
        )
    averaging = AveragingConfig(
        mode=mode,
        every_samples=a.integer("every_samples", minimum=1, maximum=10**12),
        optimizer_state=a.boolean("optimizer_state"),
        compression=compression,
        outer_learning_rate=a.number("outer_learning_rate", minimum=0.0, maximum=10.0),
        outer_momentum=a.number("outer_momentum", minimum=0.0, maximum=0.999),
        matchmaking_time=a.number("matchmaking_time", minimum=0.5, maximum=600.0),
        timeout=a.number("timeout", minimum=1.0, maximum=3600.0),
    )
    a.no_unknown()

    initial_peers = tuple(validate_multiaddrs(obj.array("initial_peers", "multiaddr strings"), "initial_peers"))
    obj.no_unknown()
    return Manifest(
        name=name,
        model=model,
        stages=stages,
        training=training,
        data=data,
        network=network,
        balancing=balancing,
        averaging=averaging,
        pretrained=pretrained,
        initial_peers=initial_peers,
        protocol_version=version,
    )


def _sha256(fields: Fields, key: str) -> str:
    value = fields.string(key, empty=True)
    if value and not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ManifestError(f"{fields._name(key)}: must be a SHA-256 in 64 lowercase hex digits, got {shown(value)}")
    return value


def _file_name(fields: Fields, key: str) -> str:
    value = fields.string(key, empty=True)
    if len(value) > 1024 or not value.isprintable():
        raise ManifestError(f"{fields._name(key)}: must be a path or URL of at most 1024 printable characters")
    return value


def _check_model(model: ModelConfig) -> None:
    _check_subspace(model)
    if model.width % model.heads != 0:
        raise ManifestError(
            f"manifest field 'model.heads': width {model.width} must be divisible by heads {model.heads}"
        )
    if model.heads % model.key_value_heads != 0:
        raise ManifestError(
            f"manifest field 'model.kv_heads': heads {model.heads} must be a multiple of kv_heads "
            f"{model.key_value_heads} (each key/value head serves a group of query heads)"
        )
    if model.architecture == "gpt" and model.key_value_heads != model.heads:
        raise ManifestError("manifest field 'model.kv_heads': gpt blocks have one key/value head per head; use 0")
    if model.architecture == "llama" and model.head_dim % 2:
        raise ManifestError(
            f"manifest field 'model.heads': rotary embeddings need an even head size, width/heads is {model.head_dim}"
        )


def _check_subspace(model: ModelConfig) -> None:
    rank = model.subspace_rank
    if not rank:
        return
    if model.architecture != "llama":
        raise ManifestError(
            f"manifest field 'model.subspace_rank': subspace stages are built for llama blocks, this model is "
            f"{model.architecture}; set it to 0 or use architecture llama"
        )
    if rank >= model.width:
        raise ManifestError(
            f"manifest field 'model.subspace_rank': {rank} is not smaller than the width {model.width}, so it would "
            f"send more than the hidden states; use a rank below {model.width} (a width/16 or so), or 0 to turn it off"
        )
    if model.tie_embeddings:
        raise ManifestError(
            "manifest field 'model.subspace_rank': a subspace model's embeddings are not a [vocab, width] matrix the "
            "LM head could share; set tie_embeddings to false"
        )


def _parse_stages(s: Fields, depth: int) -> tuple[tuple[int, int], ...]:
    count = s.integer("count", minimum=1, maximum=depth)
    layers = s.get("layers", default=None)  # None: an even split
    s.no_unknown()
    if layers is None:
        return even_stages(depth, count)
    if not isinstance(layers, list) or len(layers) != count:
        raise ManifestError(
            f"manifest field 'stages.layers': must be a list of {count} [start, end) layer ranges, one per stage"
        )
    expected_start = 0
    ranges = []
    for i, item in enumerate(layers):
        where = f"stages.layers[{i}]"
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            raise ManifestError(f"manifest field '{where}': must be a pair of integers [start, end), got {shown(item)}")
        start, end = item
        if start != expected_start:
            raise ManifestError(
                f"manifest field '{where}': stage {i} must start at layer {expected_start} so that stages are "
                f"contiguous, got {start}"
            )
        if end <= start:
            raise ManifestError(f"manifest field '{where}': a stage needs at least one layer, got [{start}, {end})")
        ranges.append((start, end))
        expected_start = end
    if expected_start != depth:
        raise ManifestError(
            f"manifest field 'stages.layers': the stages cover layers [0, {expected_start}) but model.depth is {depth}"
        )
    return tuple(ranges)


def _mirrors(d: Fields) -> tuple[str, ...]:
    """More places with the same prepared folder: at most 16 strings of at most 1,000 characters."""
    values = d.array("mirrors", "URLs or paths")
    if len(values) > 16 or not all(isinstance(v, str) and 0 < len(v.strip()) <= 1000 for v in values):
        raise ManifestError("manifest field 'data.mirrors': must be a list of at most 16 URLs or paths")
    return tuple(values)
