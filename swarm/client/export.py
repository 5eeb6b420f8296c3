"""Export: download every stage's trained parameters from a running swarm and assemble the whole model.

The whole model's names are `swarm.architectures.model.build_full_model`'s: stage s's local block j is the model's block
`stages[s][0] + j`. Each stage's state comes from one of its online peers (fastest first, up to 3 tried per
stage); the assembled tensors are checked, then written atomically with the manifest's model config in the
file's metadata, so that `examples/generate.py` can rebuild the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm import PROTOCOL_VERSION, __version__
from swarm.architectures.model import build_full_model
from swarm.client import joining
from swarm.client.rpc import download_state, swarm_tokenizer
from swarm.dataset.tokenizer import Tokenizer
from swarm.dht import node
from swarm.dht.records import Announcement, PeerState, fetch_announcements
from swarm.errors import ExportError
from swarm.files import atomic_write
from swarm.manifests.manifest import Manifest
from swarm.routing import online_peers
from swarm.wire.state import stage_parameter_shapes, stage_state_shapes

logger = logging.getLogger(__name__)

EXPORT_FORMAT = "1"  # metadata "swarm_export": the version of this file layout
DEFAULT_TIMEOUT = 120.0
DISCOVERY_WAIT = 10.0  # seconds to wait for every stage to have an online peer before giving up
SOURCES_PER_STAGE = 3  # online peers of a stage tried, fastest first, before giving up on it
PARALLEL_DOWNLOADS = 4  # stages downloaded at once (each holds its state in memory)


# ------------------------------------------------------------------------------ names and assembly (pure)


def parameter_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def full_parameter_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    """The whole model's parameters, in build_full_model's order, with their shapes."""
    with torch.device("meta"):
        return parameter_shapes(build_full_model(manifest.model))


def full_parameter_name(manifest: Manifest, stage: int, name: str) -> str:
    """The whole model's name of stage `stage`'s parameter `name`: block j of a stage is block layers[j] of the
    model; the embeddings (stage 0) and the head (last stage) keep their names."""
    if not name.startswith("blocks."):
        return name
    index, rest = name[len("blocks.") :].split(".", 1)
    layers = manifest.stage_layers(stage)
    if not index.isdigit() or int(index) >= len(layers):
        raise ExportError(f"stage {stage} has no block {index!r} (it holds layers {layers.start}..{layers.stop - 1})")
    return f"blocks.{layers[int(index)]}.{rest}"


def stage_parameters(items: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The parameters of a downloaded stage state (`param/<name>` entries, prefix removed); optimizer statistics
    (`optim/...`) are dropped."""
    params: dict[str, torch.Tensor] = {}
    for key, tensor in items:
        if key.startswith("param/"):
            name = key[len("param/") :]
            if name in params:
                raise ExportError(f"the state holds parameter {name!r} twice")
            params[name] = tensor
    return params


