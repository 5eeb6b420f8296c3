"""Tokenizers: the byte vocabulary (ids 0..255 are the bytes of the UTF-8 text: no file, nothing to agree on) or a
Hugging Face `tokenizer.json` (a byte-level BPE trained here by `train_tokenizer`, or any model's).

A tokenizer is named by the SHA-256 of its `tokenizer.json` bytes: prepared data records the hash it was
tokenized with, so that data and model never silently disagree about what an id means. The file `save` writes is
also what Hugging Face transformers loads (`PreTrainedTokenizerFast(tokenizer_file=...)`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from swarm.errors import TokenizerError
from swarm.files import atomic_write

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
BYTE_VOCAB_SIZE = 256
MAX_VOCAB_SIZE = 1_000_000
ENDOFTEXT = "<|endoftext|>"
# what tokenizers in use call their end-of-document and start-of-document tokens, the most common first
EOS_NAMES = (ENDOFTEXT, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")


class Tokenizer:
    """Text <-> token ids. `hf` is None for the byte vocabulary."""

    def __init__(self, hf: tokenizers.Tokenizer | None = None, json_text: str = "", sha256: str = ""):
        self.hf = hf
        self._json = json_text  # exactly the bytes `sha256` names (what `save` writes)
        self.sha256 = sha256
        self.is_bytes = hf is None
        if hf is None:
            self.vocab_size = BYTE_VOCAB_SIZE
            self.eos_id: int | None = None
            self.bos_id: int | None = None
        else:
            # the largest id + 1: a vocabulary with holes still needs an embedding row for its largest id
            ids = hf.get_vocab().values()
            self.vocab_size = max(hf.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
            self.eos_id = _first_token(hf, EOS_NAMES)
            self.bos_id = _first_token(hf, BOS_NAMES)

    def __repr__(self) -> str:
        if self.is_bytes:
            return "Tokenizer(bytes)"
        return f"Tokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]}...)"

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without any special token added (documents get their end token from the corpus)."""
        if self.hf is None:
            return list(text.encode("utf-8"))
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of many texts at once: tokenizers' Rust batch encoder, on all cores."""
        if self.hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [encoding.ids for encoding in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | Iterable[int]) -> str:
        """The text of `ids`; special tokens are kept, so that decode(encode(text)) == text for any text."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    @property
    def json_text(self) -> str:
        """The tokenizer.json text, exactly the bytes `sha256` names ("" for the byte vocabulary)."""
        return self._json

    def save(self, folder: Path | str) -> Path:
        """Write `folder/tokenizer.json` (the bytes `sha256` names); the byte vocabulary has no file."""
        return self.save_as(Path(folder) / TOKENIZER_FILE)

    def save_as(self, path: Path | str) -> Path:
        """Write the tokenizer.json to `path` (atomically)."""
        if self.hf is None:
            raise TokenizerError("the byte tokenizer has no tokenizer.json to save: it is ids 0..255, the bytes")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, self._json)
        return path


def _first_token(hf: tokenizers.Tokenizer, names: tuple[str, ...]) -> int | None:
    for name in names:
        token_id = hf.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def byte_tokenizer() -> Tokenizer:
    """The byte vocabulary: 256 ids, the bytes of the UTF-8 text."""
    return Tokenizer()


def file_sha256(path: Path | str) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(path: Path | str) -> Tokenizer:
    """A `tokenizer.json` (or the folder holding one), validated: it parses and has 2..1,000,000 ids."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist: give the path of a tokenizer.json")
    try:
        data = path.read_bytes()
        json_text = data.decode("utf-8")
        hf = tokenizers.Tokenizer.from_str(json_text)
    except Exception as e:  # OSError, UnicodeDecodeError, and tokenizers' plain Exceptions
        raise TokenizerError(
            f"tokenizer file {path} is not a valid Hugging Face tokenizer.json ({str(e).splitlines()[0][:200]}); "
            "give a tokenizer.json written by the tokenizers library, or train one with --train-tokenizer"
        ) from None
    tokenizer = Tokenizer(hf, json_text, hashlib.sha256(data).hexdigest())
    if not 2 <= tokenizer.vocab_size <= MAX_VOCAB_SIZE:
        raise TokenizerError(
            f"tokenizer file {path} has {tokenizer.vocab_size} ids; a usable vocabulary has 2 to {MAX_VOCAB_SIZE:,}"
        )
    logger.info("loaded tokenizer %s: %d ids, sha256 %s", path, tokenizer.vocab_size, tokenizer.sha256)
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids trained on `texts`, here (no download): the 256 bytes are its initial
    alphabet, so any text encodes and decodes back exactly; "<|endoftext|>" is its end-of-document token."""
    specials = [ENDOFTEXT]
    smallest = BYTE_VOCAB_SIZE + len(specials) + 1
    if not smallest <= vocab_size <= MAX_VOCAB_SIZE:
        raise TokenizerError(
            f"a BPE vocabulary of {vocab_size} ids is impossible: it needs the 256 bytes, {len(specials)} special "
            f"token(s) and at least one merge, so {smallest} to {MAX_VOCAB_SIZE:,} ids"
        )
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    json_text = hf.to_str(pretty=True)
    tokenizer = Tokenizer(hf, json_text, hashlib.sha256(json_text.encode("utf-8")).hexdigest())
    if tokenizer.vocab_size < vocab_size:
        logger.info("the training text gave %d ids of the %d asked for", tokenizer.vocab_size, vocab_size)
    return tokenizer
