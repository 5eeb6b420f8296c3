"""swarm-init's files: a tokenizer given (copied next to the manifest, vocabulary taken from it) or trained here,
prepared data pinned by its index's hash (and refused with another tokenizer), a pretrained Hugging Face Llama
(config, weights' hash, tokenizer, untied when split), and a peer's tokenizer lookup refusing a changed file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from peers.swarm_data import main as data_main
from peers.swarm_init import main as init_main
from swarm.client.rpc import tokenizer_from_peers
from swarm.dataset import tokenizer_source
from swarm.dataset.tokenizer import load_tokenizer, train_tokenizer
from swarm.errors import TokenizerError
from swarm.hf import pretrained
from swarm.manifests.loading import load_manifest

TEXT = "".join(f"def f{i}(x, y={i * 7}):\n    return x * {i} + y  # step {i * i}\n" for i in range(400))


def trained(folder: Path, size: int = 300) -> Path:
    folder.mkdir(exist_ok=True)
    return train_tokenizer([TEXT], size).save(folder)


def test_a_given_tokenizer_is_copied_next_to_the_manifest_and_sets_the_vocabulary(tmp_path, capsys):
    source = trained(tmp_path / "elsewhere")
    out = tmp_path / "swarm" / "s.json"
    out.parent.mkdir()
    assert init_main(["s", "--preset", "llama-tiny", "--tokenizer", str(source), "--out", str(out)]) == 0
    manifest = load_manifest(out)
    assert load_tokenizer(source).vocab_size == 300
    assert manifest.data.tokenizer == "s.tokenizer.json" and manifest.model.vocab_size == 300
    assert (out.parent / "s.tokenizer.json").read_bytes() == source.read_bytes()
    assert tokenizer_source.local_tokenizer(manifest).sha256 == manifest.data.tokenizer_sha256
    capsys.readouterr()
    assert init_main(["t", "--tokenizer", str(source), "--vocab-size", "256", "--out", str(tmp_path / "t.json")]) == 2
    assert "smaller than the tokenizer's 300 ids" in capsys.readouterr().err


def test_a_changed_tokenizer_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    source = trained(tmp_path)
    out = tmp_path / "s.json"
    assert init_main(["s", "--tokenizer", str(source), "--out", str(out), "--json"]) == 0
    source.write_text(source.read_text().replace("<|endoftext|>", "<|endoftexT|>"))
    manifest = load_manifest(out)
    assert tokenizer_source.local_tokenizer(manifest) is None  # not used: the swarm's peers are asked instead
    with pytest.raises(TokenizerError, match="no peer was found"):
        asyncio.run(tokenizer_from_peers(None, manifest, []))


def test_prepared_data_is_pinned_and_must_match_the_tokenizer(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    prepared = tmp_path / "prepared"
    assert data_main(["prepare", str(corpus), "--out", str(prepared), "--train-tokenizer", "300", "--json"]) == 0
    capsys.readouterr()
    out = tmp_path / "s.json"
    assert init_main(["s", "--preset", "llama-tiny", "--data", str(prepared), "--out", str(out), "--json"]) == 0
    manifest = load_manifest(out)  # the prepared folder's tokenizer is taken along
    assert len(manifest.data.index_sha256) == 64 and manifest.model.vocab_size == 300
    assert manifest.data.tokenizer_sha256 == json.loads((prepared / "index.json").read_text())["tokenizer_sha256"]
    other = trained(tmp_path / "other", 320)
    capsys.readouterr()
    assert init_main(["x", "--data", str(prepared), "--tokenizer", str(other), "--out", str(tmp_path / "x.json")]) == 2
    assert "was prepared with the tokenizer" in capsys.readouterr().err


def tiny_hf_llama(folder: Path, tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    train_tokenizer([TEXT], 300).save(folder)


def test_from_pretrained_reads_the_folder_and_loads_each_stage(tmp_path, capsys):
    folder = tmp_path / "tiny-llama"
    tiny_hf_llama(folder, tied=True)
    out = tmp_path / "s.json"
    assert init_main(["s", "--from-pretrained", str(folder), "--stages", "2", "--out", str(out), "--json"]) == 0
    manifest = load_manifest(out)
    model = manifest.model
    assert (model.architecture, model.width, model.depth, model.key_value_heads, model.mlp_width) == (
        "llama",
        32,
        2,
        2,
        64,
    )
    assert not model.tie_embeddings  # two stages cannot share the tensor: the head starts as a copy
    assert manifest.pretrained.sha256 == pretrained.weights_sha256(folder) and manifest.data.tokenizer
    first, last = (pretrained.stage_parameters(manifest, s) for s in (0, 1))
    assert torch.equal(first["embeddings.tokens.weight"], last["head.lm_head.weight"])
    assert "blocks.0.attention.k_proj.weight" in last  # the last stage's first block is the model's layer 1
    capsys.readouterr()
    assert init_main(["s", "--from-pretrained", str(folder), "--width", "64", "--out", str(tmp_path / "w.json")]) == 2
    assert "drop --width" in capsys.readouterr().err
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-4] + b"    ")
    with pytest.raises(Exception, match="pins"):
        pretrained.stage_parameters(manifest, 0)


def test_a_manifest_from_a_url_finds_its_tokenizer_next_to_it(tmp_path, monkeypatch):
    import functools
    import http.server
    import threading

    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    site = tmp_path / "site"
    source = trained(site)
    assert init_main(["s", "--tokenizer", str(source), "--out", str(site / "s.json"), "--json"]) == 0
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/s.json"
        manifest = load_manifest(url)
        assert manifest.origin == url
        assert tokenizer_source.local_tokenizer(manifest).sha256 == manifest.data.tokenizer_sha256
        assert tokenizer_source.cached_path(manifest.data.tokenizer_sha256).is_file()  # kept, to hand out
        tokenizer_source.cached_path(manifest.data.tokenizer_sha256).unlink()
        (site / manifest.data.tokenizer).write_text("{}")  # the site now serves another file: not used
        assert tokenizer_source.local_tokenizer(manifest) is None
    finally:
        server.shutdown()
        server.server_close()


def test_a_manifest_from_a_url_or_a_peer_cannot_make_a_peer_read_its_files(tmp_path, monkeypatch):
    import dataclasses

    from swarm.errors import ManifestError

    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    source = trained(tmp_path / "site")
    out = tmp_path / "site" / "s.json"
    assert init_main(["s", "--tokenizer", str(source), "--out", str(out), "--json"]) == 0
    manifest = load_manifest(out)
    secret = str(source.resolve())  # a file that has the pinned hash: read only when the manifest is the user's own
    for origin, name in (("", secret), ("http://127.0.0.1:9/s.json", "file://" + secret), ("", "../site/x")):
        hostile = dataclasses.replace(manifest, origin=origin, data=dataclasses.replace(manifest.data, tokenizer=name))
        assert tokenizer_source.local_tokenizer(hostile) is None, (origin, name)
    mine = dataclasses.replace(
        manifest, origin=str(tmp_path), data=dataclasses.replace(manifest.data, tokenizer=secret)
    )
    assert tokenizer_source.local_tokenizer(mine) is not None  # a local manifest may name any file
    from_url = dataclasses.replace(
        manifest, origin="http://127.0.0.1:9/s.json", pretrained=type(manifest.pretrained)("/etc", "0" * 64)
    )
    with pytest.raises(ManifestError, match="only a folder under the current one"):
        pretrained.pretrained_folder(from_url)


def test_a_tokenizer_file_without_a_vocabulary_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    empty = tmp_path / "tokenizer.json"
    empty.write_text(HFTokenizer(models.BPE(vocab={}, merges=[])).to_str())
    with pytest.raises(TokenizerError, match="has 0 ids"):
        load_tokenizer(empty)
