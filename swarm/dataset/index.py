"""A prepared corpus's index (index.json, written by corpus.py), read and checked before anything trusts it.

The index names every chunk of the corpus: its file (a plain name in the index's folder), its tokens, its byte size
and its SHA-256. Its own SHA-256 is the data's name in the manifest (`data.index_sha256`), so an index from anywhere
(a web server, a bucket, a peer) is used only if its bytes hash to that name, and a chunk only if its bytes hash to
what the index says. An index from the network is hostile until checked: names that would leave the folder
(`../`, absolute paths, URLs), absurd counts and sizes, sizes that disagree with token counts are refused here.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from swarm.errors import DataError

if TYPE_CHECKING:
    from swarm.dataset.tokenizer import Tokenizer
    from swarm.manifests.manifest import Manifest

TRAIN_PREFIX = "chunk"
HELDOUT_PREFIX = "heldout"
MAX_CHUNKS = 65_536  # an index may name at most this many chunks: the DHT's progress bitmaps stay under 8 kB each
MAX_CHUNK_TOKENS = 1 << 28  # 512 MiB of uint16 tokens: far above the default 4 Mi tokens
MAX_INDEX_BYTES = 32 * 1024 * 1024  # 65,536 entries of about 150 bytes each fit 10 MB
_DTYPES = ("uint8", "uint16", "uint32")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Chunk:
    """One chunk of tokens: `number` is its place in its part (train chunks and held-out chunks count apart)."""

    number: int
    file: str
    tokens: int
    size: int  # bytes
    sha256: str
    heldout: bool = False


@dataclass(frozen=True)
class DataIndex:
    """A checked index: what it says, and `sha256`, the hash of its bytes (the data's name)."""

    sha256: str
    raw: bytes  # the index's bytes, as they hash to `sha256` (handed to peers that ask for them)
    dtype: np.dtype
    vocab_size: int
    tokenizer_sha256: str
    chunk_tokens: int
    chunks: tuple[Chunk, ...]  # the train part
    heldout: tuple[Chunk, ...]
    heldout_text_bytes: int  # UTF-8 bytes of the held-out text (for bits per byte)
    source: str = ""
    documents: int = 0
    skipped: int = 0  # records of the source that were no usable document

    @property
    def train_tokens(self) -> int:
        return sum(chunk.tokens for chunk in self.chunks)

    @property
    def train_bytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    def by_sha256(self) -> dict[str, Chunk]:
        return {chunk.sha256: chunk for chunk in (*self.chunks, *self.heldout)}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint8, uint16 or uint32."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def parse_index(raw: bytes, where: str, expected_sha256: str = "") -> DataIndex:
    """The index in `raw` (read from `where`, named in messages), checked; DataError says what is wrong. With
    `expected_sha256`, its bytes must hash to it (the manifest's pin), checked before anything else is read."""
    sha256 = sha256_hex(raw)
    if expected_sha256 and sha256 != expected_sha256:
        raise DataError(
            f"the data index at {where} has hash {sha256[:16]}..., not {expected_sha256[:16]}... as the swarm's "
            "manifest pins: it is other data (prepared differently, or changed since); use the swarm's own copy"
        )

    def bad(what: str) -> DataError:
        return DataError(f"the data index at {where} is invalid ({what}); prepare the data again with swarm-data")

    if len(raw) > MAX_INDEX_BYTES:
        raise bad(f"{len(raw):,} bytes, more than {MAX_INDEX_BYTES:,}")
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(index, dict):
        raise bad("not a JSON object")
    if index.get("format") != 2:
        if index.get("format") == 1:
            raise bad("format 1, written before chunks: prepare it again with this version's swarm-data")
        raise bad(f"format {str(index.get('format'))[:20]!r}, this version reads format 2")
    if index.get("dtype") not in _DTYPES:
        raise bad(f"dtype {str(index.get('dtype'))[:20]!r}")
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    vocab_size = index.get("vocab_size")
    if not _integer(vocab_size, 2, 1 << 32) or token_dtype(vocab_size) != np.dtype(index["dtype"]):
        raise bad(f"vocab_size {str(vocab_size)[:20]} with dtype {index['dtype']}")
    tokenizer_sha256 = index.get("tokenizer_sha256")
    if not isinstance(tokenizer_sha256, str) or not (tokenizer_sha256 == "" or _SHA256.fullmatch(tokenizer_sha256)):
        raise bad("tokenizer_sha256 is not a SHA-256")
    chunk_tokens = index.get("chunk_tokens")
    if not _integer(chunk_tokens, 1, MAX_CHUNK_TOKENS):
        raise bad(f"chunk_tokens {str(chunk_tokens)[:20]}")
    heldout = index.get("heldout")
    if not isinstance(heldout, dict) or not _integer(heldout.get("text_bytes"), 0, 1 << 62):
        raise bad("no heldout object with its text_bytes")
    train_entries, heldout_entries = index.get("chunks"), heldout.get("chunks")
    if not isinstance(train_entries, list) or not isinstance(heldout_entries, list):
        raise bad("no list of chunks")
    if len(train_entries) + len(heldout_entries) > MAX_CHUNKS:
        raise bad(f"{len(train_entries) + len(heldout_entries):,} chunks, more than {MAX_CHUNKS:,}")
    chunks = [_chunk(entry, k, False, dtype, chunk_tokens, bad) for k, entry in enumerate(train_entries)]
    held = [_chunk(entry, k, True, dtype, chunk_tokens, bad) for k, entry in enumerate(heldout_entries)]
    if len({chunk.file for chunk in [*chunks, *held]}) != len(chunks) + len(held):
        raise bad("two chunks with one file name")
    source = index.get("source", "")
    return DataIndex(
        sha256=sha256,
        raw=raw,
        dtype=dtype,
        vocab_size=vocab_size,
        tokenizer_sha256=tokenizer_sha256,
        chunk_tokens=chunk_tokens,
        chunks=tuple(chunks),
        heldout=tuple(held),
        heldout_text_bytes=heldout["text_bytes"],
        source=source[:1000] if isinstance(source, str) else "",
        documents=index.get("documents", 0) if _integer(index.get("documents"), 0, 1 << 62) else 0,
        skipped=index.get("skipped", 0) if _integer(index.get("skipped"), 0, 1 << 62) else 0,
    )


def _integer(value: object, minimum: int, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def _chunk(entry: object, number: int, heldout: bool, dtype: np.dtype, chunk_tokens: int, bad) -> Chunk:
    if not isinstance(entry, dict):
        raise bad("a chunk entry is not an object")
    file, tokens, size, sha256 = entry.get("file"), entry.get("tokens"), entry.get("size"), entry.get("sha256")
    if not isinstance(file, str) or not _FILE_NAME.fullmatch(file) or file == "index.json":
        # no '/', no '..', no URL, no hidden file: a chunk is a plain file next to the index, wherever that is
        raise bad(f"chunk file name {str(file)[:80]!r}: must be a plain file name in the index's folder")
    if not _integer(tokens, 1, chunk_tokens):
        raise bad(f"chunk {file}: {str(tokens)[:20]} tokens (1 to chunk_tokens {chunk_tokens} allowed)")
    if size != tokens * dtype.itemsize:
        raise bad(f"chunk {file}: size {str(size)[:20]} is not {tokens} tokens of {dtype.itemsize} bytes")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise bad(f"chunk {file}: sha256 is not 64 lowercase hex digits")
    return Chunk(number, file, tokens, size, sha256, heldout)


def check_fits(index: DataIndex, manifest: Manifest, tokenizer: Tokenizer | None, where: str) -> None:
    """DataError if the data was tokenized with another tokenizer than the swarm's, or has more ids than the model."""
    config = manifest.data
    expected = tokenizer.sha256 if tokenizer is not None else (config.tokenizer_sha256 if config.tokenizer else "")
    if index.tokenizer_sha256 != expected:

        def name(sha256: str) -> str:
            return f"the tokenizer {sha256[:16]}..." if sha256 else "the byte vocabulary"

        raise DataError(
            f"the data at {where} was tokenized with {name(index.tokenizer_sha256)}, but the swarm uses "
            f"{name(expected)}: prepare it again with the swarm's tokenizer (swarm-data prepare --tokenizer)"
        )
    if index.vocab_size > manifest.model.vocab_size:
        raise DataError(
            f"the data at {where} has {index.vocab_size} token ids, more than the model's vocabulary of "
            f"{manifest.model.vocab_size}"
        )
