"""Which chunk a trainer reads next, so that the swarm reads its corpus once per epoch with no coordinator.

Pure decisions over what the trainers announce (swarm/dataset/progress.py): each trainer says which chunks of the
current epoch the swarm has finished as far as it knows (a bitmap it merges from everybody's: knowledge outlives a
trainer that leaves), which it is reading or fetching now, and which it holds in its cache. A trainer takes, of the
chunks nobody finished or is reading, the first in an order of its own (a hash of the data, the epoch, the chunk
and its peer id): two trainers that choose at the same moment almost never pick the same chunk, and however many
trainers come and go, no chunk is read twice unless a trainer saw the others' records too late. When every chunk
of the epoch is finished or taken, the trainer goes on to the next epoch (a new order). Within a chunk, windows come
in an order fixed by the same hash, so a restarted trainer resumes the chunk where it stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np


def to_bitmap(numbers: Iterable[int], count: int) -> bytes:
    """Chunk numbers (0 <= n < count) as a bitmap of ceil(count / 8) bytes."""
    bits = np.zeros(count, dtype=bool)
    for number in numbers:
        if 0 <= number < count:
            bits[number] = True
    return np.packbits(bits, bitorder="little").tobytes()


def from_bitmap(bitmap: bytes, count: int) -> set[int]:
    """The chunk numbers a bitmap holds (a bitmap of the wrong length holds none: it is of other data)."""
    if len(bitmap) != (count + 7) // 8:
        return set()
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")[:count]
    return {int(k) for k in np.flatnonzero(bits)}


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def chunk_rank(data: str, epoch: int, chunk: int, reader: str) -> int:
    """Where `chunk` comes in `reader`'s order for `epoch` (lowest first)."""
    return _hash("rank", data, epoch, chunk, reader)


def choose_chunk(
    data: str, epoch: int, count: int, reader: str, finished: set[int], taken: set[int], avoid: set[int] = frozenset()
) -> int | None:
    """The chunk `reader` reads next in `epoch`: the first in its order that is not finished, not taken by another
    reader, and not to be avoided (unreachable for now); None if there is none (the epoch is done for it)."""
    best: tuple[int, int] | None = None
    for chunk in range(count):
        if chunk in finished or chunk in taken or chunk in avoid:
            continue
        rank = chunk_rank(data, epoch, chunk, reader)
        if best is None or rank < best[0]:
            best = (rank, chunk)
    return best[1] if best is not None else None


def keeps_claim(data: str, epoch: int, chunk: int, reader: str, others: list[str]) -> bool:
    """Whether `reader` keeps a chunk that `others` claim too (they chose it in the same moment): the reader that
    ranks it first keeps it, and every reader decides the same from the same records."""
    mine = chunk_rank(data, epoch, chunk, reader)
    return all((mine, reader) < (chunk_rank(data, epoch, chunk, other), other) for other in others)


def window_starts(data: str, epoch: int, chunk: int, reader: str, tokens: int, window: int) -> np.ndarray:
    """The start of each window of `window` tokens in a chunk of `tokens`, in the order `reader` reads them in
    `epoch` (non-overlapping, from an offset that changes with the epoch); empty if the chunk is too small."""
    if tokens < window:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(_hash("windows", data, epoch, chunk, reader))
    count = tokens // window
    offset = int(rng.integers(0, tokens - count * window + 1))
    return offset + rng.permutation(count).astype(np.int64) * window


def epoch_coverage(finished: set[int], reading: set[int], count: int) -> float:
    """The fraction of an epoch's chunks finished (chunks being read count as half)."""
    if count == 0:
        return 0.0
    return (len(finished) + 0.5 * len(reading - finished)) / count
