"""Calls to other peers: stage calls (forward, backward, train), the bandwidth probe and ping, a stage's state
download, the manifest from a peer, and the swarm's tokenizer from its peers. The calls go through the stubs of
swarm/wire/rpc.py; every reply is checked before use; failures raise RemoteStageError or SwarmError."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import AsyncIterator  # noqa: UP035 (hivemind detects streams by typing.AsyncIterator only)

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.dataset.tokenizer import Tokenizer, load_tokenizer
from swarm.dataset.tokenizer_source import MAX_TOKENIZER_BYTES, cache_folder, local_tokenizer, store
from swarm.errors import ManifestError, RemoteStageError, SwarmError, TokenizerError
from swarm.manifests.loading import MAX_MANIFEST_BYTES
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import parse_manifest
from swarm.throughput import PROBE_BYTES, measure_bandwidth
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import (
    combine_message,
    decode_reply,
    make_control_request,
    needs_stream,
    split_message,
    unpack,
)
from swarm.wire.rpc import TOKENIZER_CHUNK_BYTES, CheckpointRPC, StageRPC
from swarm.wire.state import STATE_COUNTERS
from swarm.wire.tensors import encode_tensor

logger = logging.getLogger(__name__)


async def call_stage(
    p2p: P2P,
    peer_id: str,
    kind: str,
    request: runtime_pb2.ExpertRequest,
    timeout: float,
    reply_elements: int,
) -> runtime_pb2.ExpertResponse:
    """Send one forward or backward request to a stage peer: unary when it fits, by stream otherwise."""
    stub = StageRPC.stub(p2p, peer_id)
    if not needs_stream(request.ByteSize(), reply_elements):
        return await getattr(stub, f"rpc_{kind}")(request, timeout=timeout)

    async def exchange() -> runtime_pb2.ExpertResponse:
        async def parts():
            for part in split_message(request):
                yield part

        replies = await getattr(stub, f"rpc_{kind}_stream")(parts())
        # a reply holds at most the loss and one activation-sized tensor
        reply = await combine_message(replies, runtime_pb2.ExpertResponse, reply_elements * 4 + 4096)
        if not reply.metadata:  # every reply has metadata: the stream ended without one
            raise RemoteStageError(
                "the peer ended the stream without a reply (it may have refused the call)", ErrorCode.INTERNAL
            )
        return reply

    return await asyncio.wait_for(exchange(), timeout=timeout)


async def fetch_manifest(p2p: P2P, peer_id: str, timeout: float) -> str:
    """The manifest (JSON text, not yet validated) of the swarm that `peer_id` serves."""
    stub = StageRPC.stub(p2p, peer_id)
    reply = await asyncio.wait_for(stub.rpc_manifest(runtime_pb2.ExpertRequest(), timeout=timeout), timeout)
    try:
        metadata = unpack(reply.metadata) if len(reply.metadata) < MAX_MANIFEST_BYTES else None
    except ValueError:
        metadata = None
    if isinstance(metadata, dict) and isinstance(metadata.get("error"), str):
        raise RemoteStageError(metadata["error"][:500], ErrorCode.BAD_REQUEST)
    text = metadata.get("manifest") if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        raise RemoteStageError("the peer's reply holds no manifest", ErrorCode.INTERNAL)
    return text


async def fetch_tokenizer(p2p: P2P, peer_id: str, manifest: Manifest, max_bytes: int, timeout: float) -> bytes:
    """The swarm's tokenizer file as `peer_id` holds it (not yet checked against the manifest's hash), in chunks."""
    stub = StageRPC.stub(p2p, peer_id)
    proof = manifest.proof(str(p2p.peer_id))
    body = bytearray()
    expected_total: int | None = None
    deadline = time.monotonic() + timeout
    while True:
        request = make_control_request(manifest, proof, offset=len(body))
        left = deadline - time.monotonic()
        if left <= 0:  # a peer that sends tiny chunks fast cannot keep this loop going
            raise TimeoutError(f"the tokenizer did not arrive within {timeout:g} s ({len(body)} bytes so far)")
        reply = await asyncio.wait_for(stub.rpc_tokenizer(request, timeout=left), left)
        metadata = unpack(reply.metadata) if reply.metadata else {}
        if not isinstance(metadata, dict):
            raise RemoteStageError("the peer sent an unreadable reply", ErrorCode.INTERNAL)
        if "error" in metadata:
            raise RemoteStageError(str(metadata["error"])[:500], ErrorCode.BAD_REQUEST)
        chunk, total = metadata.get("data"), metadata.get("total")
        if not isinstance(chunk, bytes) or not isinstance(total, int) or not 0 < total <= max_bytes:
            raise RemoteStageError("the peer's reply holds no tokenizer chunk", ErrorCode.INTERNAL)
        expected_total = total if expected_total is None else expected_total
        last = len(body) + len(chunk) >= total
        if total != expected_total or (not last and len(chunk) != TOKENIZER_CHUNK_BYTES):
            raise RemoteStageError("the peer's tokenizer chunks do not add up", ErrorCode.INTERNAL)
        body += chunk
        if last:
            if len(body) != total:
                raise RemoteStageError(
                    f"the peer sent {len(body)} bytes of a {total}-byte tokenizer", ErrorCode.INTERNAL
                )
            return bytes(body)


TOKENIZER_PEERS_ASKED = 5  # peers asked for the tokenizer, one after another: a bound on the wait


async def tokenizer_from_peers(p2p, manifest: Manifest, peer_ids: Sequence[str], timeout: float = 60.0) -> Tokenizer:
    """The swarm's tokenizer from the first of `peer_ids` that hands out a copy with the pinned hash (kept in this
    machine's cache: swarm/dataset/tokenizer_source.py)."""
    failures = []
    for peer_id in peer_ids[:TOKENIZER_PEERS_ASKED]:
        logger.info(f"asking peer {peer_id[-8:]} for the swarm's tokenizer (up to {timeout:g} s)")
        try:
            body = await fetch_tokenizer(p2p, peer_id, manifest, MAX_TOKENIZER_BYTES, timeout)
            return load_tokenizer(store(body, manifest.data.tokenizer_sha256))
        except Exception as e:  # refused, gone, too slow, or a wrong file: ask the next peer
            failures.append(f"{peer_id[-8:]}: {str(e)[:200]}")
    raise TokenizerError(
        f"no copy of the swarm's tokenizer {manifest.data.tokenizer!r} (sha256 {manifest.data.tokenizer_sha256[:16]}"
        f"...): it is neither next to the manifest nor in {cache_folder()}, and "
        + (f"no peer handed it out ({'; '.join(failures[:3])})" if failures else "no peer was found to ask")
        + ". Put the swarm's tokenizer.json next to the manifest."
    )


