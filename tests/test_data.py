"""The embedded corpus: held-out split by file, shards disjoint, batches well-formed."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.dataset.shards import TextData, sample_batch, split_files
from swarm.errors import DataError


def test_stdlib_corpus_is_large_and_split_by_file():
    train, heldout = split_files("stdlib", 0.05)
    assert len(train) > 500 and len(heldout) > 20
    assert not set(train) & set(heldout)
    total = sum(f.stat().st_size for f in train + heldout)
    assert total > 10_000_000  # tens of MB of real text


def test_shards_are_disjoint_and_cover_train():
    all_train, _ = split_files("stdlib", 0.05)
    shards = [set(split_files("stdlib", 0.05, shard=k, shards=4)[0]) for k in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not shards[i] & shards[j]
    assert set().union(*shards) == set(all_train)


def test_local_file_and_folder(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("hello world. " * 1000)
    data = TextData.load(str(text), heldout_fraction=0.1)
    assert len(data.train) > 8 * len(data.heldout) > 0
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(30):
        (folder / f"f{i}.md").write_text(f"document {i} " * 50)
    data = TextData.load(str(folder), heldout_fraction=0.1, shard=1, shards=2)
    assert len(data.train) > 0 and len(data.heldout) > 0
    with pytest.raises(DataError):
        TextData.load(str(tmp_path / "nope"))


def test_batches_are_next_byte_targets():
    tokens = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz" * 10, dtype=np.uint8)
    x, y = sample_batch(tokens, 4, 8, np.random.default_rng(0))
    assert x.shape == y.shape == (4, 8)
    assert (x[:, 1:] == y[:, :-1]).all()
    with pytest.raises(DataError):
        sample_batch(tokens[:5], 1, 8, np.random.default_rng(0))
