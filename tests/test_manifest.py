"""Manifest validation: every bad field gets an error that names it."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import ROOT, tiny_manifest_dict
from swarm.errors import ManifestError
from swarm.manifests.loading import load_manifest
from swarm.manifests.manifest import Manifest, ModelConfig, even_stages
from swarm.manifests.validation import manifest_from_dict, parse_manifest

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_demo_manifest_loads():
    manifest = load_manifest(ROOT / "examples" / "demo.json")
    assert manifest.num_stages == 2
    assert manifest.stages == ((0, 2), (2, 4))
    assert len(manifest.swarm_id) == 16


def test_swarm_id_ignores_initial_peers_but_not_settings():
    base = manifest_from_dict(tiny_manifest_dict())
    with_peers = manifest_from_dict(tiny_manifest_dict(initial_peers=[PEER]))
    other_lr = manifest_from_dict(tiny_manifest_dict(training={"learning_rate": 0.1}))
    assert base.swarm_id == with_peers.swarm_id
    assert base.swarm_id != other_lr.swarm_id
    # implicit even split and the same ranges written out are the same swarm
    explicit = manifest_from_dict(tiny_manifest_dict(stages={"count": 2, "layers": [[0, 1], [1, 2]]}))
    assert explicit.swarm_id == base.swarm_id


def test_round_trip_through_json():
    manifest = manifest_from_dict(tiny_manifest_dict(initial_peers=[PEER]))
    again = parse_manifest(manifest.to_json())
    assert again == manifest


def test_uneven_stages_allowed():
    raw = tiny_manifest_dict(model={"depth": 5}, stages={"count": 2, "layers": [[0, 4], [4, 5]]})
    manifest = manifest_from_dict(raw)
    assert list(manifest.stage_layers(0)) == [0, 1, 2, 3]
    assert list(manifest.stage_layers(1)) == [4]


def test_even_stages():
    assert even_stages(4, 2) == ((0, 2), (2, 4))
    assert even_stages(5, 3) == ((0, 2), (2, 3), (3, 5))


def _set(raw: dict, dotted: str, value) -> dict:
    raw = copy.deepcopy(raw)
    *parents, last = dotted.split(".")
    target = raw
    for key in parents:
        target = target.setdefault(key, {})
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return raw


class _Delete:
    def __repr__(self) -> str:  # in test ids: the same in every pytest-xdist worker (an object()'s is not)
        return "<deleted>"


_DELETE = _Delete()

BAD_FIELDS = [
    ("name", _DELETE, "name"),
    ("name", "", "name"),
    ("protocol_version", 1, "protocol_version"),
    ("protocol_version", "1", "protocol_version"),
    ("model.width", -3, "model.width"),
    ("model.width", 64.5, "model.width"),
    ("model.depth", 0, "model.depth"),
    ("model.heads", 3, "model.heads"),
    ("model.context_length", True, "model.context_length"),
    ("model.vocab_size", 1, "model.vocab_size"),
    ("model.seed", -1, "model.seed"),
    ("model.colour", "red", "model.colour"),
    ("model", _DELETE, "model"),
    ("stages.count", 0, "stages.count"),
    ("stages.count", 3, "stages.count"),
    ("stages.layers", [[0, 1]], "stages.layers"),
    ("stages.layers", [[0, 1], [2, 2]], "stages.layers[1]"),
    ("stages.layers", [[0, 1], [1, 3]], "stages.layers"),
    ("stages.layers", [[0, 1], "x"], "stages.layers[1]"),
    ("training.microbatch_size", 0, "training.microbatch_size"),
    ("training.microbatches_per_step", "four", "training.microbatches_per_step"),
    ("training.optimizer", "lamb", "training.optimizer"),
    ("training.learning_rate", -1, "training.learning_rate"),
    ("training.learning_rate", float("nan"), "training.learning_rate"),
    ("training.activation_compression", "int3", "training.activation_compression"),
    ("training.max_grad_norm", 0, "training.max_grad_norm"),
    ("training.timeouts", {"forward": 0}, "training.timeouts.forward"),
    ("training.timeouts", {"backwards": 3}, "training.timeouts.backwards"),
    ("data.source", 7, "data.source"),
    ("data.heldout_fraction", 0.9, "data.heldout_fraction"),
    ("data.shards", 0, "data.shards"),
    ("network.announce_period", 0, "network.announce_period"),
    ("network.announce_period", 3600, "network.announce_period"),  # records would outlive the 1 h read limit
    ("balancing", [], "balancing"),
    ("balancing.check_period", 0, "balancing.check_period"),
    ("balancing.min_gain", -0.1, "balancing.min_gain"),
    ("balancing.min_gain", "big", "balancing.min_gain"),
    ("balancing.mingain", 0.1, "balancing.mingain"),
    ("initial_peers", "not-a-list", "initial_peers"),
    (
        "initial_peers",
        ["/ip4/999.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"],
        "initial_peers[0]",
    ),
    ("initial_peers", ["/ip4/127.0.0.1/tcp/1"], "initial_peers[0]"),
    ("initial_peers", ["hello"], "initial_peers[0]"),
    ("initial_peers", [5], "initial_peers[0]"),
    ("surprise", 1, "surprise"),
]


@pytest.mark.parametrize("field,value,named", BAD_FIELDS, ids=[f"{f}={v!r}"[:60] for f, v, _ in BAD_FIELDS])
def test_bad_field_is_named(field, value, named):
    raw = _set(tiny_manifest_dict(), field, value)
    with pytest.raises(ManifestError) as info:
        manifest_from_dict(raw)
    assert f"'{named}'" in str(info.value)


def test_averaging_compression_defaults_to_what_suits_the_mode():
    assert manifest_from_dict(REQUIRED_ONLY).averaging.compression == "4bit"  # diloco, the default mode
    assert manifest_from_dict(tiny_manifest_dict(averaging={"mode": "diloco"})).averaging.compression == "4bit"
    assert manifest_from_dict(tiny_manifest_dict(averaging={"mode": "parameters"})).averaging.compression == "8bit"
    with pytest.raises(ManifestError, match="'averaging.compression': 4bit is for diloco mode"):
        manifest_from_dict(tiny_manifest_dict(averaging={"mode": "parameters", "compression": "4bit"}))
    # a swarm that never averages may keep the 4bit of the diloco manifest it was switched from
    assert (
        manifest_from_dict(tiny_manifest_dict(averaging={"mode": "none", "compression": "4bit"})).averaging.mode
        == "none"
    )


def test_not_json_and_not_an_object(tmp_path):
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest("{nope")
    with pytest.raises(ManifestError, match="JSON object"):
        parse_manifest(json.dumps([1, 2]))
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    big.write_text(" " * 2_000_000)
    with pytest.raises(ManifestError, match="larger"):
        load_manifest(big)


REQUIRED_ONLY = {
    "name": "bare",
    "model": {"width": 64, "depth": 2, "heads": 2, "context_length": 32},
    "stages": {"count": 2},
}


def test_missing_fields_take_exactly_the_dataclass_defaults():
    # a default stated a second time in the validator, and then changed in one place only, would differ here
    manifest = manifest_from_dict(REQUIRED_ONLY)
    expected = Manifest(
        name="bare", model=ModelConfig(width=64, depth=2, heads=2, context_length=32), stages=even_stages(2, 2)
    )
    assert manifest == expected
    assert manifest.swarm_id == expected.swarm_id  # the JSON form too (1 and 1.0 are equal, but hash apart)


@pytest.mark.parametrize(
    "field",
    ["name", "model", "model.width", "model.depth", "model.heads", "model.context_length", "stages", "stages.count"],
)
def test_required_fields_have_no_default(field):
    with pytest.raises(ManifestError, match=f"'{field}': is required but missing"):
        manifest_from_dict(_set(REQUIRED_ONLY, field, _DELETE))
