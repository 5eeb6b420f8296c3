"""Checkpoints that outlive the peer that served them: each peer says in the DHT which stages' checkpoints it keeps
(and how far each had trained), and hands them to other peers over RPC, for stages it no longer serves too.

- `CheckpointRecord`, under `<swarm>.checkpoints` with the peer's id as subkey (signed, as every record is: only
  that peer can write it, swarm/trust/signing.py): for each checkpoint it keeps, the stage, the optimizer steps
  and averaging round of the state, and when it was saved. `CheckpointAnnouncer` keeps it fresh.
- `CheckpointService` (`rpc_checkpoint`, namespace swarm.checkpoints): the state from the checkpoint file, in the
  form of rpc_download_state's reply (swarm/client/rpc.py, download_state with `from_checkpoint`).
- `freshest`: the records' checkpoints of a stage, the furthest trained first: where server/takeover.py takes a
  stage's state from when no online peer has it any more.

A received state is checked like any other before it is used (StageServer.load_state: every name and shape of
the stage, finite values), and its counters must be the ones the record announced: a peer cannot pass an old
checkpoint off as a fresh one to be taken first, nor send something else than what it announced.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 (hivemind detects streams by typing's only)

from hivemind import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.dht.records import announcement_lifetime, checkpoints_key, fetch_subkeyed, store_subkeyed
from swarm.errors import BadRequestError, CheckpointError, MalformedDataError
from swarm.manifests.manifest import Manifest
from swarm.server.checkpoint import (
    checkpoint_path,
    checkpoint_summary,
    kept_stages,
    load_checkpoint,
    prune_checkpoints,
)
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import make_error_reply, make_reply, pack, split_message
from swarm.wire.rpc import CheckpointRPC
from swarm.wire.validation import decode_metadata

logger = logging.getLogger(__name__)

MAX_KEPT = 4096  # checkpoints one record may list
MAX_SENDING = 2  # checkpoints sent at once: each holds a stage's state in memory
MAX_REQUEST_BYTES = 2**16
REQUEST_TIMEOUT = 10.0  # seconds to read a request
MIN_PERIOD = 10.0  # seconds between two announcements of what a peer keeps, at least
KEPT_UNSERVED = 8  # checkpoints of stages a peer does not serve now that it keeps, the most recent (bounds its disk)


@dataclass(frozen=True)
class KeptCheckpoint:
    """One checkpoint a peer keeps: its stage, how far the state had trained, and when it was saved (Unix time)."""

    stage: int
    optimizer_steps: int
    averaging_round: int
    saved_at: float

    @property
    def progress(self) -> tuple[int, int]:
        """As server/takeover.py compares states: averaging rounds (the swarm's clock), then optimizer steps."""
        return self.averaging_round, self.optimizer_steps

    @property
    def counters(self) -> dict[str, int]:
        return {"optimizer_steps": self.optimizer_steps, "averaging_round": self.averaging_round}


@dataclass(frozen=True)
class CheckpointRecord:
    """The checkpoints one peer keeps, as it announced them."""

    peer_id: str
    kept: tuple[KeptCheckpoint, ...]
    expiration: float = 0.0

    def to_record(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "kept": [[k.stage, k.optimizer_steps, k.averaging_round, k.saved_at] for k in self.kept],
        }


def parse_checkpoint_record(subkey: Any, record: Any, num_stages: int, expiration: float) -> CheckpointRecord | None:
    """Validate one record read from the DHT; None if it is malformed, or names stages the swarm does not have."""
    try:
        if not isinstance(record, dict) or record.get("peer_id") != subkey or not isinstance(subkey, str):
            return None
        entries = record["kept"]
        if not isinstance(entries, list) or len(entries) > MAX_KEPT:
            return None
        kept = []
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 4:
                return None
            stage, steps, rounds, saved_at = entry
            if not all(_count(v) for v in (stage, steps, rounds)) or stage >= num_stages:
                return None
            if not isinstance(saved_at, float) or not math.isfinite(saved_at):
                return None
            kept.append(KeptCheckpoint(stage, steps, rounds, saved_at))
        return CheckpointRecord(subkey, tuple(kept), float(expiration))
    except (KeyError, ValueError, TypeError, MalformedDataError):
        return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53


def kept_checkpoints(directory: Path | None, manifest: Manifest) -> list[KeptCheckpoint]:
    """The usable checkpoints in `directory`, from their metadata (a corrupt one is skipped)."""
    kept = []
    for stage in kept_stages(directory):
        if stage >= manifest.num_stages:
            continue
        try:
            found = checkpoint_summary(checkpoint_path(directory, stage), manifest, stage)
        except CheckpointError:
            continue
        counters = found.counters
        kept.append(
            KeptCheckpoint(
                stage, counters.get("optimizer_steps", 0), counters.get("averaging_round", 0), found.saved_at
            )
        )
    return kept


async def store_checkpoint_record(dht: DHT, swarm_id: str, record: CheckpointRecord, lifetime: float) -> bool:
    return await store_subkeyed(dht, checkpoints_key(swarm_id), record.peer_id, record.to_record(), lifetime)


async def fetch_checkpoint_records(dht: DHT, manifest: Manifest) -> list[CheckpointRecord]:
    return [
        record
        for subkey, item in await fetch_subkeyed(dht, checkpoints_key(manifest.swarm_id))
        if (record := parse_checkpoint_record(subkey, item.value, manifest.num_stages, item.expiration_time))
    ]


def freshest(records: list[CheckpointRecord], stage: int, exclude: str = "") -> list[tuple[str, KeptCheckpoint]]:
    """(peer id, checkpoint) of `stage` in `records`, the furthest trained first, then the most recently saved."""
    found = [(r.peer_id, k) for r in records if r.peer_id != exclude for k in r.kept if k.stage == stage]
    return sorted(found, key=lambda item: (item[1].progress, item[1].saved_at), reverse=True)


class CheckpointAnnouncer:
    """Keeps this peer's CheckpointRecord in the DHT while it runs (none while it keeps no checkpoint), and its
    checkpoint folder bounded: those of the stages it serves (`served`), and the KEPT_UNSERVED latest others."""

    def __init__(
        self, manifest: Manifest, dht: DHT, peer_id: str, directory: Path | None, served: Callable[[], set[int]]
    ):
        self.manifest, self.dht, self.peer_id, self.directory = manifest, dht, peer_id, directory
        self.served = served
        self.period = max(MIN_PERIOD, manifest.network.announce_period)

    async def announce(self) -> None:
        deleted = await asyncio.to_thread(prune_checkpoints, self.directory, KEPT_UNSERVED, self.served())
        if deleted:
            logger.info(
                f"deleted the oldest checkpoints, of stages {deleted}, to keep {KEPT_UNSERVED} of unserved ones"
            )
        kept = await asyncio.to_thread(kept_checkpoints, self.directory, self.manifest)
        if kept:
            record = CheckpointRecord(self.peer_id, tuple(kept))
            lifetime = announcement_lifetime(self.period)
            await store_checkpoint_record(self.dht, self.manifest.swarm_id, record, lifetime)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.announce()
            except Exception as e:  # a DHT timeout: the next one will do
                logger.debug(f"announcing this peer's checkpoints failed: {e!r}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.period)
            except TimeoutError:
                pass


class CheckpointService(CheckpointRPC):
    """Answers other peers' requests for the state in this peer's checkpoints (`directory`)."""

    def __init__(self, manifest: Manifest, directory: Path | None):
        self.manifest, self.directory = manifest, directory
        self.sending = 0
        self.sent = 0  # checkpoints handed out
        self.bad_requests = 0

    async def rpc_checkpoint(
        self, requests: TypingAsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> TypingAsyncIterator[runtime_pb2.ExpertResponse]:
        caller = str(context.remote_id)
        try:
            request = await asyncio.wait_for(_one_message(requests), timeout=REQUEST_TIMEOUT)
            metadata = decode_metadata(request, self.manifest, caller)
            stage = metadata.get("stage")
            if not _count(stage) or stage >= self.manifest.num_stages:
                raise BadRequestError(f"stage must be an integer from 0 to {self.manifest.num_stages - 1}")
        except (BadRequestError, TimeoutError) as e:
            self.bad_requests += 1
            yield make_error_reply(f"bad checkpoint request: {e}", ErrorCode.BAD_REQUEST)
            return
        if self.sending >= MAX_SENDING:
            yield make_error_reply("this peer is sending other checkpoints; try again later", ErrorCode.BUSY)
            return
        self.sending += 1
        try:
            path = checkpoint_path(self.directory, stage) if self.directory is not None else None
            try:
                if path is None:
                    raise CheckpointError("this peer keeps no checkpoints")
                checkpoint = await asyncio.to_thread(load_checkpoint, path, self.manifest, stage)
            except CheckpointError as e:
                yield make_error_reply(f"no checkpoint of stage {stage} here ({e})", ErrorCode.WRONG_STAGE)
                return
            reply = make_reply([tensor for _, tensor in checkpoint.items])
            names = [name for name, _ in checkpoint.items]
            reply.metadata = pack({"ok": True, "names": names, **checkpoint.counters})
            begin = time.monotonic()
            for part in split_message(reply):
                yield part
            self.sent += 1
            logger.info(
                f"handed the checkpoint of stage {stage} ({checkpoint.optimizer_steps} optimizer steps) to peer "
                f"{caller[-8:]} in {time.monotonic() - begin:.1f}s"
            )
        finally:
            self.sending -= 1


async def _one_message(requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> runtime_pb2.ExpertRequest:
    """The request stream's one message: a longer or larger stream is refused (read to its end, so that the
    refusal arrives)."""
    messages, size = [], 0
    async for message in requests:
        messages.append(message)
        size += message.ByteSize()
        if size > MAX_REQUEST_BYTES or len(messages) > 1:
            raise BadRequestError(f"a checkpoint request is one message of at most {MAX_REQUEST_BYTES} bytes")
    if not messages:
        raise BadRequestError("the request stream was empty")
    return messages[0]
