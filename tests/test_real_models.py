"""A real model end to end: swarm-init trains a BPE tokenizer on a folder of text and writes a Llama swarm's
manifest; two peers serve it (the second has neither the tokenizer nor the data prepared: it gets the tokenizer
from the first, and tokenizes the folder itself); its trainer learns; swarm-export --format hf writes a Hugging
Face folder through a peer's address alone (the tokenizer comes from the swarm too); transformers loads it, its
logits equal Swarm's own forward pass of the peers' parameters, and it generates. Then a swarm starts from that
folder with --from-pretrained: its stages load those weights."""

from __future__ import annotations

import asyncio
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import client_dht, tiny_manifest_dict
from peers.swarm_export import main as export_main
from peers.swarm_init import main as init_main
from swarm.architectures.model import build_full_model
from swarm.client.export import assemble_full_state, stage_parameters
from swarm.client.rpc import download_state
from swarm.dataset.tokenizer import load_tokenizer
from swarm.manifests.loading import load_manifest
from swarm.wire.state import stage_state_shapes

transformers = pytest.importorskip("transformers")

MODEL_FLAGS = ["--width", "64", "--depth", "2", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "128"]
PEER_FLAGS = ("--throughput", "100", "--bandwidth", "1000", "--status-every", "1")


def corpus(folder: Path) -> Path:
    """About 600 kB of Python: a few standard-library modules."""
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "dataclasses.py", "inspect.py", "typing.py", "pathlib.py", "textwrap.py"):
        shutil.copy(stdlib / name, folder / name)
    return folder


def small_training(path: Path) -> None:
    """The test swarm's fast settings (tiny microbatches, quick timeouts) over what swarm-init wrote."""
    raw = json.loads(path.read_text())
    test = tiny_manifest_dict()
    raw["training"] |= test["training"] | {"precision": "bfloat16"}
    raw["model"]["context_length"] = 32
    raw["network"], raw["averaging"] = test["network"], {**test["averaging"], "mode": "none"}  # no averagers
    path.write_text(json.dumps(raw))


def peers_parameters(maddr: str, manifest, peer_ids: list[str]) -> list[dict[str, torch.Tensor]]:
    """The parameters of stage s from peer_ids[s], for the stages 0..len(peer_ids) - 1."""
    dht = client_dht(maddr)

    async def download() -> list[dict[str, torch.Tensor]]:
        p2p = await dht.replicate_p2p()
        try:
            states = []
            for stage, peer_id in enumerate(peer_ids):
                shapes = stage_state_shapes(manifest, stage)
                items, _ = await download_state(p2p, peer_id, manifest, stage, shapes, 30)
                states.append(stage_parameters(items))
            return states
        finally:
            await p2p.shutdown()

    try:
        return asyncio.run(download())
    finally:
        dht.shutdown()


