"""Data preparation and reading: corpora -> token shards (folders, JSON lines, parquet), the index and its hash,
memory-mapped reading, the trainers' walk over the shards, the cache of raw sources, and swarm-data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from conftest import tiny_manifest_dict
from peers.swarm_data import main
from swarm.dataset.corpus import default_cache_dir, ensure_prepared, index_sha256, prepare_corpus
from swarm.dataset.documents import heldout_bucket
from swarm.dataset.shards import (
    TextData,
    TokenShards,
    TrainingStream,
    bits_per_byte,
    heldout_batches,
    open_swarm_data,
    sample_batch,
)
from swarm.dataset.tokenizer import ENDOFTEXT, byte_tokenizer, train_tokenizer
from swarm.errors import DataError
from swarm.manifests.validation import manifest_from_dict

WORDS = "swarm peer stage trainer shard token über naïve 日本語 данные def return import class".split()


def document(i: int, words: int = 60) -> str:
    rng = random.Random(i)
    return f"document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"


def write_folder(folder, count: int = 60, words: int = 60):
    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(count):
        name = f"sub{i % 3}/doc{i:03d}.txt"
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(document(i, words), encoding="utf-8")
        texts[name] = document(i, words)
    return texts


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer([document(i) for i in range(400)], 500)


@pytest.fixture
def folder(tmp_path):
    texts = write_folder(tmp_path / "corpus")
    return tmp_path / "corpus", texts


def split_documents(tokens: np.ndarray, bpe) -> list[str]:
    """The documents of a token stream that ends every document with the end-of-text token."""
    ends = np.flatnonzero(tokens == bpe.eos_id)
    return [bpe.decode(part[:-1]) for part in np.split(np.asarray(tokens), ends + 1) if len(part)]


def test_prepare_a_folder_of_byte_tokens(folder, tmp_path):
    source, texts = folder
    seen = []
    index_path = prepare_corpus(
        str(source), tmp_path / "out", byte_tokenizer(), 1000, on_progress=lambda *p: seen.append(p)
    )
    index = json.loads(index_path.read_text())
    total = sum(f.stat().st_size for f in source.rglob("*.txt"))
    assert seen[-1] == (total, total) and all(a[0] <= b[0] for a, b in zip(seen, seen[1:])) and len(seen) > 2
    assert index["format"] == 2 and index["dtype"] == "uint8" and index["vocab_size"] == 256
    assert index["documents"] == len(texts) and index["skipped"] == 0 and index["tokenizer_sha256"] == ""
    every = sum(len(t.encode()) + 1 for t in texts.values())  # each document, then a newline
    train = sum(s["tokens"] for s in index["chunks"])
    assert train + sum(c["tokens"] for c in index["heldout"]["chunks"]) == every
    assert len(index["chunks"]) == -(-train // 1000) and all(s["tokens"] == 1000 for s in index["chunks"][:-1])
    heldout = [name for name in texts if heldout_bucket(name) < 0.05 * 100_000]
    assert index["heldout"]["text_bytes"] == sum(len(texts[name].encode()) for name in heldout) > 0
    for entry in index["chunks"] + index["heldout"]["chunks"]:
        assert (tmp_path / "out" / entry["file"]).stat().st_size == entry["tokens"] == entry["size"]
    assert not [f for f in (tmp_path / "out").iterdir() if f.name.endswith(".tmp")]
    prepare_corpus(str(source), tmp_path / "out", byte_tokenizer(), chunk_tokens=10**6)  # again, one chunk now
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == [
        "chunk-00000.bin",
        "heldout-00000.bin",
        "index.json",
    ]


def test_bpe_split_is_by_document_name_and_disjoint(folder, tmp_path, bpe):
    source, texts = folder
    data = TokenShards.open(prepare_corpus(str(source), tmp_path / "out", bpe, chunk_tokens=700))
    assert data.dtype == np.dtype("<u2") and data.vocab_size == 500 and data.tokenizer_sha256 == bpe.sha256
    train = split_documents(np.concatenate(data.train), bpe)
    heldout = split_documents(data.heldout, bpe)
    expected = {texts[name] for name in texts if heldout_bucket(name) < 0.05 * 100_000}
    assert set(heldout) == expected and len(heldout) == len(expected) > 0
    assert set(train) == set(texts.values()) - expected and not set(train) & set(heldout)
    assert data.heldout_bytes == sum(len(t.encode()) for t in heldout)
    # the same files written again in another order (other times, other inode order): the same index, byte for byte
    again = tmp_path / "again"
    for name in reversed(list(texts)):
        (again / name).parent.mkdir(parents=True, exist_ok=True)
        (again / name).write_text(texts[name], encoding="utf-8")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # the index records the source as given: "corpus" both times
        first = prepare_corpus("corpus", tmp_path / "one", bpe, chunk_tokens=700)
        os.rename("corpus", "first")
        os.rename("again", "corpus")
        second = prepare_corpus("corpus", tmp_path / "two", bpe, chunk_tokens=700)
    finally:
        os.chdir(cwd)
    assert first.read_bytes() == second.read_bytes() and index_sha256(first) == index_sha256(second)


def test_single_document_holds_out_its_end(tmp_path, bpe):
    text = "".join(document(i) for i in range(40))
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    data = TokenShards.open(prepare_corpus(str(tmp_path / "book.txt"), tmp_path / "out", bpe, heldout_fraction=0.1))
    assert data.index.documents == 1
    train, heldout = bpe.decode(np.concatenate(data.train)), bpe.decode(data.heldout)
    cut = int(len(text) * 0.9)
    assert train == text[:cut] + ENDOFTEXT and heldout == text[cut:] + ENDOFTEXT


def test_two_documents_never_leave_a_part_empty(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("first document " * 20)
    (tmp_path / "c" / "b.txt").write_text("second document " * 20)
    for fraction in (0.001, 0.5):
        data = TokenShards.open(
            prepare_corpus(str(tmp_path / "c"), tmp_path / "out", byte_tokenizer(), 10**6, fraction)
        )
        assert data.total_train_tokens > 0 and len(data.heldout) > 0
        assert data.total_train_tokens + len(data.heldout) == 2 * (20 * 15 + 1) + 20


def test_jsonl_skips_and_counts_bad_lines(tmp_path, bpe):
    lines = [json.dumps({"text": document(i)}) for i in range(30)]
    lines += ["{not json", json.dumps({"body": "no text key"}), json.dumps(["not", "an object"]), "", "\xff"]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = TokenShards.open(prepare_corpus(str(path), tmp_path / "out", bpe))
    assert data.index.documents == 30 and data.index.skipped == 4  # the empty line is no document
    everything = split_documents(np.concatenate([*data.train, data.heldout]), bpe)
    assert sorted(everything) == sorted(document(i) for i in range(30))
    keyed = tmp_path / "keyed.jsonl"
    keyed.write_text("\n".join(json.dumps({"content": document(i)}) for i in range(5)))
    assert json.loads(prepare_corpus(str(keyed), tmp_path / "k", bpe, text_key="content").read_text())["documents"] == 5
    with pytest.raises(DataError, match="keyed.jsonl has no usable line"):
        prepare_corpus(str(keyed), tmp_path / "k2", bpe)


def test_parquet_rows_are_documents(tmp_path, bpe):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "mixed"
    folder.mkdir()
    texts = [document(i) for i in range(25)]
    pq.write_table(pa.table({"text": [*texts, None], "id": list(range(26))}), folder / "rows.parquet")
    (folder / "notes.md").write_text(document(99), encoding="utf-8")
    data = TokenShards.open(prepare_corpus(str(folder), tmp_path / "out", bpe))
    assert data.index.documents == 26 and data.index.skipped == 1
    everything = split_documents(np.concatenate([*data.train, data.heldout]), bpe)
    assert sorted(everything) == sorted([*texts, document(99)])
    with pytest.raises(DataError, match="no column 'body'.*text, id"):
        prepare_corpus(str(folder / "rows.parquet"), tmp_path / "o2", bpe, text_key="body")


def test_shards_are_memory_mapped_and_checked(folder, tmp_path):
    source, _ = folder
    index = prepare_corpus(str(source), tmp_path / "out", byte_tokenizer(), chunk_tokens=1500)
    data = TokenShards.open(index, expected_sha256=index_sha256(index), verify=True)
    assert all(isinstance(chunk, np.memmap) for chunk in data.train) and len(data.index.heldout) > 1
    assert data.total_train_tokens == sum(len(s) for s in data.train) > 0
    x, y = sample_batch(data.train[0], 4, 16, np.random.default_rng(0))
    assert x.shape == (4, 16) and (x[:, 1:] == y[:, :-1]).all()
    assert len(heldout_batches(data.heldout, 3, 2, 16)) == 3
    with pytest.raises(DataError, match="prepared differently"):
        TokenShards.open(index, expected_sha256="0" * 64)
    shard = tmp_path / "out" / "chunk-00001.bin"
    content = bytearray(shard.read_bytes())
    content[10] ^= 0xFF
    shard.write_bytes(bytes(content))
    TokenShards.open(index)  # the same size: found only by hashing
    with pytest.raises(DataError, match="chunk-00001.bin does not have the SHA-256"):
        TokenShards.open(index, verify=True)
    shard.write_bytes(bytes(content[:-1]))
    with pytest.raises(DataError, match="chunk-00001.bin should have 1500 bytes"):
        TokenShards.open(index)
    (tmp_path / "out" / "index.json").write_text('{"format": 7}')
    with pytest.raises(DataError, match="format '7'"):
        TokenShards.open(tmp_path / "out")


def test_training_stream_walks_every_shard_in_its_own_order(folder, tmp_path, bpe):
    source, _ = folder
    data = TokenShards.open(prepare_corpus(str(source), tmp_path / "out", bpe, chunk_tokens=400))
    assert len(data.train) >= 8
    length, window = 31, 32
    usable = {k for k, shard in enumerate(data.train) if len(shard) >= window}
    stream = TrainingStream(data, "peer-a")
    starts: dict[int, list[int]] = {}
    while stream.epoch == 0:
        for shard, start in stream.next_windows(1, length):
            if stream.epoch == 0:
                starts.setdefault(shard, []).append(start)
    assert set(starts) == usable  # every usable shard in one epoch, each once, all its windows
    for shard, found in starts.items():
        found.sort()
        assert len(found) == len(data.train[shard]) // window
        assert all(b - a >= window for a, b in zip(found, found[1:]))  # no overlap
        assert found[-1] + window <= len(data.train[shard])
    first = [TrainingStream(data, "peer-a").next_windows(50, length) for _ in range(2)]
    assert first[0] == first[1]  # a restarted trainer starts the same walk
    assert TrainingStream(data, "peer-a").order != TrainingStream(data, "peer-b").order
    x, y = TrainingStream(data, "peer-c").next_batch(8, length)
    assert x.shape == y.shape == (8, length) and x.dtype == y.dtype == torch.int64
    assert (x[:, 1:] == y[:, :-1]).all() and int(x.max()) < data.vocab_size and int(x.min()) >= 0
    with pytest.raises(DataError, match="one window needs 100001"):
        TrainingStream(data, "peer-a").next_batch(1, 100_000)


def test_ensure_prepared_reuses_its_cache_and_survives_a_race(folder, tmp_path):
    source, texts = folder
    cache = tmp_path / "cache"
    results, errors = [], []
    barrier = threading.Barrier(3)

    def prepare():
        barrier.wait()
        try:
            results.append(ensure_prepared(str(source), byte_tokenizer(), cache, chunks=4, heldout_fraction=0.1))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=prepare) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    folders = [p for p in cache.iterdir() if p.is_dir()]
    assert folders == [results[0].parent]  # one cache, no temporary folder left
    data = TokenShards.open(results[0], verify=True)
    assert len(data.train) == 4 and len({len(s) for s in data.train[:-1]}) == 1
    written = results[0].stat().st_mtime_ns
    assert ensure_prepared(str(source), byte_tokenizer(), cache, chunks=4, heldout_fraction=0.1) == results[0]
    assert results[0].stat().st_mtime_ns == written  # reused, not prepared again
    (source / "new.txt").write_text("a new document")
    assert ensure_prepared(str(source), byte_tokenizer(), cache, chunks=4, heldout_fraction=0.1) != results[0]
    # the older interface: a trainer's shard of a raw source, and the held-out part
    loaded = TextData.load(str(source), 0.1, shard=5, shards=4)
    assert isinstance(loaded.train, np.memmap) and len(loaded.train) > 0 and len(loaded.heldout) > 0


def test_open_swarm_data_checks_the_manifest_pins(folder, tmp_path, bpe):
    source, _ = folder
    prepared = prepare_corpus(str(source), tmp_path / "prepared", byte_tokenizer(), chunk_tokens=1000)

    def manifest(**data):
        return manifest_from_dict(tiny_manifest_dict(data={"source": str(tmp_path / "prepared"), **data}))

    data = open_swarm_data(manifest(index_sha256=index_sha256(prepared)), byte_tokenizer())
    assert data.sha256 == index_sha256(prepared) and len(data.train) == len(json.loads(prepared.read_text())["chunks"])
    with pytest.raises(DataError, match="prepared differently"):
        open_swarm_data(manifest(index_sha256="f" * 64), byte_tokenizer())
    assert open_swarm_data(manifest(index_sha256="f" * 64), byte_tokenizer(), str(prepared)).sha256  # a peer's own
    prepare_corpus(str(source), tmp_path / "bpe", bpe)
    with pytest.raises(DataError, match="tokenized with the tokenizer"):
        open_swarm_data(manifest(source=str(tmp_path / "bpe")), byte_tokenizer())
    raw = open_swarm_data(manifest(source=str(source), shards=3), byte_tokenizer())  # prepared into the cache
    assert len(raw.train) == 3 and raw.folder.parent == default_cache_dir()


def test_bits_per_byte():
    assert bits_per_byte(np.log(2), 100, 100) == pytest.approx(1.0)
    assert bits_per_byte(np.log(2), 100, 400) == pytest.approx(0.25)  # 4 bytes a token
    assert bits_per_byte(2.0, 10, 30) == pytest.approx(2.0 * 10 / 30 / np.log(2))
    with pytest.raises(DataError):
        bits_per_byte(1.0, 10, 0)


def test_swarm_data_prepare_and_inspect(folder, tmp_path, capsys):
    source, texts = folder
    out = tmp_path / "prepared"
    assert main(["prepare", str(source), "--out", str(out), "--train-tokenizer", "300", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["vocab_size"] == 300 and summary["tokenizer_file"] == str(out / "tokenizer.json")
    assert summary["index_sha256"] == index_sha256(out / "index.json") and summary["seconds"] >= 0
    assert summary["train_tokens"] + summary["heldout_tokens"] > 0 and summary["documents"] == len(texts)
    assert main(["inspect", str(out), "--verify", "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["index_sha256"] == summary["index_sha256"]
    assert inspected["tokenizer_sha256"] == summary["tokenizer_sha256"] != ""
    tokenized = tmp_path / "with-file"
    assert main(["prepare", str(source), "--out", str(tokenized), "--tokenizer", str(out / "tokenizer.json")]) == 0
    shown = capsys.readouterr().out
    assert "index sha256" in shown and index_sha256(tokenized) in shown.replace("\n", "").replace("│", "").replace(
        " ", ""
    )
    assert main(["inspect", str(tokenized)]) == 0 and "300 ids" in capsys.readouterr().out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["prepare", "{tmp}/nope", "--out", "{tmp}/o"], "neither 'stdlib', a file nor a folder"),
        (["prepare", "stdlib", "--out", "{tmp}/o", "--tokenizer", "{tmp}/bad.json"], "bad.json"),
        (["prepare", "{tmp}/bad.jsonl", "--out", "{tmp}/o"], "no usable line"),
        (["inspect", "{tmp}"], "index.json"),
    ],
)
def test_swarm_data_errors_are_one_line(tmp_path, capsys, arguments, message):
    (tmp_path / "bad.json").write_text("{]")
    (tmp_path / "bad.jsonl").write_text("{]\n[]\n")
    assert main([a.format(tmp=tmp_path) for a in arguments]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.startswith("swarm-data: error: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err and captured.out == ""


def test_swarm_data_runs_as_a_program(folder, tmp_path):
    source, texts = folder
    command = [sys.executable, "-m", "peers.swarm_data", "prepare", str(source), "--out", str(tmp_path / "o"), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["documents"] == len(texts) and summary["vocab_size"] == 256
    assert summary["index_sha256"] == index_sha256(tmp_path / "o")
    shown = subprocess.run(
        [sys.executable, "-m", "peers.swarm_data", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "examples:" in shown.stdout and "swarm-data prepare" in shown.stdout