async def swarm_tokenizer(p2p, manifest: Manifest, peer_ids: Sequence[str], timeout: float = 60.0) -> Tokenizer:
    """The swarm's tokenizer: from this machine or next to the manifest, else from the first of `peer_ids`."""
    local = local_tokenizer(manifest)
    return local if local is not None else await tokenizer_from_peers(p2p, manifest, peer_ids, timeout)


async def manifest_from_peer(p2p: P2P, maddr: str) -> Manifest:
    """The validated manifest of the swarm that the peer at `maddr` (a multiaddr with /p2p/<id>) serves."""
    try:
        return parse_manifest(await fetch_manifest(p2p, maddr.rsplit("/p2p/", 1)[1], timeout=15.0), origin="it")
    except ManifestError as e:
        raise ManifestError(f"the peer at {maddr} sent a manifest that is not valid: {e}") from None
    except RemoteStageError as e:  # e.g. a private swarm's peer, which does not hand its manifest out
        raise SwarmError(f"the peer at {maddr} did not hand out its manifest: {e}") from None
    except Exception as e:  # not a swarm peer, gone, or too slow
        raise SwarmError(
            f"could not get the manifest from the peer at {maddr} ({type(e).__name__}: {str(e)[:200]}); is it a "
            "running swarm-peer? Or join with the manifest's path or URL"
        ) from None


