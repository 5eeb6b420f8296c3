"""The embedded corpus: large, held-out split by file; a raw source's shards; batches well-formed."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.dataset.documents import RESOLUTION, STDLIB, corpus_files, heldout_bucket
from swarm.dataset.shards import TextData, sample_batch
from swarm.errors import DataError


def test_stdlib_corpus_is_large_and_split_by_file():
    root, files = corpus_files(STDLIB)
    assert len(files) > 500
    assert sum(f.stat().st_size for f in files) > 10_000_000  # tens of MB of real text
    # each file is one document, held out by a hash of its name: about 5% of the files, never all or none
    heldout = [f for f in files if heldout_bucket(f.relative_to(root).as_posix()) < 0.05 * RESOLUTION]
    assert 20 < len(heldout) < 0.1 * len(files)


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
