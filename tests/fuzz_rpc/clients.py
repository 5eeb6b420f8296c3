"""The fuzzing clients: identities (each a hivemind P2P daemon with a key of its own) that send the cases, rotated
before a peer could ban them, and the checks every reply must pass: a well-formed reply (an error reply carries a
message and a known code, never 'internal'), hivemind's refusal of bytes it cannot parse, or a closed stream;
never a hang."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from conftest import LOOPBACK
from fuzzing import CASES, FORWARD_TIMEOUT, LOST, MANIFEST
from swarm.manifests.validation import parse_manifest
from swarm.trust.bans import BAD_REQUESTS_BEFORE_BAN
from swarm.wire import codes

from .messages import END_OF_STREAM, might_change_weights

CALL_TIMEOUT = 10.0  # a reply later than this is a hang
STREAM_WAIT = FORWARD_TIMEOUT + 7.0  # an endless stream must be answered (or closed) by then
STRIKES_PER_IDENTITY = BAD_REQUESTS_BEFORE_BAN - 2  # bad requests an identity sends before it is replaced
IDENTITY_BATCH = 6
# outcomes after which the peer does not count a bad request against the sender
NOT_COUNTED = {"ok", "busy", "unknown_microbatch", "wrong_stage", "unparsed", "downstream_failed"}


def stage_outcome(reply: runtime_pb2.ExpertResponse, banned_ok: bool = False) -> str:
    """'ok' or the error code of a StageServer reply, after checking that it is well formed."""
    try:
        meta = MSGPackSerializer.loads(reply.metadata)
    except Exception as e:
        raise AssertionError(f"the reply's metadata is not msgpack: {reply.metadata[:100]!r}") from e
    assert isinstance(meta, dict), f"the reply's metadata is not a dictionary: {meta!r}"
    if "error" not in meta:
        assert meta.get("ok") is True, meta
        return "ok"
    message, code = meta["error"], meta.get("code")
    assert isinstance(message, str) and len(message) >= 10, f"an unclear error message: {meta!r}"
    assert code in set(codes.ErrorCode), f"an unknown error code: {meta!r}"
    assert not reply.tensors, "an error reply with tensors"
    assert code != "internal", f"hostile input reached the model (validation missed it): {message}"
    assert banned_ok or code != "banned", f"banned: this test's identity rotation failed ({message})"
    return code


def is_parse_refusal(error: Exception) -> bool:
    """hivemind's answer when the request bytes are not the handler's protobuf (it never reaches the handler)."""
    return "DecodeError" in str(error)


@dataclass
class StreamResult:
    replies: list[runtime_pb2.ExpertResponse] = field(default_factory=list)
    rpc_errors: list[str] = field(default_factory=list)  # hivemind's error frames: a handler raised
    seconds: float = 0.0


T = TypeVar("T")


class Clients:
    """Client identities, each a hivemind P2P daemon with a key of its own, on an event loop in a thread of its
    own (so that they live across tests). The fuzz cases go out from the current identity, which is replaced
    before it has sent enough bad requests to be banned."""

    def __init__(self, targets: dict[int, str], maddrs: list[str]):
        self.targets = {stage: PeerID.from_base58(peer_id) for stage, peer_id in targets.items()}
        self.maddrs = maddrs
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-clients", daemon=True)
        self.thread.start()
        self.all: list[P2P] = []
        self.spare: list[P2P] = []
        self.batches: list[concurrent.futures.Future[list[P2P]]] = []
        self.current: P2P | None = None
        self.check_alive: Callable[[], None] = lambda: None  # set by the fixture: after every case
        self.strikes: collections.Counter[int] = collections.Counter()  # bad requests sent, by peer (stage)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no answer within {timeout:g} s (a hang)") from None

    async def _create(self, count: int) -> list[P2P]:
        # without relays, NAT tricks or a DHT of their own: they only call the two peers
        options = dict(use_relay=False, auto_nat=False, nat_port_map=False, dht_mode="client")
        created = await asyncio.gather(
            *[P2P.create(initial_peers=self.maddrs, host_maddrs=[LOOPBACK], **options) for _ in range(count)]
        )
        self.all.extend(created)
        return list(created)

    def prefetch(self) -> None:
        """Start creating the next identities in the background."""
        self.batches.append(asyncio.run_coroutine_threadsafe(self._create(IDENTITY_BATCH), self.loop))

    def fresh(self) -> P2P:
        """An identity that has sent nothing yet. They are created several at a time (daemons start faster
        together), the next batch while the last of the current one is in use."""
        if not self.spare:
            if not self.batches:
                self.prefetch()
            self.spare = self.batches.pop(0).result(90)
        if len(self.spare) == 1 and not self.batches:
            self.prefetch()
        return self.spare.pop()

    def identity(self, stage: int, room: int = 1) -> P2P:
        """The identity for the next `room` cases to `stage`: the current one, unless that peer could then ban it
        (each peer counts bad requests on its own)."""
        if self.current is None or self.strikes[stage] + room > STRIKES_PER_IDENTITY:
            if self.current is not None:
                self.retire(self.current)
            self.current, self.strikes = self.fresh(), collections.Counter()
        return self.current

    def retire(self, p2p: P2P) -> None:
        asyncio.run_coroutine_threadsafe(p2p.shutdown(), self.loop)

    def close(self) -> None:
        async def shutdown_all() -> None:
            await asyncio.gather(*[p2p.shutdown() for p2p in self.all if p2p.is_alive], return_exceptions=True)
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:  # e.g. a stream still waiting for an answer: done with, quietly
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        print(f"\nfuzz: {len(self.all)} client identities")
        try:
            self.run(shutdown_all(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()

    # ------------------------------------------------------------------------------ one case of each kind

    def unary(self, stage: int, name: str, data: bytes, kind: str, expect: set[str] | None = None) -> str:
        """Send raw bytes to a unary StageServer handler; 'unparsed' if hivemind refused them as not a request."""
        assert not might_change_weights(data, name, stage), f"{kind}: this case would train"
        p2p = self.identity(stage)
        try:
            raw = self.run(p2p._client.call_unary_handler(self.targets[stage], name, data))
        except AssertionError:
            raise
        except Exception as e:
            assert is_parse_refusal(e), f"{kind}: the handler raised instead of replying: {e!r}"
            outcome = "unparsed"
        else:
            outcome = stage_outcome(runtime_pb2.ExpertResponse.FromString(raw))
        self._count(stage, kind, outcome, expect)
        return outcome

    def stream(
        self,
        stage: int,
        name: str,
        chunks: list[bytes],
        kind: str,
        expect: set[str] | None = None,
        ending: str = "message",
        p2p: P2P | None = None,
    ) -> str:
        """Write raw bytes to a stream handler; the outcome of its reply, or 'closed' if it closed the stream
        without one. Fails if it neither answers nor closes within STREAM_WAIT seconds. A reply that is expected
        but lost is asked for once more (and counted): see test_a_stream_refused_midway_still_gets_its_reply."""
        for attempt in range(2):
            sender = self.identity(stage) if p2p is None else p2p
            coroutine = open_stream(sender, self.targets[stage], name, chunks, ending, STREAM_WAIT)
            outcome = stream_outcome(self.run(coroutine, STREAM_WAIT + 5), kind, banned_ok=p2p is not None)
            if outcome != "closed" or expect is None or "closed" in expect or attempt == 1:
                break
            LOST["stream replies lost, then asked again"] += 1
            self.strikes[stage] += 1
        if p2p is None:
            self._count(stage, kind, outcome, expect)
        elif expect is not None:
            assert outcome in expect, f"{kind}: {outcome}, expected {sorted(expect)}"
        return outcome

    def _count(self, stage: int, kind: str, outcome: str, expect: set[str] | None) -> None:
        self.check_alive()
        assert expect is None or outcome in expect, f"{kind}: {outcome}, expected {sorted(expect)}"
        if outcome not in NOT_COUNTED:
            self.strikes[stage] += 1
        CASES[kind.split(":")[0]] += 1


async def open_stream(p2p: P2P, peer: PeerID, name: str, chunks: list[bytes], ending: str, wait: float) -> StreamResult:
    """Open a stream to a handler, write `chunks`, then end it with hivemind's end-of-stream message ('message'),
    by closing our side ('eof'), or not at all ('none'); read every reply frame until the peer closes it."""
    started = time.monotonic()
    _, reader, writer = await p2p.call_binary_stream_handler(peer, name)
    result = StreamResult()

    async def write() -> None:
        try:
            for chunk in chunks + ([END_OF_STREAM] if ending == "message" else []):
                writer.write(chunk)
                await writer.drain()
            if ending == "eof":
                writer.write_eof()
        except ConnectionError:  # the peer closed the stream while we wrote: it is done with it
            pass

    async def read() -> None:
        while True:
            try:
                reply, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if error is not None:
                result.rpc_errors.append(error.message)
            else:
                result.replies.append(reply)

    # read while writing, as hivemind's clients do: a peer may answer (and close) before it has read everything
    writing = asyncio.create_task(write())
    try:
        await asyncio.wait_for(read(), wait)
    except TimeoutError:
        raise AssertionError(f"{name}: neither a reply nor a closed stream within {wait:g} s") from None
    finally:
        writing.cancel()
        writer.close()
    result.seconds = time.monotonic() - started
    return result


def stream_outcome(result: StreamResult, kind: str, banned_ok: bool = False) -> str:
    assert not result.rpc_errors, f"{kind}: the handler raised instead of replying: {result.rpc_errors}"
    if not result.replies:
        return "closed"
    return stage_outcome(result.replies[0], banned_ok=banned_ok)  # the first part carries the reply's metadata


def unparsed_or_reply(clients: Clients, stage: int, name: str, data: bytes) -> runtime_pb2.ExpertResponse | None:
    """Raw bytes to a handler whose replies are not stage replies: its reply, or None if hivemind refused them."""
    try:
        raw = clients.run(clients.identity(stage)._client.call_unary_handler(clients.targets[stage], name, data))
    except AssertionError:
        raise
    except Exception as e:
        assert is_parse_refusal(e), f"{name}: the handler raised instead of replying: {e!r}"
        return None
    return runtime_pb2.ExpertResponse.FromString(raw)


def check_manifest_reply(reply: runtime_pb2.ExpertResponse | None) -> None:
    """rpc_manifest takes nothing from the request: whatever parses gets the swarm's manifest."""
    if reply is not None:
        meta = MSGPackSerializer.loads(reply.metadata)
        assert parse_manifest(meta["manifest"]).swarm_id == MANIFEST.swarm_id
    CASES["rpc_manifest"] += 1


