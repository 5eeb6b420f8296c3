"""What a new swarm's manifest takes from files: a tokenizer (given, or trained here on the data), prepared data (its
index pinned), and a pretrained Hugging Face Llama (its config, weights' hash and tokenizer). swarm-init's library
part: files are read and the tokenizer written next to the manifest; nothing is printed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.dataset.corpus import index_sha256
from swarm.dataset.documents import training_texts
from swarm.dataset.index import parse_index
from swarm.dataset.locations import is_url, location_of
from swarm.dataset.shards import prepared_index
from swarm.dataset.tokenizer import TOKENIZER_FILE, Tokenizer, byte_tokenizer, load_tokenizer, train_tokenizer
from swarm.errors import ChunkError, DataError, ManifestError
from swarm.files import atomic_write
from swarm.hf import pretrained as pretrained_model

TOKENIZER_SAMPLE_BYTES = 100_000_000  # a tokenizer is trained on at most about this much text
MAX_PRETRAINED_CONTEXT = 2048  # default training window of a pretrained model (--context-length: up to its own)


@dataclass
class SwarmSources:
    """Manifest sections that come from files (laid over the preset by presets.new_manifest)."""

    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    pretrained: dict[str, str] = field(default_factory=dict)
    tokenizer: Tokenizer = field(default_factory=byte_tokenizer)
    tokenizer_path: Path | None = None  # where the manifest's tokenizer file is (None: bytes)


def swarm_sources(
    manifest_path: Path,
    model: dict[str, Any],
    data_source: str | None = None,
    tokenizer: str | None = None,
    train_tokenizer_size: int | None = None,
    from_pretrained: str | None = None,
    stages: int | None = None,
    force: bool = False,
) -> SwarmSources:
    """The model, data and pretrained sections for a manifest to be written at `manifest_path`. `model` holds the
    explicit model settings. Raises ManifestError (or TokenizerError, DataError) saying what to change."""
    folder = manifest_path.parent
    result = SwarmSources(model=dict(model))
    if from_pretrained is not None:
        given = [key for key in model if key not in ("seed", "context_length")]
        if given:
            raise ManifestError(f"--from-pretrained gives the model's shape; drop --{given[0].replace('_', '-')}")
        source = Path(from_pretrained).expanduser()
        config = pretrained_model.read_config(source, seed=model.get("seed", 0))
        if config.tie_embeddings and (stages is None or stages > 1):
            config = dataclasses.replace(config, tie_embeddings=False)  # its stages cannot share one tensor
        # the training windows: what --context-length says, else at most MAX_PRETRAINED_CONTEXT (a model made
        # for 128k positions would otherwise train on windows no consumer GPU holds)
        context = model.get("context_length", min(config.context_length, MAX_PRETRAINED_CONTEXT))
        if context > config.context_length:
            raise ManifestError(
                f"--context-length {context} is longer than the model's {config.context_length} positions"
            )
        result.model = {**dataclasses.asdict(config), "context_length": context}
        result.pretrained = {"path": _relative(source, folder), "sha256": pretrained_model.weights_sha256(source)}
        if (source / TOKENIZER_FILE).is_file():
            tokenizer = str(source / TOKENIZER_FILE)
    published = data_source is not None and is_url(data_source)
    index = prepared_index(data_source) if data_source is not None and not published else None
    recorded: str | None = None  # the tokenizer the prepared data was tokenized with
    if published:  # a prepared folder at a URL: its index is read (within a deadline) and pinned
        try:
            raw = location_of(data_source, "").read_index()
        except ChunkError as e:
            raise DataError(f"cannot read the data's index at {data_source}: {e}; check the URL") from None
        parsed = parse_index(raw, data_source)
        result.data["index_sha256"], recorded = parsed.sha256, parsed.tokenizer_sha256
    elif index is not None:
        result.data["index_sha256"] = index_sha256(index)
        # the folder's place relative to the manifest: publish the two side by side and volunteers find it
        result.data["source"] = _relative(index.parent, folder)
        recorded = parse_index(index.read_bytes(), str(index)).tokenizer_sha256
        if tokenizer is None and train_tokenizer_size is None and (index.parent / TOKENIZER_FILE).is_file():
            tokenizer = str(index.parent / TOKENIZER_FILE)  # the tokenizer the data was prepared with
    if tokenizer is not None:
        result.tokenizer = load_tokenizer(tokenizer)
        result.tokenizer_path = _place_tokenizer(Path(tokenizer).expanduser(), result.tokenizer, manifest_path, force)
    elif train_tokenizer_size is not None:
        texts = training_texts(data_source or "stdlib", max_bytes=TOKENIZER_SAMPLE_BYTES)
        result.tokenizer = train_tokenizer(texts, train_tokenizer_size)
        result.tokenizer_path = _tokenizer_destination(manifest_path)
        _refuse_overwrite(result.tokenizer_path, result.tokenizer, force)
        result.tokenizer.save_as(result.tokenizer_path)
    if result.tokenizer_path is not None:
        result.data["tokenizer"] = _relative(result.tokenizer_path, folder)
        result.data["tokenizer_sha256"] = result.tokenizer.sha256
        vocab = result.model.get("vocab_size")
        if vocab is not None and vocab < result.tokenizer.vocab_size:
            raise ManifestError(
                f"--vocab-size {vocab} is smaller than the tokenizer's {result.tokenizer.vocab_size} ids; drop it "
                "(the tokenizer's size is taken) or give a larger one"
            )
        result.model.setdefault("vocab_size", result.tokenizer.vocab_size)
    if recorded is not None:
        _check_index_tokenizer(data_source, recorded, result.tokenizer or byte_tokenizer())
    return result


def _check_index_tokenizer(where: str, recorded: str, tokenizer: Tokenizer) -> None:
    if recorded != tokenizer.sha256:
        prepared = f"the tokenizer {recorded[:16]}..." if recorded else "the byte vocabulary"
        used = f"the tokenizer {tokenizer.sha256[:16]}..." if tokenizer.sha256 else "the byte vocabulary"
        raise ManifestError(
            f"the data in {where} was prepared with {prepared}, but the swarm would use {used}; give the "
            "tokenizer the data was prepared with (--tokenizer), or prepare the data again with this one"
        )


def _tokenizer_destination(manifest_path: Path) -> Path:
    return manifest_path.with_name(f"{manifest_path.stem}.{TOKENIZER_FILE}")


def _place_tokenizer(path: Path, tokenizer: Tokenizer, manifest_path: Path, force: bool) -> Path:
    """Where the manifest's tokenizer lives: the given file if it is in the manifest's folder, else a copy there
    (peers find it next to the manifest, or get it from each other)."""
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if path.resolve().parent == manifest_path.resolve().parent:
        return path
    destination = _tokenizer_destination(manifest_path)
    _refuse_overwrite(destination, tokenizer, force)
    atomic_write(destination, path.read_bytes())
    return destination


def _refuse_overwrite(destination: Path, tokenizer: Tokenizer, force: bool) -> None:
    if destination.exists() and not force:
        try:
            same = load_tokenizer(destination).sha256 == tokenizer.sha256
        except Exception:
            same = False
        if not same:
            raise ManifestError(f"{destination} exists (another tokenizer); pass --force to replace it")


def _relative(path: Path, folder: Path) -> str:
    """`path` relative to the manifest's folder when it is inside it (the pair can move together), else absolute."""
    resolved, base = path.resolve(), folder.resolve()
    if resolved.is_relative_to(base):
        return resolved.relative_to(base).as_posix()
    return os.path.abspath(path)
