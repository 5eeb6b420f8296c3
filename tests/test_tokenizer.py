"""Tokenizers: the byte vocabulary, a byte-level BPE trained here, loading and hashing tokenizer.json files."""

from __future__ import annotations

import json
import random

import pytest

from swarm.dataset.tokenizer import ENDOFTEXT, byte_tokenizer, file_sha256, load_tokenizer, train_tokenizer
from swarm.errors import TokenizerError

WORDS = "the model trains on many volunteer machines über naïve café 日本語 данные λόγος def return import".split()
SAMPLES = [
    "hello world",
    "Grüße aus Köln: naïve café, 日本語のテキスト, данные, λόγος, emoji 🎉🚀",
    "  leading spaces,\ttabs\r\nand windows line ends\n\n",
    f"text that contains the special token {ENDOFTEXT} in the middle",
    "",
    "\x00\x01 control characters \u200b and a zero-width space",
]


def corpus(documents: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"document {i}: " + " ".join(rng.choice(WORDS) for _ in range(120)) + "\n" for i in range(documents)]


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer(corpus(), 400)


def test_byte_tokenizer_is_the_utf8_bytes():
    tokenizer = byte_tokenizer()
    assert tokenizer.is_bytes and tokenizer.vocab_size == 256 and tokenizer.sha256 == ""
    assert tokenizer.eos_id is None and tokenizer.bos_id is None
    assert tokenizer.encode("aé") == [97, 0xC3, 0xA9]
    assert tokenizer.encode_batch(["a", "é"]) == [[97], [0xC3, 0xA9]]
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    with pytest.raises(TokenizerError):
        tokenizer.save("unused")


def test_trained_bpe_round_trips_any_text_and_compresses(bpe):
    assert not bpe.is_bytes and bpe.vocab_size == 400 and len(bpe.sha256) == 64
    assert bpe.eos_id is not None and bpe.hf.id_to_token(bpe.eos_id) == ENDOFTEXT
    for text in SAMPLES + corpus(5, seed=1):
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    text = corpus(1, seed=2)[0]
    assert len(bpe.encode(text)) < len(text.encode()) / 2  # merges learned: far fewer tokens than bytes
    assert bpe.encode_batch(SAMPLES) == [bpe.encode(text) for text in SAMPLES]
    assert bpe.encode(ENDOFTEXT) == [bpe.eos_id]


def test_vocab_size_must_leave_room_for_merges():
    with pytest.raises(TokenizerError, match="257"):
        train_tokenizer(corpus(10), 257)


def test_save_load_and_hash(bpe, tmp_path):
    path = bpe.save(tmp_path / "tok")
    assert path.name == "tokenizer.json"
    assert file_sha256(path) == bpe.sha256
    loaded = load_tokenizer(path)
    assert loaded.sha256 == bpe.sha256 and loaded.vocab_size == bpe.vocab_size and loaded.eos_id == bpe.eos_id
    assert loaded.encode(SAMPLES[1]) == bpe.encode(SAMPLES[1])
    assert load_tokenizer(tmp_path / "tok").sha256 == bpe.sha256  # the folder holding it
    loaded.save(tmp_path / "again")
    assert file_sha256(tmp_path / "again" / "tokenizer.json") == bpe.sha256  # saved again: the same bytes
    # the same tokenizer written differently is another file: another hash
    path.write_text(json.dumps(json.loads(path.read_text())))
    changed = load_tokenizer(path)
    assert changed.sha256 != bpe.sha256 and changed.sha256 == file_sha256(path)
    assert train_tokenizer(corpus(), 450).sha256 != bpe.sha256


def test_bad_tokenizer_files_are_refused_with_their_path(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(TokenizerError, match="missing.json"):
        load_tokenizer(missing)
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\xfe not json at all")
    with pytest.raises(TokenizerError, match="garbage.json"):
        load_tokenizer(garbage)
    other = tmp_path / "other.json"
    other.write_text('{"model": "no tokenizer"}')
    with pytest.raises(TokenizerError, match="other.json"):
        load_tokenizer(other)


def test_transformers_loads_the_saved_file(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe.save(tmp_path)), eos_token=ENDOFTEXT)
    text = SAMPLES[1]
    assert fast.encode(text) == bpe.encode(text) and fast.decode(fast.encode(text)) == text
    assert fast.eos_token_id == bpe.eos_id