def check_reachability_reply(reply: runtime_pb2.ExpertResponse | None) -> dict | None:
    """rpc_check answers a verdict (True, False or None: cannot tell) and why."""
    CASES["rpc_check"] += 1
    if reply is None:
        return None
    meta = MSGPackSerializer.loads(reply.metadata)
    assert isinstance(meta, dict) and meta.get("reachable") in (True, False, None), meta
    assert isinstance(meta.get("error"), str) and isinstance(meta.get("seconds"), float), meta
    return meta


def call(clients: Clients, p2p: P2P, stage: int, name: str, request: runtime_pb2.ExpertRequest) -> str:
    """A unary call from a given identity; its outcome, 'banned' included."""
    raw = clients.run(p2p._client.call_unary_handler(clients.targets[stage], name, request.SerializeToString()))
    return stage_outcome(runtime_pb2.ExpertResponse.FromString(raw), banned_ok=True)


async def send_then_read(p2p: P2P, peer: PeerID, name: str, chunks: list[bytes]) -> list[runtime_pb2.ExpertResponse]:
    """A client that writes its whole request stream, then reads the replies."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, name)
    try:
        for chunk in chunks + [END_OF_STREAM]:
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    await asyncio.sleep(0.2)
    replies = []
    try:
        while True:
            reply, _ = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            replies.append(reply)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
    return replies
