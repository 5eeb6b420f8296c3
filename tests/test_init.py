"""swarm-init and the presets: every manifest it writes is valid, and bad settings get clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peers.swarm_init import main as init_main
from swarm.architectures.model import build_stage, count_parameters, count_stage_parameters
from swarm.errors import ManifestError
from swarm.manifests.loading import load_manifest
from swarm.manifests.presets import PRESETS, new_manifest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_makes_a_valid_manifest(preset):
    manifest = new_manifest("x", preset)
    assert manifest.num_stages == PRESETS[preset].stages
    assert manifest.stages[-1][1] == manifest.model.depth


def test_the_1b_preset_has_about_a_billion_parameters():
    total = sum(count_stage_parameters(new_manifest("x", "1b")))
    assert 0.9e9 < total < 1.1e9


def test_counted_parameters_match_built_stages():
    manifest = new_manifest("x", "tiny", stages=3, model={"depth": 5})
    counts = count_stage_parameters(manifest)
    assert counts == [count_parameters(build_stage(manifest, s)) for s in range(3)]


def test_explicit_settings_override_the_preset():
    manifest = new_manifest(
        "x", "small", stages=4, model={"width": 256}, training={"learning_rate": 5e-4}, averaging={"mode": "diloco"}
    )
    assert (manifest.num_stages, manifest.model.width, manifest.model.depth) == (4, 256, 8)
    assert manifest.training.learning_rate == 5e-4 and manifest.averaging.mode == "diloco"
    assert manifest.training.microbatches_per_step == PRESETS["small"].training["microbatches_per_step"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stages": 9}, "9 stages need at least 9 layers"),
        ({"stages": 0}, "stages.count"),
        ({"model": {"heads": 5}}, "divisible by heads 5"),
        ({"training": {"learning_rate": -1.0}}, "training.learning_rate"),
        ({"training": {"optimizer": "lion"}}, "training.optimizer"),
        ({"initial_peers": ["/ip4/1.2.3.4/tcp/5"]}, "no /p2p/"),
    ],
)
def test_bad_settings_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ManifestError, match=message):
        new_manifest("x", "tiny", **kwargs)


def test_swarm_init_writes_a_manifest_that_loads(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert init_main(["my swarm", "--preset", "small", "--stages", "3", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = load_manifest(out)
    assert summary["swarm_id"] == manifest.swarm_id and manifest.name == "my swarm"
    assert [s["layers"] for s in summary["stages"]] == [list(r) for r in manifest.stages]
    assert summary["parameters"] == sum(s["parameters"] for s in summary["stages"])


def test_swarm_init_sets_what_a_user_tunes_in_averaging(tmp_path, capsys):
    out = tmp_path / "s.json"
    flags = ["--averaging-mode", "diloco", "--averaging-every", "8192", "--averaging-compression", "4bit"]
    flags += ["--outer-lr", "0.8", "--outer-momentum", "0.5"]
    assert init_main(["tuned", "--out", str(out), *flags]) == 0
    averaging = load_manifest(out).averaging
    assert (averaging.mode, averaging.every_samples, averaging.compression) == ("diloco", 8192, "4bit")
    assert (averaging.outer_learning_rate, averaging.outer_momentum) == (0.8, 0.5)


def test_swarm_init_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "s.json"
    out.write_text("precious")
    assert init_main(["s", "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert out.read_text() == "precious"
    assert init_main(["s", "--out", str(out), "--force"]) == 0
    assert load_manifest(out).name == "s"


def test_swarm_init_errors_are_one_line_not_tracebacks(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where it would write s.json (in this process: it starts nothing)
    for flags in (["--heads", "5"], ["--stages", "99"], ["--out", str(tmp_path / "no" / "such" / "dir.json")]):
        assert init_main(["s", *flags]) == 2, flags
        stderr = capsys.readouterr().err
        assert stderr.startswith("swarm-init: error:") and "Traceback" not in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1, stderr


def test_examples_gpu_manifest_is_the_1b_preset():
    example = load_manifest(ROOT / "examples" / "gpu-1b.json")
    assert example.to_dict(with_peers=False) == new_manifest(
        example.name, "1b", data_source=example.data.source
    ).to_dict(with_peers=False)
    assert 0.9e9 < sum(count_stage_parameters(example)) < 1.1e9
