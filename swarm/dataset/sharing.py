"""Peers hand data to each other: every peer that holds chunks (or the data's index) serves pieces of them to the
swarm's other peers, so that a swarm keeps training when the place its data was published goes offline, and a
popular chunk does not hammer one server.

Both sides are here: `DataService` answers `rpc_piece` (swarm/wire/rpc.py's DataRPC) from what this peer holds,
named by SHA-256, in pieces of at most DATA_PIECE_BYTES, with bounds on what one asker and everyone together may
have in flight (a flood of requests is answered "busy", counted, and costs the peer nothing else); `fetch_from_peer`
asks one peer for a whole file, piece by piece, within a deadline. What a peer sends is verified by the caller like
any other download (swarm/dataset/fetching.py), and a peer that sends wrong bytes is banned there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hivemind.p2p import P2P, P2PContext

from swarm.dataset.cache import full_disk_error
from swarm.errors import BadRequestError, ChunkError
from swarm.manifests.manifest import Manifest
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import make_control_request, make_error_reply, pack, unpack
from swarm.wire.rpc import DATA_PIECE_BYTES, DataRPC, Reply, Request
from swarm.wire.validation import decode_metadata

logger = logging.getLogger(__name__)

MAX_PER_ASKER = 2  # pieces one peer may have in flight here
MAX_IN_FLIGHT = 8  # pieces everyone together may have in flight here
PIECE_TIMEOUT = 30.0  # seconds one piece may take

# what this peer holds: the file (or bytes) whose SHA-256 is the argument, or None
Holdings = Callable[[str], "Path | bytes | None"]


class DataService(DataRPC):
    """Answers other peers' requests for pieces of the data this peer holds (`holdings`, set once the peer has
    opened its data; until then it holds nothing)."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.holdings: Holdings = lambda sha256: None
        self.in_flight: Counter[str] = Counter()
        self.served_bytes = 0
        self.refused_busy = 0  # requests refused because their asker (or everyone) had too many in flight
        self.bad_requests = 0

    async def rpc_piece(self, request: Request, context: P2PContext) -> Reply:
        asker = str(context.remote_id)
        try:
            metadata = decode_metadata(request, self.manifest, asker)
            sha256, offset, length = metadata.get("sha256"), metadata.get("offset"), metadata.get("length")
            if not isinstance(sha256, str) or len(sha256) != 64:
                raise BadRequestError("sha256 must be 64 hex digits")
            if not _count(offset) or not _count(length) or not 0 < length <= DATA_PIECE_BYTES:
                raise BadRequestError(f"offset and length must be integers, 0 < length <= {DATA_PIECE_BYTES}")
        except BadRequestError as e:
            self.bad_requests += 1
            return make_error_reply(str(e), ErrorCode.BAD_REQUEST)
        if self.in_flight[asker] >= MAX_PER_ASKER or sum(self.in_flight.values()) >= MAX_IN_FLIGHT:
            self.refused_busy += 1
            return make_error_reply("too many pieces in flight; ask again later or ask another peer", ErrorCode.BUSY)
        self.in_flight[asker] += 1
        try:
            held = self.holdings(sha256)
            if held is None:
                return make_error_reply("this peer does not hold that file", ErrorCode.BAD_REQUEST)
            data, total = await asyncio.to_thread(_read, held, offset, length)
        except OSError:  # evicted from the cache meanwhile
            return make_error_reply("this peer does not hold that file any more", ErrorCode.BAD_REQUEST)
        finally:
            self.in_flight[asker] -= 1
            if not self.in_flight[asker]:
                del self.in_flight[asker]
        self.served_bytes += len(data)
        return Reply(metadata=pack({"ok": True, "total": total, "data": data}))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read(held: Path | bytes, offset: int, length: int) -> tuple[bytes, int]:
    if isinstance(held, bytes):
        return held[offset : offset + length], len(held)
    with open(held, "rb") as file:
        total = file.seek(0, 2)
        file.seek(min(offset, total))
        return file.read(length), total


async def fetch_from_peer(
    p2p: P2P,
    peer_id: str,
    manifest: Manifest,
    sha256: str,
    size: int | None,
    part: Path,
    on_bytes: Callable[[int], None],
    timeout: float,
    max_size: int = 0,
) -> None:
    """Write the `size` bytes of the file named `sha256` that `peer_id` holds into `part` (not yet verified: the
    caller hashes them), within `timeout` seconds. ChunkError says why not. With `size` None (a data index, whose
    size only its holder knows), the first reply says it, and it may be at most `max_size`."""
    stub = DataRPC.stub(p2p, peer_id)
    proof = manifest.proof(str(p2p.peer_id))
    deadline = time.monotonic() + timeout
    done = 0
    try:
        with open(part, "wb") as out:
            while size is None or done < size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChunkError(f"peer {peer_id[-8:]} sent {done:,} bytes, not all, in {timeout:.0f} s")
                length = DATA_PIECE_BYTES if size is None else min(DATA_PIECE_BYTES, size - done)
                request = make_control_request(manifest, proof, sha256=sha256, offset=done, length=length)
                try:
                    reply = await asyncio.wait_for(stub.rpc_piece(request, timeout=min(left, PIECE_TIMEOUT)), left)
                except TimeoutError:
                    raise ChunkError(f"peer {peer_id[-8:]} did not send a piece in time") from None
                except Exception as e:  # the peer vanished, refused the stream, or its handler failed
                    raise ChunkError(f"peer {peer_id[-8:]} could not be asked: {str(e)[:200]}") from None
                try:
                    metadata = unpack(reply.metadata) if reply.metadata else None
                except Exception:
                    metadata = None
                if not isinstance(metadata, dict):
                    raise ChunkError(f"peer {peer_id[-8:]} sent an unreadable reply")
                if "error" in metadata:
                    raise ChunkError(f"peer {peer_id[-8:]} answered: {str(metadata['error'])[:200]}")
                data, total = metadata.get("data"), metadata.get("total")
                if size is None and isinstance(total, int) and 0 < total <= max_size:
                    size = total
                    length = min(length, size)
                if not isinstance(data, bytes) or total != size or len(data) != length:
                    raise ChunkError(f"peer {peer_id[-8:]} sent a piece that is not of this file")
                out.write(data)
                done += len(data)
                on_bytes(len(data))
    except OSError as e:
        raise full_disk_error(part.parent, e) from None
