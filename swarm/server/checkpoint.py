"""Checkpoints of a stage's state: one safetensors file per stage, written atomically.

A checkpoint holds everything a stage server hands to a peer that takes the stage over (parameters, optimizer
statistics, DiLoCo's outer state, named as in swarm/wire/state.py) and, in the file's metadata, the swarm id,
the stage, its layers, the counters (optimizer steps, averaging round) and when it was saved. It is written
atomically (swarm/files.py): a crash leaves either the old checkpoint or the new one, never half of one.

Loading checks before anything is used: the file must parse, belong to this swarm and this stage, and carry
counters; the tensors are then checked against the model like any state from another peer
(StageServer.load_state).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from swarm.errors import CheckpointError
from swarm.files import atomic_write, cache_root
from swarm.manifests.manifest import Manifest

logger = logging.getLogger(__name__)

FORMAT = "swarm-stage-checkpoint/1"


@dataclass
class Checkpoint:
    path: Path
    stage: int
    items: list[tuple[str, torch.Tensor]]
    counters: dict[str, int]
    saved_at: float  # unix time

    @property
    def optimizer_steps(self) -> int:
        return self.counters.get("optimizer_steps", 0)


def default_checkpoint_dir(manifest: Manifest) -> Path:
    """$SWARM_CACHE_DIR (or ~/.cache/swarm)/checkpoints/<swarm id>: one folder per swarm."""
    return cache_root() / "checkpoints" / manifest.swarm_id


def checkpoint_path(directory: Path, stage: int) -> Path:
    return Path(directory) / f"stage-{stage}.safetensors"


def save_checkpoint(
    directory: Path, manifest: Manifest, stage: int, items: list[tuple[str, torch.Tensor]], counters: dict[str, int]
) -> Path:
    """Write the stage's state atomically (swarm/files.py); the path written. OSError if that is impossible."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, stage)
    metadata = {
        "format": FORMAT,
        "swarm_id": manifest.swarm_id,
        "swarm_name": manifest.name,
        "stage": str(stage),
        "layers": json.dumps(list(manifest.stages[stage])),
        "counters": json.dumps({key: int(value) for key, value in counters.items()}),
        "saved_at": repr(time.time()),
    }
    tensors = {name: tensor.contiguous() for name, tensor in items}
    atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata=metadata))
    return path


def load_checkpoint(path: Path, manifest: Manifest, stage: int) -> Checkpoint:
    """Read a checkpoint of `stage` of this swarm; CheckpointError, naming the problem, if it is not one."""
    return _read(Path(path), manifest, stage, with_tensors=True)


def checkpoint_summary(path: Path, manifest: Manifest, stage: int) -> Checkpoint:
    """What a checkpoint of `stage` holds (its counters, when it was saved), read from its metadata alone: no
    tensor is read. CheckpointError as load_checkpoint."""
    return _read(Path(path), manifest, stage, with_tensors=False)


def _read(path: Path, manifest: Manifest, stage: int, with_tensors: bool) -> Checkpoint:
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            names = list(f.keys()) if with_tensors else []  # noqa: SIM118 (safe_open is not a dict)
            items = [(name, f.get_tensor(name)) for name in names]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError, SafetensorError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({type(e).__name__}: {e}); delete it"
        ) from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Swarm stage checkpoint (no '{FORMAT}' in its metadata)")
    if metadata.get("swarm_id") != manifest.swarm_id:
        raise CheckpointError(
            f"checkpoint {path} belongs to swarm {str(metadata.get('swarm_id'))[:40]!r}, not to this swarm "
            f"({manifest.swarm_id}); it was not loaded"
        )
    if metadata.get("stage") != str(stage):
        raise CheckpointError(f"checkpoint {path} holds stage {metadata.get('stage')}, not stage {stage}; not loaded")
    malformed = f"checkpoint {path} has malformed metadata"
    try:
        counters = json.loads(metadata["counters"])
        saved_at = float(metadata["saved_at"])
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{malformed} ({str(e)[:200]}); delete it") from None
    if not isinstance(counters, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53 for v in counters.values()
    ):
        raise CheckpointError(f"{malformed} (counters must be non-negative integers); delete it")
    return Checkpoint(path, stage, items, counters, saved_at)


def kept_stages(directory: Path | None) -> list[int]:
    """The stages of which `directory` holds a checkpoint file (not yet checked)."""
    if directory is None or not Path(directory).is_dir():
        return []
    stages = []
    for path in Path(directory).glob("stage-*.safetensors"):
        number = path.name[len("stage-") : -len(".safetensors")]
        if number.isdigit() and len(number) <= 6:
            stages.append(int(number))
    return sorted(stages)


def prune_checkpoints(directory: Path | None, keep: int, served: set[int]) -> list[int]:
    """Bound the folder on disk: the checkpoints of the stages served now, and the `keep` most recently saved of
    the others; the stages whose checkpoints were deleted."""
    if directory is None:
        return []
    others = [stage for stage in kept_stages(directory) if stage not in served]
    paths = {stage: checkpoint_path(directory, stage) for stage in others}
    try:
        by_age = sorted(others, key=lambda stage: paths[stage].stat().st_mtime, reverse=True)
    except OSError:  # deleted meanwhile (another process of the user's)
        return []
    deleted = by_age[keep:]
    for stage in deleted:
        paths[stage].unlink(missing_ok=True)
    return deleted


def find_checkpoint(directory: Path | None, manifest: Manifest, stage: int) -> Checkpoint | None:
    """The checkpoint of `stage` in `directory`, if there is a usable one; a bad one is reported and skipped."""
    if directory is None:
        return None
    path = checkpoint_path(directory, stage)
    if not path.exists():
        return None
    try:
        return load_checkpoint(path, manifest, stage)
    except CheckpointError as e:
        logger.error(f"{e}")
        return None
