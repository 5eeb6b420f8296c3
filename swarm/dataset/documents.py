"""Documents of a data source: "stdlib" (Python's standard library sources), a text file, a `.jsonl` file (one
JSON object a line, its text under "text" or another key), a `.parquet` file (a text column), or a folder of any of
these. A document is a text file, a JSON line or a parquet row, named by its path under the source (plus its line
or row number); a hash of that name puts it into the held-out part or the train part (`is_heldout`), so that the
split never depends on the order of work. Documents are read lazily, a large text file in pieces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import DataError

logger = logging.getLogger(__name__)

STDLIB = "stdlib"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".toml", ".cfg", ".html", ".js")
RECORD_SUFFIXES = (".jsonl", ".parquet")  # files of many documents
PIECE_CHARS = 1 << 20  # a text file is read and tokenized in pieces of this many characters
RESOLUTION = 100_000

ProgressCallback = Callable[[int, int], None]


def heldout_bucket(name: str) -> int:
    """Where a document's name falls in 0..99,999: documents below fraction * 100,000 are held out."""
    return int.from_bytes(hashlib.sha256(f"heldout/{name}".encode()).digest()[:8], "little") % RESOLUTION


def corpus_files(source: str, exclude: Path | None = None) -> tuple[Path, list[Path]]:
    """The root folder and the sorted files of a source: "stdlib" (its .py files, no site-packages), one file, or
    a folder's text files (by suffix), .jsonl and .parquet files. Files under `exclude` are left out."""
    if source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages", "__pycache__")]
            files += [Path(folder, name) for name in names if name.endswith(".py")]
        return root, sorted(files)
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent, [path]
    if not path.is_dir():
        raise DataError(f"data source {source!r} is neither 'stdlib', a file nor a folder: check the path")
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    files = [f for f in path.rglob("*") if f.suffix.lower() in suffixes and f.is_file()]
    if exclude is not None:
        files = [f for f in files if not f.resolve().is_relative_to(exclude.resolve())]
    if not files:
        raise DataError(f"data source {source!r} has no data files ({', '.join(suffixes)})")
    return path, sorted(files)


@dataclass
class Document:
    """A document: its name (its path under the source, and ":<line>" or ":<row>" in a file of many) and text."""

    name: str
    pieces: Callable[[], Iterator[str]]  # a new iterator over its text, in pieces, on each call


@dataclass
class Reading:
    """What reading the documents found, and the progress callback (bytes of the source files read)."""

    total_bytes: int
    on_progress: ProgressCallback | None
    done_bytes: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    def advance(self, count: int) -> None:
        self.done_bytes = min(self.total_bytes, self.done_bytes + count)
        if self.on_progress is not None:
            self.on_progress(self.done_bytes, self.total_bytes)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.skipped_examples) < 5:
            self.skipped_examples.append(f"{where}: {why}")
        logger.debug("skipped %s: %s", where, why)


def read_documents(root: Path, files: list[Path], text_key: str, reading: Reading) -> Iterator[Document]:
    """The documents of `files` (from `corpus_files`), in order; bad records are skipped and counted in `reading`."""
    for path in files:
        name = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl_documents(path, name, text_key, reading)
        elif suffix == ".parquet":
            yield from _parquet_documents(path, name, text_key, reading)
        elif path.stat().st_size > 0:  # an empty file is no document (and no error: an empty __init__.py)
            yield Document(name, _text_file_pieces(path, reading))


def _text_file_pieces(path: Path, reading: Reading) -> Callable[[], Iterator[str]]:
    def pieces() -> Iterator[str]:
        read = 0
        try:
            with open(path, encoding="utf-8", errors="replace", newline="") as file:
                while piece := file.read(PIECE_CHARS):
                    read += len(piece)
                    reading.advance(len(piece))
                    yield piece
        except OSError as e:
            raise DataError(f"cannot read data file {path}: {e.strerror}") from None
        reading.advance(max(0, path.stat().st_size - read))  # characters are not bytes: end at the file's size

    return pieces


def _record_text(record: object, text_key: str) -> str | None:
    if not isinstance(record, dict):
        return None
    text = record.get(text_key)
    return text if isinstance(text, str) and text else None


def _jsonl_documents(path: Path, name: str, text_key: str, reading: Reading) -> Iterator[Document]:
    usable = 0
    try:
        with open(path, "rb") as file:
            for number, line in enumerate(file, start=1):
                reading.advance(len(line))
                if not line.strip():
                    continue
                try:
                    text = _record_text(json.loads(line), text_key)
                except ValueError as e:  # bad JSON or bad UTF-8
                    reading.skip(f"{name}:{number}", f"not JSON ({e})")
                    continue
                if text is None:
                    reading.skip(f"{name}:{number}", f"no non-empty string under key {text_key!r}")
                    continue
                usable += 1
                yield Document(f"{name}:{number}", lambda text=text: iter((text,)))
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    if not usable:
        raise DataError(
            f"{path} has no usable line: each line must be a JSON object with a non-empty string under "
            f"{text_key!r} (give another key with --text-key)"
        )


def _parquet_documents(path: Path, name: str, text_key: str, reading: Reading) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path} is a parquet file, and reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.ParquetFile(path)
        columns = table.schema_arrow.names
    except Exception as e:  # pyarrow's ArrowInvalid, OSError
        raise DataError(f"cannot read {path} as parquet: {e}") from None
    if text_key not in columns:
        raise DataError(f"{path} has no column {text_key!r} (it has {', '.join(columns)}); choose one with --text-key")
    rows = max(1, table.metadata.num_rows)
    size = path.stat().st_size
    number = 0
    for batch in table.iter_batches(batch_size=1024, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            number += 1
            if not isinstance(value, str) or not value:
                reading.skip(f"{name}:{number}", f"no non-empty string in column {text_key!r}")
                continue
            yield Document(f"{name}:{number}", lambda value=value: iter((value,)))
        reading.advance(size * batch.num_rows // rows)


def training_texts(
    source: str,
    heldout_fraction: float = 0.05,
    text_key: str = "text",
    max_bytes: int = 100_000_000,
    exclude: Path | None = None,
) -> Iterator[str]:
    """The train documents' text (the held-out ones left out), up to about `max_bytes`: to train a tokenizer on."""
    root, files = corpus_files(source, exclude)
    reading = Reading(total_bytes=sum(f.stat().st_size for f in files), on_progress=None)
    one_text = len(files) == 1 and files[0].suffix.lower() not in RECORD_SUFFIXES  # held out: its end (kept here)
    used = 0
    for document in read_documents(root, files, text_key, reading):
        if not one_text and heldout_bucket(document.name) < heldout_fraction * RESOLUTION:
            continue
        for piece in document.pieces():
            yield piece
            used += len(piece)
            if used >= max_bytes:
                return