@pytest.mark.integration
@pytest.mark.slow(150)
def test_a_llama_swarm_trains_exports_to_transformers_and_restarts_from_it(start_peer, tmp_path, capsys, monkeypatch):
    data = corpus(tmp_path / "corpus")
    path = tmp_path / "lm.json"
    flags = ["--preset", "llama-tiny", "--data", str(data), "--train-tokenizer", "400", *MODEL_FLAGS]
    assert init_main(["lm", *flags, "--out", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer(tmp_path / "lm.tokenizer.json")
    written = json.loads(path.read_text())
    assert written["data"]["tokenizer"] == "lm.tokenizer.json" and tokenizer.vocab_size == 400
    assert written["data"]["tokenizer_sha256"] == tokenizer.sha256 and written["model"]["vocab_size"] == 400
    assert summary["swarm_id"] == load_manifest(path).swarm_id
    small_training(path)

    first = start_peer(path, "--stage", "0", "--no-trainer", *PEER_FLAGS)
    raw = json.loads(path.read_text())
    raw["initial_peers"] = [first.maddr()]
    elsewhere = tmp_path / "elsewhere"  # a manifest without the tokenizer file next to it, and another cache
    elsewhere.mkdir()
    (elsewhere / "lm.json").write_text(json.dumps(raw))
    second = start_peer(elsewhere / "lm.json", "--stage", "1", "--no-trainer", *PEER_FLAGS, cache_dir=tmp_path / "c2")
    trainer = start_peer(elsewhere / "lm.json", "--trainer-only", *PEER_FLAGS, cache_dir=tmp_path / "c3")
    manifest = load_manifest(elsewhere / "lm.json")
    assert not (elsewhere / "lm.tokenizer.json").exists()
    trainer.wait_for_json(lambda j: j.get("trainer_samples", 0) >= 64, 120, "64 samples trained (8 steps)")
    for cache in ("c2", "c3"):  # both got the tokenizer from the swarm
        assert (tmp_path / cache / "tokenizers" / f"{tokenizer.sha256}.json").read_text() == tokenizer.json_text
    assert "training on" in trainer.output() and "Traceback" not in trainer.output(), trainer.tail()
    trainer.stop()  # the parameters stay as they are now: the export and the comparison below see the same ones

    # the export, through the stage-1 peer's address only, from a machine with nothing in its cache
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "export-cache"))
    out = tmp_path / "hf"
    assert export_main(["--join", second.maddr(), "--format", "hf", str(out), "--timeout", "60", "--json"]) == 0
    assert (tmp_path / "export-cache" / "tokenizers" / f"{tokenizer.sha256}.json").is_file()  # from the swarm
    exported = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
        + ["special_tokens_map.json"]
    )
    assert exported["swarm_id"] == manifest.swarm_id

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    text = "def main(argv):\n    parser = argparse.ArgumentParser()\n"
    ids = tokenizer.encode(text)
    assert hf_tokenizer(text)["input_ids"] == ids and hf_tokenizer.decode(ids) == text

    # Swarm's own forward pass of the peers' parameters
    stages = peers_parameters(first.maddr(), manifest, [first.peer_id(), second.peer_id()])
    state = assemble_full_state(manifest, stages)
    ours = build_full_model(manifest.model).eval()
    ours.load_state_dict(state, strict=False)
    tokens = torch.tensor([ids[: manifest.model.context_length]])
    with torch.no_grad():
        difference = (ours(tokens) - model(tokens).logits).abs().max()
    assert float(difference) < 1e-4
    generated = model.generate(tokens[:, :8], max_new_tokens=12, do_sample=False)
    assert generated.shape == (1, 20) and isinstance(hf_tokenizer.decode(generated[0]), str)
    seed_init = build_full_model(manifest.model).state_dict()
    assert not torch.equal(state["blocks.0.mlp.up_proj.weight"], seed_init["blocks.0.mlp.up_proj.weight"])

    # continued pretraining: a new swarm from the exported folder, whose first peers load its weights (the old
    # swarm's peers are gone: killed, as if their machines died, which frees the cores at once)
    first.kill()
    second.kill()
    pretrained = tmp_path / "again.json"
    assert init_main(["again", "--from-pretrained", str(out), "--data", str(data), "--out", str(pretrained)]) == 0
    again = json.loads(pretrained.read_text())
    assert again["model"]["architecture"] == "llama" and again["model"]["kv_heads"] == 2
    assert again["pretrained"]["path"] == "hf" and len(again["pretrained"]["sha256"]) == 64
    assert again["data"]["tokenizer_sha256"] == tokenizer.sha256
    small_training(pretrained)
    restarted = start_peer(pretrained, "--stage", "0", "--no-trainer", *PEER_FLAGS)
    taken = restarted.wait_for_event("state_taken", 60)
    assert taken["source"] == "pretrained", taken
    (loaded,) = peers_parameters(restarted.maddr(), load_manifest(pretrained), [restarted.peer_id()])
    assert loaded.keys() == stages[0].keys()
    assert all(torch.equal(loaded[name], stages[0][name]) for name in loaded)