async def probe_bandwidth(p2p: P2P, peer_id: str, manifest: Manifest, timeout: float = 20.0) -> tuple[float, float]:
    """(download, upload) bytes per second between this peer and `peer_id`, measured with probe calls."""
    stub = StageRPC.stub(p2p, peer_id)

    async def exchange(upload_bytes: int, download_bytes: int) -> None:
        request = make_control_request(manifest, manifest.proof(str(p2p.peer_id)), reply_bytes=download_bytes)
        if upload_bytes:
            request.tensors.append(encode_tensor(torch.zeros(upload_bytes // 4)))
        decode_reply(await stub.rpc_probe(request, timeout=timeout), PROBE_BYTES // 4)

    return await asyncio.wait_for(measure_bandwidth(exchange), timeout=4 * timeout)


async def ping(p2p: P2P, peer_id: str, manifest: Manifest, timeout: float = 5.0) -> float:
    """The round trip to `peer_id` in seconds: an empty bandwidth probe (its reply carries no payload)."""
    stub = StageRPC.stub(p2p, peer_id)
    request = make_control_request(manifest, manifest.proof(str(p2p.peer_id)), reply_bytes=0)
    begin = time.monotonic()
    decode_reply(await stub.rpc_probe(request, timeout=timeout), 1)
    return time.monotonic() - begin


TRUNCATED_STATE_ATTEMPTS = 3
STATE_STALL_TIMEOUT = 30.0  # seconds without a byte of a state download: its sender is gone
STATE_PROGRESS_EVERY = 15.0  # seconds between the progress lines of a long state download
MIN_STATE_RATE = 1_000_000  # bytes/s (8 Mbit/s) that state_deadline allows a download at the least


def state_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """The float32 bytes of a state of `shapes` (swarm.wire.state's names and shapes)."""
    return sum(4 * math.prod(shape) for shape in shapes.values())


def state_deadline(shapes: dict[str, tuple[int, ...]], floor: float) -> float:
    """Seconds a state download of `shapes` may take in all: `floor`, plus its bytes at MIN_STATE_RATE (a stage of
    a large model is gigabytes: minutes over a home uplink). A sender that vanishes is noticed sooner, by the
    stall deadline."""
    return floor + state_bytes(shapes) / MIN_STATE_RATE


async def _watched(parts: AsyncIterator, what: str, expected: int, stall: float) -> AsyncIterator:
    """`parts`, with a TimeoutError when none comes for `stall` seconds and a progress line every
    STATE_PROGRESS_EVERY seconds (a download of gigabytes takes minutes: the peer's owner sees it move)."""
    received, begin = 0, time.monotonic()
    said = begin
    iterator = parts.__aiter__()
    while True:
        try:
            part = await asyncio.wait_for(iterator.__anext__(), stall)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise TimeoutError(f"{what}: nothing came for {stall:g} s after {received / 2**20:.1f} MiB") from None
        received += part.ByteSize()
        now = time.monotonic()
        if now - said >= STATE_PROGRESS_EVERY:
            said, rate = now, received / (now - begin)
            left = f", about {(expected - received) / rate:.0f} s left" if rate > 0 and expected > received else ""
            logger.info(
                f"{what}: {received / 2**20:.0f} of {expected / 2**20:.0f} MiB in {now - begin:.0f} s "
                f"({rate * 8 / 1e6:.1f} Mbit/s{left})"
            )
        yield part


async def download_state(
    p2p: P2P,
    peer_id: str,
    manifest: Manifest,
    stage: int,
    shapes: dict[str, tuple[int, ...]],
    timeout: float,
    stall: float = STATE_STALL_TIMEOUT,
    from_checkpoint: bool = False,
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, int]]:
    """Fetch the state of `stage` from `peer_id` within `timeout` seconds (and with no gap of `stall` seconds):
    named tensors (not yet checked against the model, see StageServer.load_state; `shapes` are the names it may
    hold, from swarm.wire.state) and its counters (optimizer_steps, averaging_round). Raises RemoteStageError on a
    refusal or a malformed reply, TimeoutError when late. A long one logs its progress. `from_checkpoint`: the
    state the peer keeps in its checkpoint of the stage (swarm/server/checkpoint_sharing.py), served or not."""
    max_bytes = state_bytes(shapes) + 64 * len(shapes) + 65536
    request = make_control_request(manifest, manifest.proof(str(p2p.peer_id)), stage=stage)
    what = f"{'checkpoint' if from_checkpoint else 'state'} of stage {stage} from peer {peer_id[-8:]}"
    if from_checkpoint:
        call = CheckpointRPC.stub(p2p, peer_id).rpc_checkpoint
    else:
        call = StageRPC.stub(p2p, peer_id).rpc_download_state

    async def one_request() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield request

    async def fetch() -> runtime_pb2.ExpertResponse:
        parts = _watched(await call(one_request()), what, max_bytes, min(stall, timeout))
        return await combine_message(parts, runtime_pb2.ExpertResponse, max_bytes, max_tensors=len(shapes))

    largest = max(math.prod(shape) for shape in shapes.values())
    for attempt in range(1, TRUNCATED_STATE_ATTEMPTS + 1):
        reply = await asyncio.wait_for(fetch(), timeout=timeout)
        tensors = decode_reply(reply, max(largest, 1))  # raises RemoteStageError for an error reply
        metadata = unpack(reply.metadata)  # decode_reply read it already: it is a dict
        names = metadata.get("names")
        # a hivemind stream that breaks ends like one that is complete: fewer tensors than names means cut short
        if isinstance(names, list) and len(names) > len(tensors) and attempt < TRUNCATED_STATE_ATTEMPTS:
            logger.info(f"the state from {peer_id} came cut short ({len(tensors)} of {len(names)}); asking again")
            continue
        break
    if not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names):
        raise RemoteStageError("the state's names do not match its tensors", ErrorCode.INTERNAL)
    counters = {}
    for key in STATE_COUNTERS:
        value = metadata.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 2**53:
            raise RemoteStageError(f"the state's {key} is not a count", ErrorCode.INTERNAL)
        counters[key] = value
    return list(zip(names, tensors)), counters