def check_stage_parameters(manifest: Manifest, stage: int, params: Mapping[str, torch.Tensor]) -> None:
    """Raise ExportError unless `params` are exactly stage `stage`'s parameters: names, shapes, floating point,
    finite."""
    expected = stage_parameter_shapes(manifest, stage)
    unexpected = sorted(set(params) - set(expected))
    if unexpected:
        raise ExportError(f"stage {stage}'s state holds {unexpected[0][:200]!r}, which the stage does not have")
    missing = [name for name in expected if name not in params]
    if missing:
        raise ExportError(f"stage {stage}'s state lacks {len(missing)} parameters, e.g. {missing[0]!r}")
    for name, shape in expected.items():
        tensor = params[name]
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or not tensor.is_floating_point():
            got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ExportError(f"stage {stage}'s parameter {name!r} is {got}, expected a float tensor {list(shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"stage {stage}'s parameter {name!r} holds NaN or Inf")


def assemble_full_state(
    manifest: Manifest, stage_params: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The whole model's parameters from each stage's (by stage-local name), named and ordered as
    build_full_model(manifest.model) names them. Raises ExportError if anything is missing, extra or misshapen."""
    if len(stage_params) != manifest.num_stages:
        raise ExportError(f"got the parameters of {len(stage_params)} stages, the swarm has {manifest.num_stages}")
    collected: dict[str, torch.Tensor] = {}
    for stage, params in enumerate(stage_params):
        check_stage_parameters(manifest, stage, params)
        for name, tensor in params.items():
            full_name = full_parameter_name(manifest, stage, name)
            if full_name in collected:
                raise ExportError(f"parameter {full_name!r} comes from two stages")
            collected[full_name] = tensor
    expected = full_parameter_shapes(manifest)
    if set(collected) != set(expected):
        difference = sorted(set(collected) ^ set(expected))
        raise ExportError(f"the stages' parameters do not make up the whole model (e.g. {difference[0]!r})")
    for name, shape in expected.items():
        if tuple(collected[name].shape) != shape:
            raise ExportError(f"parameter {name!r} is {list(collected[name].shape)}, the model has {list(shape)}")
    return {name: collected[name].detach().contiguous() for name in expected}


@dataclass(frozen=True)
class StageSource:
    """Where one stage's parameters came from."""

    stage: int
    layers: tuple[int, int]  # [start, end)
    peer_id: str
    optimizer_steps: int
    parameters: int  # number of elements
    seconds: float
    counters: dict[str, int] = dataclasses.field(default_factory=dict)  # of the state: optimizer steps, rounds


def export_metadata(manifest: Manifest, sources: Sequence[StageSource]) -> dict[str, str]:
    """The safetensors metadata (strings only) of an export."""
    return {
        "format": "pt",
        "swarm_export": EXPORT_FORMAT,
        "swarm_id": manifest.swarm_id,
        "swarm_name": manifest.name,
        "model_config": json.dumps(dataclasses.asdict(manifest.model), sort_keys=True),
        "stages": json.dumps(
            [
                {"stage": s.stage, "layers": list(s.layers), "peer_id": s.peer_id, **s.counters}
                | {"optimizer_steps": s.optimizer_steps}
                for s in sources
            ]
        ),
        "swarm_version": __version__,
        "protocol_version": str(PROTOCOL_VERSION),
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------- the file


def check_output_path(path: Path) -> None:
    """Fail before any download if `path` cannot be written (an export can take minutes)."""
    if path.is_dir():
        raise ExportError(f"--out {path} is a folder; give a file name, such as {path / 'model.safetensors'}")
    folder = path.parent
    if not folder.exists():
        raise ExportError(f"--out {path}: the folder {folder} does not exist; create it first or choose another path")
    if not folder.is_dir():
        raise ExportError(f"--out {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ExportError(f"--out {path}: this user may not write files in {folder}; choose another path")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write atomically (swarm/files.py: a reader never sees half a file, and no temporary file is left behind).
    Returns the file's size in bytes. Raises ExportError on any OS error."""
    from safetensors.torch import save_file

    try:
        atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata=metadata))
        return path.stat().st_size
    except OSError as e:
        raise ExportError(f"cannot write {path}: {e.strerror or e}") from None


# -------------------------------------------------------------------------------------------- the swarm


def remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _describe_stage(announcements: Sequence[Announcement]) -> str:
    """E.g. "only 1 offline peer", "only 2 joining and 1 offline peers", "no peer at all"."""
    states = [a.state for a in announcements if a.state != PeerState.ONLINE]
    counts = [f"{states.count(s)} {s}" for s in ("joining", "paused", "offline") if states.count(s)]
    if not counts:
        return "no peer at all"
    return f"only {' and '.join(counts)} peer{'' if len(states) == 1 else 's'}"


async def find_sources(
    dht: DHT, manifest: Manifest, deadline: float, wait: float = DISCOVERY_WAIT
) -> list[list[Announcement]]:
    """The online peers of every stage, fastest first (ties in random order). Waits up to `wait` seconds for every
    stage to have one; raises ExportError naming the stages that have none."""
    stop_waiting = min(deadline, time.monotonic() + wait)
    stages: list[list[Announcement]] = [[] for _ in range(manifest.num_stages)]
    while True:
        timeout = max(0.5, remaining(deadline))
        results = await asyncio.gather(
            *[
                asyncio.wait_for(fetch_announcements(dht, manifest.swarm_id, s), timeout)
                for s in range(manifest.num_stages)
            ],
            return_exceptions=True,
        )
        for stage, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.debug(f"reading the announcements of stage {stage} failed: {result!r}")
            else:
                stages[stage] = result
        online = [online_peers(anns, get_dht_time()) for anns in stages]
        if all(online) or time.monotonic() >= stop_waiting:
            break
        await asyncio.sleep(min(1.0, max(0.0, stop_waiting - time.monotonic())))

    missing = [stage for stage, peers in enumerate(online) if not peers]
    if missing and not any(stages):
        raise ExportError(
            f"the swarm's initial peers answered, but no peer announces any stage of swarm {manifest.name!r} "
            f"(id {manifest.swarm_id}) after {wait:g} s of looking. Is the swarm running with exactly "
            "this manifest? Any change to it other than initial_peers makes a different swarm id."
        )
    if missing:
        details = "; ".join(f"stage {s} has {_describe_stage(stages[s])}" for s in missing)
        plural = "s" if len(missing) > 1 else ""
        raise ExportError(
            f"cannot export swarm {manifest.name!r}: no online peer serves stage{plural} "
            f"{', '.join(map(str, missing))} ({details}), and every stage's parameters must come from one of its "
            f"online peers. Start a peer for it (swarm-peer --join MANIFEST --stage {missing[0]}) or try again "
            "when one is back."
        )
    rng = random.Random()
    result = []
    for peers in online:
        peers = list(peers)
        rng.shuffle(peers)
        result.append(sorted(peers, key=lambda a: -a.throughput))
    return result


async def download_stage(
    p2p,
    manifest: Manifest,
    stage: int,
    candidates: Sequence[Announcement],
    deadline: float,
    on_status: Callable[[str], None] = lambda status: None,
) -> tuple[dict[str, torch.Tensor], StageSource]:
    """Download and check one stage's parameters from the first of up to SOURCES_PER_STAGE candidates that
    delivers. An attempt gets the time left, or half of it when another candidate is left to try."""
    shapes = stage_state_shapes(manifest, stage)
    failures = []
    tried = list(candidates[:SOURCES_PER_STAGE])
    for i, peer in enumerate(tried):
        left = remaining(deadline)
        if left <= 0:
            break
        timeout = left / 2 if i + 1 < len(tried) else left
        on_status(f"downloading from peer {peer.peer_id[-8:]}")
        begin = time.monotonic()
        try:
            items, counters = await download_state(p2p, peer.peer_id, manifest, stage, shapes, timeout)
            params = stage_parameters(items)
            del items  # the optimizer statistics are not exported
            check_stage_parameters(manifest, stage, params)
        except TimeoutError:
            failures.append(f"peer {peer.peer_id} did not deliver within {timeout:.0f} s")
        except Exception as e:  # a refusal, a lost connection or a malformed state: try another peer
            failures.append(f"peer {peer.peer_id} failed: {short_error(e)}")
        else:
            source = StageSource(
                stage=stage,
                layers=manifest.stages[stage],
                peer_id=peer.peer_id,
                optimizer_steps=counters.get("optimizer_steps", 0),
                counters=dict(counters),
                parameters=sum(t.numel() for t in params.values()),
                seconds=time.monotonic() - begin,
            )
            return params, source
        logger.debug(failures[-1])
    if not failures:
        raise ExportError(f"no time was left to download stage {stage}; allow more with --timeout")
    raise ExportError(
        f"could not download stage {stage} from any of its {len(tried)} online peers tried: "
        + "; ".join(failures)
        + ". Try again later, or with a larger --timeout if the downloads timed out."
    )


def one_line(text: str) -> str:
    """One line: error messages that quote other programs may hold line breaks."""
    return " ".join(text.split())


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


async def export_swarm(
    dht: DHT,
    manifest: Manifest | None,
    deadline: float,
    on_status: Callable[[int, str, bool], None] = lambda stage, status, done: None,
    wait: float = DISCOVERY_WAIT,
    join: str = "",
    on_manifest: Callable[[Manifest], None] = lambda manifest: None,
    with_tokenizer: bool = False,
) -> tuple[Manifest, dict[str, torch.Tensor], list[StageSource], Tokenizer | None]:
    """Find every stage's online peers, download the stages (PARALLEL_DOWNLOADS at once) and assemble the whole
    model's parameters. Everything ends by `deadline` (time.monotonic()). Without a manifest, the peer that
    `join` names hands it out (over the same p2p replica: see joining.manifest_through_peer). `with_tokenizer`:
    also get the swarm's tokenizer (from this machine, next to the manifest, or from the stages' peers)."""
    p2p = await asyncio.wait_for(dht.replicate_p2p(), max(0.1, remaining(deadline)))
    try:
        manifest = await joining.manifest_through_peer(p2p, join, manifest)
        node.sign_records(dht, manifest, None)  # it reads records, writes none: only signed ones count
        on_manifest(manifest)
        for stage in range(manifest.num_stages):
            on_status(stage, "looking for online peers", False)
        sources = await find_sources(dht, manifest, deadline, wait)
        semaphore = asyncio.Semaphore(PARALLEL_DOWNLOADS)

        async def one(stage: int) -> tuple[dict[str, torch.Tensor], StageSource]:
            on_status(stage, "waiting", False)
            async with semaphore:
                result = await download_stage(
                    p2p, manifest, stage, sources[stage], deadline, lambda status: on_status(stage, status, False)
                )
            source = result[1]
            on_status(
                stage,
                f"{source.parameters / 1e6:.2f}M parameters from peer {source.peer_id[-8:]}, "
                f"{source.optimizer_steps} optimizer steps",
                True,
            )
            return result

        tasks = [asyncio.create_task(one(stage)) for stage in range(manifest.num_stages)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), max(0.1, remaining(deadline)))
        except TimeoutError:
            unfinished = [str(stage) for stage, task in enumerate(tasks) if not task.done() or task.cancelled()]
            raise ExportError(
                f"the download of stage {', '.join(unfinished)} did not finish in time; allow more with --timeout"
            ) from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        tensors = assemble_full_state(manifest, [params for params, _ in results])
        tokenizer = None
        if with_tokenizer:
            peer_ids = [peer.peer_id for peers in sources for peer in peers[:SOURCES_PER_STAGE]]
            timeout = max(1.0, remaining(deadline))
            tokenizer = await swarm_tokenizer(p2p, manifest, peer_ids, timeout)
        return manifest, tensors, [source for _, source in results], tokenizer
    finally:
        try:
            await asyncio.wait_for(p2p.shutdown(), timeout=5)
        except Exception as e:
            logger.debug(f"p2p shutdown failed: {e!r}")
