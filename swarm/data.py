"""Training text: the embedded default corpus (Python's standard library sources) or local text files.

Files are split into a train and a held-out part by a hash of their path, and the train files into shards
the same way, so that every trainer reads only its own shard (different trainers read different data) and no
peer loads more text than it needs. Tokens are bytes (vocabulary 256): no tokenizer, no download.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swarm.errors import DataError

STDLIB = "stdlib"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".toml", ".cfg", ".html", ".js")
MAX_FILE_BYTES = 10_000_000


def list_source_files(source: str) -> tuple[Path, list[Path]]:
    """The root folder and the sorted text files of a data source ("stdlib", a file or a folder)."""
    if source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [f for f in root.rglob("*.py") if "site-packages" not in f.parts and "dist-packages" not in f.parts]
    else:
        path = Path(source).expanduser()
        if path.is_file():
            return path.parent, [path]
        if not path.is_dir():
            raise DataError(f"data source {source!r} is neither 'stdlib', a text file nor a folder")
        root = path
        files = [f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES]
    files = sorted(f for f in files if f.stat().st_size <= MAX_FILE_BYTES)
    if not files:
        raise DataError(f"data source {source!r} has no text files ({', '.join(TEXT_SUFFIXES)})")
    return root, files


def _bucket(path: Path, root: Path, salt: str, buckets: int) -> int:
    name = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
    digest = hashlib.sha256(f"{salt}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % buckets


def split_files(
    source: str, heldout_fraction: float, shard: int | None = None, shards: int = 1
) -> tuple[list[Path], list[Path]]:
    """(train files of one shard, held-out files). shard=None gives all train files."""
    root, files = list_source_files(source)
    if len(files) == 1:
        return files, files  # a single file: its held-out part is taken from its end, see load_tokens
    resolution = 100_000
    heldout = [f for f in files if _bucket(f, root, "heldout", resolution) < heldout_fraction * resolution]
    heldout_set = set(heldout)
    train = [f for f in files if f not in heldout_set]
    if not heldout:
        heldout = [train.pop()]
    if shard is not None:
        shard_files = [f for f in train if _bucket(f, root, "shard", shards) == shard % shards]
        train = shard_files or train  # a tiny corpus may leave a shard empty: read everything then
    return train, heldout


def load_tokens(files: list[Path]) -> np.ndarray:
    """Concatenate files as bytes (uint8 tokens), separated by a newline."""
    chunks = []
    for f in files:
        try:
            chunks.append(f.read_bytes())
        except OSError as e:
            raise DataError(f"cannot read training file {f}: {e}") from None
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    if data.size < 2:
        raise DataError("the training data is empty")
    return data


@dataclass
class TextData:
    """Token stream of a trainer's shard and of the held-out set."""

    train: np.ndarray
    heldout: np.ndarray

    @classmethod
    def load(cls, source: str, heldout_fraction: float = 0.05, shard: int | None = None, shards: int = 1) -> TextData:
        train_files, heldout_files = split_files(source, heldout_fraction, shard, shards)
        if train_files == heldout_files:
            return cls(*_split_tail(load_tokens(train_files), heldout_fraction))
        return cls(train=load_tokens(train_files), heldout=load_tokens(heldout_files))

    @classmethod
    def load_heldout(cls, source: str, heldout_fraction: float = 0.05) -> np.ndarray:
        train_files, heldout_files = split_files(source, heldout_fraction)
        if train_files == heldout_files:
            return _split_tail(load_tokens(train_files), heldout_fraction)[1]
        return load_tokens(heldout_files)


def _split_tail(tokens: np.ndarray, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A corpus of one file: its last `heldout_fraction` is held out."""
    cut = int(len(tokens) * (1 - heldout_fraction))
    return tokens[:cut], tokens[cut:]


def trainer_shard(peer_id: str, shards: int) -> int:
    """The data shard a peer's trainer reads: a hash of its peer id, so that no coordinator assigns shards and a
    restarted peer with the same identity reads the same one."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little") % shards


def sample_batch(
    tokens: np.ndarray, batch_size: int, length: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs [batch, length] and next-byte targets, as int64."""
    if len(tokens) < length + 2:
        raise DataError(f"the data has {len(tokens)} bytes, fewer than one window of {length + 1}")
    starts = rng.integers(0, len(tokens) - length - 1, size=batch_size)
    windows = np.stack([tokens[s : s + length + 1] for s in starts]).astype(np.int64)
    windows = torch.from_numpy(windows)
    return windows[:, :-1], windows[:, 1:]


def heldout_batches(
    tokens: np.ndarray, count: int, batch_size: int, length: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of held-out batches, the same on every call with the same arguments."""
    rng = np.random.default_rng(seed)
    return [sample_batch(tokens, batch_size, length, rng) for _ in range(count)]
