"""swarm-export and examples/generate.py: the assembly of stage parameters into the whole model (pure), a real
export from a 2-stage swarm on loopback, sampling from the file, and the errors."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import ROOT, client_dht, tiny_manifest_dict
from peers.swarm_export import main as export_main
from peers.swarm_export import print_summary
from swarm.architectures.model import build_full_model, build_stage
from swarm.client.export import (
    StageSource,
    assemble_full_state,
    check_output_path,
    export_metadata,
    full_parameter_name,
    stage_parameters,
    write_safetensors,
)
from swarm.client.rpc import download_state
from swarm.dht.records import fetch_announcements
from swarm.errors import ExportError
from swarm.manifests.validation import manifest_from_dict
from swarm.wire.state import stage_state_shapes

GENERATE = ROOT / "examples" / "generate.py"
# seconds a new process may take to start (import torch and hivemind) on a loaded 2-core machine: 20 have been seen
STARTING = 40.0


def three_stage_manifest():
    return manifest_from_dict(
        tiny_manifest_dict(
            model={"vocab_size": 256, "width": 32, "depth": 5, "heads": 2, "context_length": 16, "seed": 7},
            stages={"count": 3, "layers": [[0, 1], [1, 3], [3, 5]]},
        )
    )


def run_tool(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def start_tool(args: list[str]) -> subprocess.Popen:
    """run_tool, started: others can run meanwhile (finish it with finish_tool)."""
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_tool(tool: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = tool.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tool.kill()
        raise
    return subprocess.CompletedProcess(tool.args, tool.returncode, out, err)


def export_command(manifest_path: Path | str, out: Path, *flags: str, script: bool = False) -> list[str]:
    """`python -m peers.swarm_export ...`, or with `script` the installed `swarm-export` (pyproject's entry point)."""
    program = (
        [str(Path(sys.executable).parent / "swarm-export")] if script else [sys.executable, "-m", "peers.swarm_export"]
    )
    return [*program, "--join", str(manifest_path), "--out", str(out), *flags]


# ------------------------------------------------------------------------------------------------- pure


def test_assembled_stages_equal_the_full_model_exactly():
    manifest = three_stage_manifest()
    stages = [build_stage(manifest, s).state_dict() for s in range(manifest.num_stages)]
    full = build_full_model(manifest.model).state_dict()
    assembled = assemble_full_state(manifest, stages)
    assert list(assembled) == list(full)  # the same names, in the same order
    for name, tensor in full.items():
        assert assembled[name].shape == tensor.shape and torch.equal(assembled[name], tensor), name
    assert full_parameter_name(manifest, 1, "blocks.1.mlp.0.weight") == "blocks.2.mlp.0.weight"
    assert full_parameter_name(manifest, 2, "head.lm_head.weight") == "head.lm_head.weight"


def test_assembly_refuses_what_does_not_make_the_model():
    manifest = three_stage_manifest()
    stages = [dict(build_stage(manifest, s).state_dict()) for s in range(manifest.num_stages)]
    with pytest.raises(ExportError, match="2 stages"):
        assemble_full_state(manifest, stages[:2])
    missing = [dict(s) for s in stages]
    del missing[1]["blocks.1.norm1.bias"]
    with pytest.raises(ExportError, match="lacks 1 parameters"):
        assemble_full_state(manifest, missing)
    extra = [dict(s) for s in stages]
    extra[1]["embeddings.tokens.weight"] = stages[0]["embeddings.tokens.weight"]
    with pytest.raises(ExportError, match="does not have"):
        assemble_full_state(manifest, extra)
    wrong = [dict(s) for s in stages]
    wrong[2]["head.norm.weight"] = torch.ones(31)
    with pytest.raises(ExportError, match="expected a float tensor"):
        assemble_full_state(manifest, wrong)
    nan = [dict(s) for s in stages]
    nan[0]["embeddings.positions.weight"] = torch.full_like(stages[0]["embeddings.positions.weight"], float("nan"))
    with pytest.raises(ExportError, match="NaN"):
        assemble_full_state(manifest, nan)


def test_stage_parameters_keep_only_parameters():
    items = [("param/a.weight", torch.ones(2)), ("optim/a.weight/exp_avg", torch.zeros(2)), ("param/b", torch.ones(1))]
    assert list(stage_parameters(items)) == ["a.weight", "b"]


def load_generate():
    """examples/generate.py as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("swarm_generate_example", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_written_file_generates_text_and_bad_files_are_refused(tmp_path, capsys):
    manifest = three_stage_manifest()
    tensors = assemble_full_state(manifest, [build_stage(manifest, s).state_dict() for s in range(3)])
    sources = [StageSource(s, manifest.stages[s], f"peer{s}", 3, 0, 0.0) for s in range(3)]
    path = tmp_path / "model.safetensors"
    size = write_safetensors(path, tensors, export_metadata(manifest, sources))
    assert size == path.stat().st_size and list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["swarm_id"] == manifest.swarm_id and metadata["swarm_name"] == "test-swarm"
    assert json.loads(metadata["model_config"])["depth"] == 5
    assert [s["peer_id"] for s in json.loads(metadata["stages"])] == ["peer0", "peer1", "peer2"]

    print_summary(manifest, sources, tensors, path, size, 1.5, as_json=False)
    summary = capsys.readouterr().out
    assert (
        "peer2" in summary and f"wrote {path}" in summary and f"{sum(t.numel() for t in tensors.values()):,}" in summary
    )

    generate = load_generate()
    # a prompt longer than the context (16) is cropped; the same seed gives the same text
    texts = []
    for _ in range(2):
        assert generate.main(["--model", str(path), "--prompt", "x" * 40, "--tokens", "30", "--seed", "1"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("x" * 40) and len(texts[0]) > 40
    assert generate.main(["--model", str(path), "--temperature", "0", "--tokens", "5", "--top-k", "0"]) == 0
    capsys.readouterr()

    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2)}, str(plain))
    not_safetensors = tmp_path / "junk.safetensors"
    not_safetensors.write_bytes(b"definitely not a model")
    wrong_weights = tmp_path / "wrong.safetensors"
    save_file({"w": torch.ones(2)}, str(wrong_weights), metadata=export_metadata(manifest, sources))
    cases = [
        (plain, "not a Swarm export"),
        (not_safetensors, "not a safetensors file"),
        (wrong_weights, "do not fit the model"),
        (tmp_path / "absent.safetensors", "no such file"),
    ]
    for bad, message in cases:
        assert generate.main(["--model", str(bad)]) == 1
        err = capsys.readouterr().err
        assert message in err and err.startswith("generate.py: error:"), err


def test_output_path_is_checked_before_anything(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        check_output_path(tmp_path / "missing" / "model.safetensors")
    with pytest.raises(ExportError, match="is a folder"):
        check_output_path(tmp_path)


# ----------------------------------------------------------------------------------- errors of the tool


def test_export_errors_are_one_clear_paragraph(tmp_path, write_manifest, capsys, monkeypatch):
    hivemind_logger = logging.getLogger("hivemind")
    monkeypatch.setattr(hivemind_logger, "level", hivemind_logger.level)  # main() quiets hivemind: undo that after
    raw = tiny_manifest_dict()
    raw["initial_peers"] = ["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEKYnHv3sXsjiyHYCaWwTAudbWmyGtnL2RZJUbA9FnEdV"]
    unreachable = write_manifest(raw)
    no_peers = write_manifest(tiny_manifest_dict(), "no-peers.json")
    bad = write_manifest({**tiny_manifest_dict(), "model": {"width": 64}}, "bad.json")
    out = tmp_path / "model.safetensors"
    # these fail before any DHT starts: run in this process
    cases = [
        (export_command(unreachable, tmp_path / "missing" / "m.safetensors"), "does not exist"),
        (export_command(no_peers, out), "lists no initial peers"),
        (export_command(bad, out), "manifest field 'model.depth'"),
        (export_command(tmp_path / "absent.json", out), "does not exist"),
    ]
    for command, message in cases:
        assert export_main(command[command.index("--join") :]) == 1, command
        err = capsys.readouterr().err
        assert message in err and err.startswith("swarm-export: error:") and len(err.strip().splitlines()) == 1, err

    # unreachable initial peers: a real process (it starts a DHT), bounded, no traceback
    begin = time.monotonic()
    result = run_tool(export_command(unreachable, out, "--timeout", "10"), 90)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "no initial peer could be reached" in result.stderr and result.stderr.startswith("swarm-export: error:")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert time.monotonic() - begin < 10 + STARTING  # its timeout, and starting a process on a busy machine
    assert not out.exists()


# ------------------------------------------------------------------------------------- a real swarm


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.mark.integration
@pytest.mark.slow(180)
def test_export_of_a_trained_swarm_matches_its_peers(start_peer, write_manifest, tmp_path):
    from swarm.client.trainer import Trainer

    raw = tiny_manifest_dict(averaging={"mode": "none"})  # no averager processes: the export reads no round
    flags = ("--no-trainer", "--throughput", "100", "--bandwidth", "1000", "--status-every", "1")
    first = start_peer(write_manifest(raw), "--stage", "0", *flags)
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    path = write_manifest(raw, "joined.json")
    last = start_peer(path, "--stage", "1", *flags)
    dht = client_dht(first.maddr())
    out = tmp_path / "model.safetensors"
    try:

        def online() -> list[int]:
            async def count():
                return [
                    sum(a.state == "online" for a in await fetch_announcements(dht, manifest.swarm_id, s))
                    for s in range(manifest.num_stages)
                ]

            return asyncio.run(count())

        wait_until(lambda: online() == [1, 1], 60, "both stages online")
        tokens = np.frombuffer(b"def export(model):\n    return model.state_dict()\n" * 200, dtype=np.uint8)

        async def train() -> None:
            p2p = await dht.replicate_p2p()
            trainer = Trainer(manifest, dht, p2p, str(dht.peer_id), seed=0)
            await trainer.train(tokens, asyncio.Event(), max_samples=8 * 8)  # 8 steps: each stage needs 5
            await p2p.shutdown()

        asyncio.run(train())  # the trainer has stopped: the peers' parameters stay as they are now

        # both exports at once (each loads torch and hivemind and joins the DHT): through the manifest with the
        # installed swarm-export, and through a running peer's multiaddr (checked further down)
        through_peer = tmp_path / "through-peer.safetensors"
        by_manifest = start_tool(export_command(path, out, "--timeout", "60", "--json", script=True))
        by_peer = start_tool(export_command(last.maddr(), through_peer, "--timeout", "60", "--json"))
        try:
            result = finish_tool(by_manifest, 90)
            by_peer_result = finish_tool(by_peer, 90)
        finally:
            for tool in (by_manifest, by_peer):
                if tool.poll() is None:
                    tool.kill()
                    tool.wait()
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["file"] == str(out) and summary["bytes"] == out.stat().st_size
        assert [s["peer_id"] for s in summary["stages"]] == [first.peer_id(), last.peer_id()]
        assert all(s["optimizer_steps"] >= 5 for s in summary["stages"]), summary

        # sampling from the file (a process of its own) while the file is checked against the peers' states
        generate = start_tool([sys.executable, str(GENERATE), "--model", str(out), "--tokens", "30", "--seed", "0"])
        exported = load_file(str(out))
        seed_init = build_full_model(manifest.model).state_dict()
        assert sorted(exported) == sorted(seed_init)  # safetensors stores names sorted
        assert all(exported[n].shape == seed_init[n].shape for n in seed_init)
        assert not torch.equal(exported["blocks.0.mlp.0.weight"], seed_init["blocks.0.mlp.0.weight"])
        assert not torch.equal(exported["head.lm_head.weight"], seed_init["head.lm_head.weight"])

        async def peer_states() -> list[dict[str, torch.Tensor]]:
            p2p = await dht.replicate_p2p()
            try:
                states = []
                for stage, peer in enumerate((first, last)):
                    shapes = stage_state_shapes(manifest, stage)
                    items, _ = await download_state(p2p, peer.peer_id(), manifest, stage, shapes, 30)
                    states.append(stage_parameters(items))
                return states
            finally:
                await p2p.shutdown()

        held = assemble_full_state(manifest, asyncio.run(peer_states()))
        for name, tensor in held.items():
            assert torch.equal(exported[name], tensor), name
        with safe_open(str(out), framework="pt") as f:
            stages = json.loads(f.metadata()["stages"])
        assert [s["peer_id"] for s in stages] == [first.peer_id(), last.peer_id()]

        result = finish_tool(generate, 60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("def ") and len(result.stdout.strip()) > len("def ")

        # through a running peer's multiaddr instead of the manifest: it hands out the manifest, same result
        result = by_peer_result
        assert result.returncode == 0, result.stderr
        again = load_file(str(through_peer))
        assert all(torch.equal(again[name], exported[name]) for name in exported)

        # the last stage's only peer leaves: the export says so, within its timeout, and writes nothing
        last.process.send_signal(signal.SIGTERM)
        last.process.wait(timeout=30)  # its exit status is swarm-peer's business, not this test's
        begin = time.monotonic()
        missing = tmp_path / "missing.safetensors"
        result = run_tool(export_command(path, missing, "--timeout", "15", "--wait", "2"), 90)
        assert result.returncode == 1, result.stdout
        assert "no online peer serves stage 1" in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert time.monotonic() - begin < 15 + STARTING  # its timeout, and starting a process on a busy machine
        assert not missing.exists()
    finally:
        dht.shutdown()
