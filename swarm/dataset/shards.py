"""Training data: prepared token shards (corpus.py writes them), read memory-mapped, never loaded whole.

`TokenShards` opens a prepared folder's index and checks it (the files, their sizes, and on request their hashes
and the index's own hash, the name the swarm's manifest gives its data). `TrainingStream` is what a trainer reads:
every train shard in an order of its own, seeded by its peer id (so different trainers read different data at
any moment, and a restarted one starts the same order again), each shard in non-overlapping windows in a random
order, epoch after epoch. `heldout_batches` gives the fixed held-out batches that loss is reported on.
`open_swarm_data` is what a peer opens: the manifest's data, checked against its pins (the index's hash, the
tokenizer's).

`TextData` is the older interface (a raw source, byte tokens, one shard per trainer), kept for the demo, the
benchmarks and the tests: raw sources are prepared once into the cache by `ensure_prepared`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from swarm.dataset.corpus import INDEX_FILE, ensure_prepared
from swarm.dataset.documents import STDLIB
from swarm.dataset.index import DataIndex, check_fits, parse_index
from swarm.dataset.tokenizer import Tokenizer, byte_tokenizer, file_sha256
from swarm.errors import DataError

if TYPE_CHECKING:
    from swarm.manifests.manifest import Manifest

# ------------------------------------------------------------------------------------------------ prepared shards


def _open_tokens(path: Path, dtype: np.dtype, tokens: int) -> np.ndarray:
    if tokens == 0:
        return np.zeros(0, dtype=dtype)  # mmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


class TokenShards:
    """A prepared folder whose chunks are all on this machine: its train chunks and held-out part as read-only
    memmaps, and its index. (A volunteer's trainer reads chunks it fetches as it goes: swarm/dataset/stream.py.)"""

    def __init__(self, folder: Path, index: DataIndex):
        self.folder = folder
        self.index = index
        self.sha256 = index.sha256
        self.vocab_size: int = index.vocab_size
        self.tokenizer_sha256: str = index.tokenizer_sha256
        self.dtype = index.dtype
        self.train: list[np.ndarray] = [_open_tokens(folder / c.file, self.dtype, c.tokens) for c in index.chunks]
        heldout = [_open_tokens(folder / c.file, self.dtype, c.tokens) for c in index.heldout]
        self.heldout: np.ndarray = (
            heldout[0] if len(heldout) == 1 else np.concatenate(heldout or [np.zeros(0, self.dtype)])
        )
        self.heldout_bytes: int = index.heldout_text_bytes
        self.total_train_tokens = sum(len(chunk) for chunk in self.train)

    @classmethod
    def open(cls, index_path: Path | str, expected_sha256: str = "", verify: bool = False) -> TokenShards:
        """Open a prepared folder (or its index.json). expected_sha256: the index's hash must be this one.
        verify: also hash every chunk against the index (reads them all: slow on a large corpus)."""
        path = Path(index_path).expanduser()
        if path.is_dir():
            path = path / INDEX_FILE
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(
                f"cannot read the data index {path}: {e.strerror}; prepare the data with swarm-data"
            ) from None
        index = parse_index(raw, str(path), expected_sha256)
        for chunk in (*index.chunks, *index.heldout):
            file = path.parent / chunk.file
            size = file.stat().st_size if file.is_file() else None
            if size != chunk.size:
                found = "it is missing" if size is None else f"it has {size}"
                raise DataError(
                    f"data file {file} should have {chunk.size} bytes ({chunk.tokens} tokens) but {found}: the "
                    "prepared folder is incomplete or was changed; prepare it again"
                )
            if verify and file_sha256(file) != chunk.sha256:
                raise DataError(
                    f"data file {file} does not have the SHA-256 its index states: it was changed or damaged; "
                    "prepare the data again"
                )
        return cls(path.parent, index)


class TrainingStream:
    """A trainer's walk over the train shards: a permutation of the shards seeded by its peer id; each shard in
    non-overlapping windows (from a random offset) in a random order; then the next shard; after the last, a new
    permutation (an epoch). Shards smaller than one window are skipped."""

    def __init__(self, shards: TokenShards, peer_id: str, seed: int = 0):
        self.shards = shards
        digest = hashlib.sha256(f"{seed}/{peer_id}".encode()).digest()
        self.rng = np.random.default_rng(int.from_bytes(digest[:16], "little"))
        self.epoch = 0
        self.order: list[int] = [int(k) for k in self.rng.permutation(len(shards.train))]
        self.shard_position = -1  # index into `order` of the shard being read
        self._starts: np.ndarray = np.zeros(0, dtype=np.int64)
        self._next = 0
        self._window = 0

    @property
    def shard(self) -> int:
        """The train shard being read (an index into shards.train); -1 before the first batch."""
        return self.order[self.shard_position] if self.shard_position >= 0 else -1

    def _cut(self, window: int) -> bool:
        """The current shard's windows, in a random order; False if it is smaller than one window."""
        tokens = len(self.shards.train[self.shard])
        if tokens < window:
            return False
        count = tokens // window
        offset = int(self.rng.integers(0, tokens - count * window + 1))
        self._starts = offset + self.rng.permutation(count) * window
        self._next = 0
        self._window = window
        return True

    def _next_shard(self, window: int) -> None:
        if not any(len(shard) >= window for shard in self.shards.train):
            largest = max((len(shard) for shard in self.shards.train), default=0)
            raise DataError(
                f"the training data has {self.shards.total_train_tokens} tokens in {len(self.shards.train)} shards "
                f"(the largest {largest}), and one window needs {window} (context length + 1): prepare more data, "
                "or fewer, larger shards"
            )
        while True:
            self.shard_position += 1
            if self.shard_position == len(self.order):  # every shard read: a new epoch, a new order
                self.epoch += 1
                self.order = [int(k) for k in self.rng.permutation(len(self.shards.train))]
                self.shard_position = 0
            if self._cut(window):
                return

    def next_windows(self, count: int, length: int) -> list[tuple[int, int]]:
        """The next `count` windows of length + 1 tokens, as (train shard, start)."""
        window = length + 1
        if window != self._window and (self.shard_position < 0 or not self._cut(window)):
            self._next_shard(window)  # the first batch, or a new length the current shard is too small for
        windows = []
        while len(windows) < count:
            if self._next == len(self._starts):
                self._next_shard(window)
            windows.append((self.shard, int(self._starts[self._next])))
            self._next += 1
        return windows

    def next_batch(self, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs [batch_size, length] and their next-token targets, as int64."""
        windows = [
            self.shards.train[k][start : start + length + 1] for k, start in self.next_windows(batch_size, length)
        ]
        tokens = torch.from_numpy(np.stack(windows).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]


def prepared_index(source: str) -> Path | None:
    """The index.json of a folder that `swarm-data prepare` wrote (or the index itself); None for raw sources."""
    if source == STDLIB:
        return None
    path = Path(source).expanduser()
    if path.name == INDEX_FILE and path.is_file():
        return path
    return path / INDEX_FILE if (path / INDEX_FILE).is_file() else None


def open_swarm_data(manifest: Manifest, tokenizer: Tokenizer | None, source: str | None = None) -> TokenShards:
    """What a peer's trainer reads: the manifest's data source, or `source` (the peer's own data instead). A
    prepared folder is opened as it is (the manifest's is checked against `data.index_sha256`); a raw source is
    prepared once into the cache with the swarm's tokenizer, in `data.shards` shards. Either way the data must be
    tokenized with the swarm's tokenizer and fit the model's vocabulary."""
    config = manifest.data
    own = source is not None
    source = source if own else config.source
    index = prepared_index(source)
    if index is not None:
        data = TokenShards.open(index, expected_sha256="" if own else config.index_sha256)
    elif tokenizer is None:
        raise DataError(
            f"data source {source!r} is raw text, and this peer does not have the swarm's tokenizer to tokenize it"
        )
    else:
        data = TokenShards.open(ensure_prepared(source, tokenizer, None, config.shards, config.heldout_fraction))
    check_fits(data.index, manifest, tokenizer, str(data.folder))
    return data


def bits_per_byte(loss_per_token: float, tokens: int, bytes_: int) -> float:
    """A mean loss in nats per token over `tokens` tokens of text that is `bytes_` bytes long, in bits per byte:
    comparable between tokenizers (the held-out part's bytes are in its index)."""
    if bytes_ <= 0:
        raise DataError(f"bits per byte of {bytes_} bytes: the text must have at least one byte")
    return loss_per_token * tokens / bytes_ / math.log(2)


# ------------------------------------------------------------------------------------------------ batches


def sample_batch(
    tokens: np.ndarray, batch_size: int, length: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs [batch, length] and next-token targets, as int64 (tokens may be a memmap)."""
    if len(tokens) < length + 2:
        raise DataError(f"the data has {len(tokens)} tokens, fewer than one window of {length + 1}")
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


# ------------------------------------------------------------------------------------------------ older interface


@dataclass
class TextData:
    """Token stream of a trainer's shard and of the held-out set: byte tokens of a raw source, prepared once into
    the cache (see corpus.ensure_prepared) and memory-mapped."""

    train: np.ndarray
    heldout: np.ndarray

    @classmethod
    def load(cls, source: str, heldout_fraction: float = 0.05, shard: int | None = None, shards: int = 1) -> TextData:
        """shard: that train shard of `shards` (a memmap); None: all train shards (in memory if more than one)."""
        data = TokenShards.open(
            ensure_prepared(source, byte_tokenizer(), chunks=shards, heldout_fraction=heldout_fraction)
        )
        if not data.train or data.total_train_tokens < 2:
            raise DataError(f"the training data of {source!r} is empty")
        if shard is not None:
            train = data.train[shard % len(data.train)]
        else:
            train = data.train[0] if len(data.train) == 1 else np.concatenate(data.train)
        return cls(train=train, heldout=data.heldout)

    @classmethod
    def load_heldout(cls, source: str, heldout_fraction: float = 0.05) -> np.ndarray:
        return cls.load(source, heldout_fraction).heldout
