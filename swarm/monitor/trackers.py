"""Experiment trackers the monitor can log the swarm to: TensorBoard (--tensorboard DIR) and wandb (--wandb PROJECT).

Each is an optional extra (pip install 'swarm[tensorboard]' or 'swarm[wandb]'); asking for one that is not
installed is a clear error at start, not a traceback later. Both log the same scalars per sample: loss against
tokens trained (the step), samples per second, peers online (in all and per stage) and balance efficiency.
wandb honours its own settings: WANDB_MODE=offline logs to local files only (sync them later with `wandb sync`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from swarm.errors import PeerStartError

logger = logging.getLogger(__name__)


def scalars(document: dict[str, Any]) -> dict[str, float]:
    """The figures every tracker logs, from peer-status' document (unknown ones left out)."""
    health, training = document["health"], document["training"]
    figures: dict[str, float] = {
        "swarm/samples_per_second": training["samples_per_second"],
        "swarm/tokens_per_second": training["tokens_per_second"],
        "swarm/peers_online": document["swarm"]["peers_online"],
        "swarm/trainers": training["trainers"],
        "swarm/healthy": float(health["healthy"]),
    }
    if training["loss"] is not None:
        figures["swarm/loss"] = training["loss"]
    if health["balance_efficiency"] is not None:
        figures["swarm/balance_efficiency"] = health["balance_efficiency"]
    for row in document["stages"]:
        figures[f"stage{row['stage']}/online_peers"] = row["online_peers"]
        figures[f"stage{row['stage']}/throughput"] = row["throughput"]
    return figures


class Tracker(Protocol):
    def log(self, document: dict[str, Any], when: float) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars in a TensorBoard event file under `folder`; the step is the number of tokens trained."""

    def __init__(self, folder: Path | str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise PeerStartError(
                "--tensorboard needs the tensorboard extra: pip install 'swarm[tensorboard]'"
            ) from None
        try:
            self.writer = SummaryWriter(logdir=str(folder), flush_secs=10)
        except OSError as e:
            raise PeerStartError(
                f"cannot write TensorBoard files to {folder} ({e}); pass another --tensorboard DIR"
            ) from None

    def log(self, document: dict[str, Any], when: float) -> None:
        step = document["training"]["tokens_trained"]
        for name, value in scalars(document).items():
            self.writer.add_scalar(name, value, global_step=step, walltime=when)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One wandb run in `project`; loss and the rest are plotted against tokens trained."""

    def __init__(self, project: str, name: str, config: dict[str, Any], folder: Path | str | None = None):
        try:
            import wandb
        except ImportError:
            raise PeerStartError("--wandb needs the wandb extra: pip install 'swarm[wandb]'") from None
        try:
            self.run = wandb.init(project=project, name=name, config=config, dir=str(folder) if folder else None)
        except Exception as e:  # wandb raises its own errors (no login, no network): say what to do
            raise PeerStartError(
                f"wandb could not start a run in project {project!r} ({type(e).__name__}: {e}); log in with "
                "`wandb login`, or set WANDB_MODE=offline to log to local files"
            ) from None
        self.run.define_metric("swarm/tokens_trained")
        self.run.define_metric("*", step_metric="swarm/tokens_trained")

    def log(self, document: dict[str, Any], when: float) -> None:
        self.run.log({**scalars(document), "swarm/tokens_trained": document["training"]["tokens_trained"]})

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """All the trackers the user asked for; a tracker that fails while logging is logged and dropped, never fatal."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, document: dict[str, Any], when: float) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(document, when)
            except Exception:
                logger.exception("%s failed; it logs nothing more", type(tracker).__name__)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                logger.exception("%s failed to close", type(tracker).__name__)
