"""Fuzz tests of the RPC entry points: hostile input at every handler of real peer processes.

They start one peer per stage of a 2-stage tiny swarm (stage 0 takes int64 tokens, stage 1, the last, takes
[hidden states, targets]) and send every handler garbage bytes, truncated and corrupted protobufs, bad metadata,
bad tensors, broken and endless streams, and floods, from client identities in this process (each a hivemind P2P
daemon of its own). For every case: a well-formed reply comes back (an error reply carries a message and a known
code, never 'internal'), or hivemind refuses bytes it cannot parse, or the stream is closed; never a hang. The
peers stay up; afterwards a valid request from a fresh identity is served, their parameters are exactly as
before (no case may train: none is a valid training request) and their memory stayed bounded.

The peers ban a sender after BAD_REQUESTS_BEFORE_BAN bad requests, so the cases rotate identities before that;
test_a_client_that_keeps_sending_bad_requests_is_banned checks the ban itself.

The tests share one swarm and run in file order, in one process (one xdist group): the check that the peers are
unchanged comes after every case, and the two cases that may leave a peer's memory high or a peer dead last.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import math
import random
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from conftest import LOOPBACK, PeerProcess
from fuzzing import CASES, FIRST, FORWARD_TIMEOUT, LAST, LOST, MANIFEST, RAW_MANIFEST, print_case_counts  # noqa: F401
from peers import processes
from swarm import PROTOCOL_VERSION
from swarm.client.rpc import download_state
from swarm.errors import BadRequestError
from swarm.manifests.manifest import manifest_from_dict, parse_manifest
from swarm.server.reachability import NAMESPACE as REACHABILITY_NAMESPACE
from swarm.server.service import NAMESPACE, StageService
from swarm.server.stage_state import stage_state_shapes
from swarm.trust.bans import BAD_REQUESTS_BEFORE_BAN
from swarm.wire import protocol

# one swarm for the whole file, in file order: every test of the file in the same worker process
pytestmark = pytest.mark.xdist_group("fuzz_rpc")
integration = pytest.mark.integration

WIDTH, VOCAB = MANIFEST.model.width, MANIFEST.model.vocab_size
BATCH, LENGTH = 2, 8  # of the valid requests: small, so that thousands of them cost little
CALL_TIMEOUT = 10.0  # a reply later than this is a hang
STREAM_WAIT = FORWARD_TIMEOUT + 7.0  # an endless stream must be answered (or closed) by then
STRIKES_PER_IDENTITY = BAD_REQUESTS_BEFORE_BAN - 2  # bad requests an identity sends before it is replaced
IDENTITY_BATCH = 6
# of a peer's process group over all the cases: its p2pd daemon grows by some 30 MiB and a reachability check starts
# a probe daemon (60 MiB, kept for later checks); the peer's own process, by a few MiB
RSS_GROWTH_LIMIT = 256 * 2**20

NONE = runtime_pb2.CompressionType.NONE
FLOAT16 = runtime_pb2.CompressionType.FLOAT16
UNIFORM_8BIT = runtime_pb2.CompressionType.UNIFORM_8BIT
COMPRESSION_VALUES = [value for _, value in runtime_pb2.CompressionType.items()] + [6, 127, 12345]
DTYPES = ["float32", "int64", "float16", "float64", "bfloat16", "int32", "int8", "uint8", "bool", "", "evil"]


def handle_name(servicer: type, namespace: str, method: str) -> str:
    """A handler's protocol name, as hivemind's ServicerBase names it."""
    return f"{namespace}::{servicer.__name__}.{method}"


FORWARD = handle_name(StageService, NAMESPACE, "rpc_forward")
BACKWARD = handle_name(StageService, NAMESPACE, "rpc_backward")
FORWARD_STREAM = handle_name(StageService, NAMESPACE, "rpc_forward_stream")
BACKWARD_STREAM = handle_name(StageService, NAMESPACE, "rpc_backward_stream")
TRAIN = handle_name(StageService, NAMESPACE, "rpc_train")
PROBE = handle_name(StageService, NAMESPACE, "rpc_probe")
DOWNLOAD_STATE = handle_name(StageService, NAMESPACE, "rpc_download_state")
MANIFEST_RPC = handle_name(StageService, NAMESPACE, "rpc_manifest")
TOKENIZER_RPC = handle_name(StageService, NAMESPACE, "rpc_tokenizer")
CHECK = f"{REACHABILITY_NAMESPACE}::ReachabilityService.rpc_check"
STAGE_UNARY = (FORWARD, BACKWARD, PROBE)
# outcomes after which the peer does not count a bad request against the sender
NOT_COUNTED = {"ok", "busy", "unknown_microbatch", "wrong_stage", "unparsed", "downstream_failed"}

# ------------------------------------------------------------------------------------------ requests


def metadata(**fields: Any) -> dict:
    """Valid request metadata for this swarm (a request that does not train), with `fields` changed."""
    valid = {"swarm_id": MANIFEST.swarm_id, "protocol_version": PROTOCOL_VERSION, "stage": LAST, "train": False}
    return {**valid, "microbatch_id": "fuzz", **fields}


DELETE = object()  # a field of metadata_fields() that is removed


def make_request(tensors: list, meta: dict | bytes | None = None) -> runtime_pb2.ExpertRequest:
    """A request of serialized tensors (torch tensors are encoded as float32 activations and int64 tokens)."""
    protos = [t if isinstance(t, runtime_pb2.Tensor) else protocol.encode_tensor(t) for t in tensors]
    meta = metadata() if meta is None else meta
    raw = meta if isinstance(meta, bytes) else packb(meta)
    return runtime_pb2.ExpertRequest(tensors=protos, metadata=raw)


def hidden(batch: int = BATCH, length: int = LENGTH, width: int = WIDTH, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed))


def tokens(batch: int = BATCH, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def valid_forward(stage: int, train: bool = False, microbatch_id: str = "fuzz") -> runtime_pb2.ExpertRequest:
    tensors = [tokens()] if stage == FIRST else [hidden(), tokens()]
    return make_request(tensors, metadata(stage=stage, train=train, microbatch_id=microbatch_id))


def raw_tensor(dtype: str, size: list[int], buffer: bytes, compression: int = NONE, **kw: Any) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(dtype=dtype, size=size, buffer=buffer, compression=compression, **kw)


def might_change_weights(data: bytes, method: str, stage: int) -> bool:
    """Whether the peer might apply this request to its weights: a valid training forward (on stage 0 its cached
    activations would let a later backward apply), or a valid backward with inputs on stage 0. Such cases are
    never sent, so that the peers' parameters must stay exactly as they were. A train request (forwarding) that
    trains and whose metadata is valid is assumed to change them."""
    if method == TRAIN:
        try:
            meta = protocol.decode_metadata(runtime_pb2.ExpertRequest.FromString(data), MANIFEST, sender="fuzz")
            return protocol.decode_fields(meta, MANIFEST).train
        except Exception:
            return False
    if method not in (FORWARD, BACKWARD) or (method == BACKWARD and stage == LAST):
        return False
    try:
        request = runtime_pb2.ExpertRequest.FromString(data)
    except Exception:  # hivemind cannot parse it either: it never reaches the peer's code
        return False
    try:  # (any other exception, e.g. a new signature, fails the case loudly instead of letting it through)
        req = protocol.decode_request(request, MANIFEST, protocol.max_request_elements(MANIFEST), sender="fuzz")
    except BadRequestError:
        return False
    if req.stage != stage:
        return False
    try:
        if method == FORWARD:
            if not req.train or len(req.tensors) != (2 if stage == LAST else 1):
                return False
            protocol.check_inputs(req.tensors[0], MANIFEST, stage)
            if stage == LAST:
                protocol.check_targets(req.tensors[1], req.tensors[0], VOCAB)
            return True
        if len(req.tensors) != 2:  # without inputs: refused, as no identity reuses a cached microbatch id
            return False
        inputs = req.tensors[1]
        protocol.check_inputs(inputs, MANIFEST, stage)
        protocol.check_grad(req.tensors[0], (*inputs.shape[:2], WIDTH))
        return True
    except BadRequestError:
        return False
    except Exception:  # e.g. a tensor the checks choke on: assume the worst
        return True


# ------------------------------------------------------------------------------------------ replies


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
    assert code in protocol.ERROR_CODES, f"an unknown error code: {meta!r}"
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


def frame(payload: bytes, marker: bytes = P2P.MESSAGE_MARKER) -> bytes:
    """One message of hivemind's stream format: a marker byte, an 8-byte length, the payload."""
    return marker + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


END_OF_STREAM = frame(b"", P2P.ERROR_MARKER)  # hivemind ends a request stream with an empty error message


# ------------------------------------------------------------------------------------------ clients

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


# ------------------------------------------------------------------------------------------ the peers


def group_rss(pgid: int) -> int:
    """Bytes of resident memory of a peer's processes (the peer, its DHT process, its p2pd daemons)."""
    return round(sum(processes.memory_mb(pgid).values()) * 2**20)


def memory_report(pgid: int) -> dict[str, int]:
    return {name: round(mb) for name, mb in processes.memory_mb(pgid).items()}


def state_shapes(stage: int) -> dict[str, tuple[int, ...]]:
    return stage_state_shapes(MANIFEST, stage)


@dataclass
class Swarm:
    peers: dict[int, PeerProcess]
    ids: dict[int, str]
    clients: Clients
    shapes: dict[int, dict[str, tuple[int, ...]]]
    states: dict[int, list[tuple[str, torch.Tensor]]]  # at the start
    rss: dict[int, int]  # at the start, after one valid request each

    def alive(self) -> None:
        for stage, peer in self.peers.items():
            assert peer.process.poll() is None, f"the stage {stage} peer exited:\n{peer.output()[-3000:]}"

    def state(self, stage: int, p2p: P2P) -> list[tuple[str, torch.Tensor]]:
        coroutine = download_state(p2p, self.ids[stage], MANIFEST, stage, self.shapes[stage], timeout=CALL_TIMEOUT)
        items, _ = self.clients.run(coroutine, CALL_TIMEOUT + 5)
        return items

    def served(self, stage: int, p2p: P2P) -> runtime_pb2.ExpertResponse:
        """A valid (non-training) forward from `p2p`; asserts that it is served."""
        data = valid_forward(stage).SerializeToString()
        raw = self.clients.run(p2p._client.call_unary_handler(self.clients.targets[stage], FORWARD, data))
        reply = runtime_pb2.ExpertResponse.FromString(raw)
        assert stage_outcome(reply) == "ok"
        return reply


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """One peer per stage (--no-trainer, so nothing but a request could change their weights), each a swarm of
    its own so that both start at once; clients reach them directly."""
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "manifest.json"
    path.write_text(json.dumps(RAW_MANIFEST))
    peers: dict[int, PeerProcess] = {}
    clients: Clients | None = None
    try:
        for stage in (FIRST, LAST):
            # as the start_peer fixture does; a stated throughput and bandwidth skip the measurements
            args = [*processes.loopback_args(path, stage, trainer=False), "--duration", "900"]
            args += ["--throughput", "100", "--bandwidth", "1000"]
            peers[stage] = processes.start_peer(args, folder / f"peer{stage}.log", cache_dir=folder / "cache")
        ids = {stage: peer.peer_id(timeout=90) for stage, peer in peers.items()}
        clients = Clients(ids, [peer.maddr() for peer in peers.values()])
        clients.prefetch()  # while the peers build their models
        for peer in peers.values():
            peer.wait_for("serving stage", timeout=90)
        shapes = {stage: state_shapes(stage) for stage in peers}
        swarm = Swarm(peers, ids, clients, shapes, {}, {})
        clients.check_alive = swarm.alive
        first = clients.identity(FIRST)
        for stage in peers:
            swarm.states[stage] = swarm.state(stage, first)
            swarm.served(stage, first)
            swarm.rss[stage] = group_rss(peers[stage].pgid)
            print(f"\nstage {stage}: memory at the start (MiB): {memory_report(peers[stage].pgid)}")
        BACKGROUND["stalled download"] = start_stalled_download(clients)  # checked by a later test, done by then
        yield swarm
    finally:
        if clients is not None:
            clients.close()
        processes.stop_peers(list(peers.values()))  # all at once: each takes seconds


# ------------------------------------------------------------------------------------------ hostile inputs


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def nested_tuples(depth: int) -> bytes:
    """A msgpack tuple (hivemind's extension type 0x40) nested `depth` deep: each level is a few bytes."""
    payload = packb([])
    for _ in range(depth):
        payload = packb([msgpack.ExtType(0x40, payload)])
    return packb({"swarm_id": msgpack.ExtType(0x40, payload)})


def metadata_garbage() -> list[tuple[str, bytes]]:
    """Metadata that is not msgpack, not a dictionary, or msgpack meant to hurt a decoder."""
    return [
        ("empty", b""),
        ("a byte msgpack never uses", b"\xc1"),
        ("a truncated map", b"\x85\xa8swarm_id"),
        ("two objects", packb(metadata()) + b"\x01"),
        ("a list", packb([1, 2, 3])),
        ("an integer", packb(7)),
        ("the swarm id alone", packb(MANIFEST.swarm_id)),
        ("nil", packb(None)),
        ("bytes", packb(b"\x00" * 16)),
        ("NaN", packb(float("nan"))),
        ("arrays nested 100000 deep", b"\x91" * 100_000 + b"\xc0"),
        ("maps nested 100000 deep", b"\x81\xc0" * 100_000 + b"\xc0"),
        ("an unknown extension type", packb({"swarm_id": msgpack.ExtType(5, b"xyz")})),
        (
            "a DHT dictionary extension",
            packb({"stage": msgpack.ExtType(80, packb([2**62, 0.0, [[b"k", b"v", 1e300]]]))}),
        ),
        ("a garbage DHT dictionary extension", packb({"stage": msgpack.ExtType(80, b"\xc1")})),
        ("a tensor descriptor extension", packb({"stage": msgpack.ExtType(81, packb({"dtype": "evil"}))})),
        ("an array declaring 4 billion items", b"\xdd\xff\xff\xff\xff"),
        ("a string declaring 4 GB", b"\xdb\xff\xff\xff\xffx"),
        ("a map declaring 4 billion pairs", b"\xdf\xff\xff\xff\xff"),
        ("an extension declaring 4 GB", b"\xc9\xff\xff\xff\xff\x05"),
        ("a map with a list key", b"\x81\x91\x01\x01"),
        ("a string that is not UTF-8", b"\x81\xa8swarm_id\xa3\xff\xfe\xfd"),
    ]


def metadata_fields(stage: int, rng: random.Random) -> list[tuple[str, dict, bool | None]]:
    """(label, metadata, valid) with one field of a wrong type or value, or odd but valid (valid is None: an
    optional field the peer may check or ignore). Never a missing `train`: its default is True."""
    other = manifest_from_dict({**RAW_MANIFEST, "name": "another-swarm"}).swarm_id
    values: dict[str, list[Any]] = {
        "swarm_id": [DELETE, None, 0, b"bytes", other, MANIFEST.swarm_id.upper(), MANIFEST.swarm_id + " ", "é" * 16]
        + ["x" * 100_000, [MANIFEST.swarm_id], {"id": MANIFEST.swarm_id}],
        "protocol_version": [DELETE, None, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 0, -1, 2**64 - 1, -(2**63)]
        + [str(PROTOCOL_VERSION), float("nan"), [PROTOCOL_VERSION], True],
        "stage": [DELETE, None, -1, 2, 2**63 - 1, -(2**63), 2**64 - 1, True, False, str(stage), float(stage)]
        + [float("inf"), [stage], {"stage": stage}],
        "microbatch_id": [DELETE, None, "", "x" * 65, "x" * 100_000, 5, b"bytes", ["a"], "\x00" * 10, "\u202e" * 64]
        + ["🙂" * 65],
        "train": [None, 0, 1, "false", "", [], {}, float("nan")],
        "proof": [None, b"\x00" * 64, rng.randbytes(1000), "x" * 1000, {"nested": [1, 2, {"deep": None}]}],
    }
    odd_but_valid = ["\x00" * 10, "\u202e" * 64]
    cases = []
    for key, options in values.items():
        for value in options:
            label = "deleted" if value is DELETE else repr(value)[:40]
            meta = metadata(stage=stage)
            if value is DELETE:
                del meta[key]
            else:
                meta[key] = value
            valid = None if key == "proof" else key == "microbatch_id" and value in odd_but_valid
            cases.append((f"{key} {label}", meta, valid))
    return cases


def uniform_8bit(codes: torch.Tensor, numel: int) -> bytes:
    """The buffer of hivemind's 8-bit format: codebook length, 256 float32 codes, one byte per element."""
    return (256).to_bytes(8, "little") + codes.numpy().tobytes() + bytes(numel)


def with_value(tensor: torch.Tensor, value: float, everywhere: bool = False) -> torch.Tensor:
    tensor = tensor.clone()
    if everywhere:
        tensor.fill_(value)
    else:
        tensor.view(-1)[len(tensor.view(-1)) // 2] = value
    return tensor


def alternating(value: float, shape: tuple[int, ...]) -> torch.Tensor:
    """±value, alternately: every value finite and huge, their sum 0 (it passes the cheap finiteness check)."""
    signs = torch.ones(math.prod(shape))
    signs[1::2] = -1
    return (signs * value).reshape(shape)


def header_cases() -> list[tuple[str, runtime_pb2.Tensor]]:
    """Serialized tensors with headers that lie: dtypes, compressions, sizes, buffers (in place of stage 1's
    inputs; the size of a valid one is [BATCH, LENGTH, WIDTH])."""
    numel = BATCH * LENGTH * WIDTH
    shape = [BATCH, LENGTH, WIDTH]
    cases = []
    combinations = [(dtype, NONE) for dtype in DTYPES] + [("float32", value) for value in COMPRESSION_VALUES[1:]]
    combinations += [("int64", FLOAT16), ("int64", UNIFORM_8BIT), ("float16", FLOAT16), ("", UNIFORM_8BIT)]
    for dtype, compression in combinations:
        tensor = raw_tensor(dtype, shape, bytes(4 * numel), compression)
        cases.append((f"dtype {dtype!r} compression {compression}", tensor))
    sizes: list[tuple[str, list[int], bytes]] = [
        ("size [10**9] with 4 bytes", [10**9], bytes(4)),
        ("size [2**32-1, 2**32-1]", [2**32 - 1, 2**32 - 1], bytes(4)),
        ("size [2**32-1] with no bytes", [2**32 - 1], b""),
        ("size [0, 2**32-1, 2**32-1]", [0, 2**32 - 1, 2**32 - 1], b""),
        ("size [0, 10**9]", [0, 10**9], b""),
        ("5 dimensions", [1, 1, 1, 1, 1], bytes(4)),
        ("64 dimensions", [1] * 64, bytes(4)),
        ("a scalar", [], bytes(4)),
        ("no buffer", shape, b""),
        ("one byte too many", shape, bytes(4 * numel + 1)),
        ("one byte too few", shape, bytes(4 * numel - 1)),
        ("more elements than any request", [protocol.max_request_elements(MANIFEST) + 1], bytes(4)),
    ]
    cases += [(label, raw_tensor("float32", size, buffer)) for label, size, buffer in sizes]
    half = torch.full((numel,), 1.0).half()
    cases += [
        ("a float16 NaN", raw_tensor("float32", shape, with_value(half, float("nan")).numpy().tobytes(), FLOAT16)),
        (
            "float16 infinities",
            raw_tensor("float32", shape, with_value(half, float("inf"), True).numpy().tobytes(), FLOAT16),
        ),
        ("an 8-bit tensor without its codebook", raw_tensor("float32", shape, bytes(numel), UNIFORM_8BIT)),
        (
            "an 8-bit codebook of 255 values",
            raw_tensor("float32", shape, (255).to_bytes(8, "little") + bytes(1024 + numel), UNIFORM_8BIT),
        ),
        (
            "an 8-bit codebook of NaNs",
            raw_tensor("float32", shape, uniform_8bit(torch.full((256,), float("nan")), numel), UNIFORM_8BIT),
        ),
        (
            "an 8-bit codebook of 3e38",
            raw_tensor("float32", shape, uniform_8bit(torch.full((256,), 3e38), numel), UNIFORM_8BIT),
        ),
        ("requires_grad set", raw_tensor("float32", shape, hidden().numpy().tobytes(), requires_grad=True)),
    ]
    return cases


def stage_one_tensor_cases() -> list[tuple[str, list]]:
    """[inputs, targets] of the last stage, wrong in one way each."""
    x, y = hidden(), tokens()
    return [
        ("a NaN", [with_value(x, float("nan")), y]),
        ("an Inf", [with_value(x, float("inf")), y]),
        ("a -Inf", [with_value(x, float("-inf")), y]),
        ("3e38 everywhere (the sum overflows)", [with_value(x, 3e38, True), y]),
        ("-3e38 everywhere", [with_value(x, -3e38, True), y]),
        ("targets of 256", [x, y.clone().fill_(VOCAB)]),
        ("targets of -1", [x, with_value(y, -1)]),
        ("targets of 2**63-1", [x, with_value(y, 2**63 - 1)]),
        ("targets of -2**63", [x, with_value(y, -(2**63))]),
        ("float targets", [x, y.float()]),
        ("int32 targets", [x, raw_tensor("int32", [BATCH, LENGTH], bytes(4 * BATCH * LENGTH))]),
        ("targets of another shape", [x, tokens(BATCH, LENGTH + 1)]),
        ("batch 0", [hidden(0), tokens(0)]),
        ("batch larger than microbatch_size", [hidden(9), tokens(9)]),
        ("length 0", [hidden(BATCH, 0), tokens(BATCH, 0)]),
        ("length larger than context_length", [hidden(BATCH, 33), tokens(BATCH, 33)]),
        ("width - 1", [hidden(width=WIDTH - 1), y]),
        ("width + 1", [hidden(width=WIDTH + 1), y]),
        ("2-dimensional inputs", [x[0], y]),
        ("4-dimensional inputs", [x[None], y]),
        ("int64 inputs", [y, y]),
        ("no tensor", []),
        ("inputs without targets", [x]),
        ("3 tensors", [x, y, y]),
        ("100 tensors", [raw_tensor("float32", [1], bytes(4))] * 100),
        ("2000 empty tensors", [runtime_pb2.Tensor()] * 2000),
    ]


def stage_zero_tensor_cases() -> list[tuple[str, list]]:
    """Stage 0's forward takes [tokens]: wrong in one way each."""
    y = tokens()
    return [
        ("tokens of 256", [y.clone().fill_(VOCAB)]),
        ("tokens of -1", [with_value(y, -1)]),
        ("tokens of 2**63-1", [with_value(y, 2**63 - 1)]),
        ("tokens of -2**63", [with_value(y, -(2**63))]),
        ("float tokens", [y.float()]),
        ("hidden states", [hidden()]),
        ("3-dimensional tokens", [y[None]]),
        ("1-dimensional tokens", [y[0]]),
        ("batch 0", [tokens(0)]),
        ("batch larger than microbatch_size", [tokens(9)]),
        ("length 0", [tokens(BATCH, 0)]),
        ("length larger than context_length", [tokens(BATCH, 33)]),
        ("no tensor", []),
        ("2 tensors", [y, y]),
        ("size [10**9] with 8 bytes", [raw_tensor("int64", [10**9], bytes(8))]),
        (
            "a float16 header on int64 tokens",
            [raw_tensor("int64", [BATCH, LENGTH], bytes(8 * BATCH * LENGTH), FLOAT16)],
        ),
    ]


def backward_cases() -> list[tuple[str, int, list, str]]:
    """(label, stage, tensors, expected outcome) of backward requests that must not be applied."""
    grad, y = hidden(), tokens()
    return [
        ("a microbatch never seen", FIRST, [grad], "unknown_microbatch"),
        ("tokens of 256", FIRST, [grad, y.clone().fill_(VOCAB)], "bad_request"),
        ("float tokens", FIRST, [grad, y.float()], "bad_request"),
        ("a NaN gradient", FIRST, [with_value(grad, float("nan")), y], "bad_request"),
        ("an Inf gradient", FIRST, [with_value(grad, float("inf")), y], "bad_request"),
        ("a gradient of 3e38 everywhere", FIRST, [with_value(grad, 3e38, True), y], "bad_request"),
        ("a gradient of another shape", FIRST, [hidden(BATCH, LENGTH + 1), y], "bad_request"),
        ("a gradient of another width", FIRST, [hidden(width=WIDTH + 1), y], "bad_request"),
        ("an int64 gradient", FIRST, [tokens(), y], "bad_request"),
        ("no tensor", FIRST, [], "bad_request"),
        ("3 tensors", FIRST, [grad, y, y], "bad_request"),
        ("batch larger than microbatch_size", FIRST, [hidden(9), tokens(9)], "bad_request"),
        ("backward to the last stage", LAST, [grad, hidden()], "bad_request"),
        ("backward to the last stage, no inputs", LAST, [grad], "bad_request"),
        ("backward to the last stage, NaN", LAST, [with_value(grad, float("nan")), hidden()], "bad_request"),
    ]


SHAPES = [
    (BATCH, LENGTH, WIDTH),
    (BATCH, LENGTH),
    (BATCH, LENGTH, WIDTH + 1),
    (0, LENGTH, WIDTH),
    (9, LENGTH, WIDTH),
    (BATCH, 33, WIDTH),
    (BATCH,),
    (),
    (1, 1, 1, 1, 1),
    (BATCH, 0),
]
DIMS = [0, 1, 2, 8, 32, 33, 64, 2**16, 2**31, 2**32 - 1]  # the size field is uint32


def random_tensor(rng: random.Random) -> runtime_pb2.Tensor:
    """A real tensor of a plausible or implausible shape and values (sometimes corrupted), or a random header."""
    if rng.random() < 0.6:
        shape = rng.choice(SHAPES)
        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        if rng.random() < 0.5:
            tensor = torch.randn(shape, generator=generator)
            special = rng.choice([None, None, float("nan"), float("inf"), 3e38, 1e30, -1e-45])
            if special is not None and tensor.numel():
                tensor = with_value(tensor, special, everywhere=rng.random() < 0.5)
            proto = protocol.encode_tensor(tensor, rng.choice(["float32", "float16", "8bit"]))
        else:
            high = rng.choice([VOCAB, VOCAB + 1, 2**62])
            proto = protocol.encode_tensor(
                torch.randint(-1 if rng.random() < 0.2 else 0, high, shape, generator=generator)
            )
        corruption = rng.random()
        if corruption < 0.1:
            proto.buffer = proto.buffer[: rng.randrange(len(proto.buffer) + 1)]
        elif corruption < 0.2 and proto.size:
            proto.size[rng.randrange(len(proto.size))] = rng.choice(DIMS)
        elif corruption < 0.25:
            proto.dtype = rng.choice(DTYPES)
        elif corruption < 0.3:
            proto.compression = rng.choice(COMPRESSION_VALUES)
        return proto
    size = [rng.choice(DIMS) for _ in range(rng.randrange(7))]
    buffer = rng.randbytes(rng.choice([0, 1, 4, 8, 63, 64, 256, 4096]))
    return raw_tensor(
        rng.choice(DTYPES), size, buffer, rng.choice(COMPRESSION_VALUES), requires_grad=rng.random() < 0.1
    )


def random_request(rng: random.Random, stage: int, fields: list[tuple[str, dict, bool | None]]) -> bytes:
    """Mostly valid metadata (not training), sometimes a bad field or garbage; 0 to 5 random tensors."""
    pick = rng.random()
    if pick < 0.7:
        meta: dict | bytes = metadata(stage=stage, microbatch_id=rng.choice(["fuzz", "a", "x" * 64]))
    elif pick < 0.9:
        meta = rng.choice(fields)[1]
    else:
        meta = rng.choice(metadata_garbage()[:22])[1]  # not the large ones: hundreds of cases must stay fast
    count = rng.choice([0, 1, 1, 2, 2, 2, 3, 5])
    return make_request([random_tensor(rng) for _ in range(count)], meta).SerializeToString()


# ------------------------------------------------------------------------------------------ process tests


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


@integration
def test_garbage_truncated_and_corrupted_bytes_at_every_unary_handler(swarm: Swarm):
    rng = random.Random(1)
    clients = swarm.clients
    valid = {stage: valid_forward(stage).SerializeToString() for stage in (FIRST, LAST)}
    for _ in range(8):
        for stage in (FIRST, LAST):
            for name in STAGE_UNARY:
                length = rng.choice([0, 1, 2, 3, 8, 64, 512, 4096, 65536, 1 << 20])
                clients.unary(stage, name, rng.randbytes(length), f"{name.split('.')[-1]}: random bytes")
            check_manifest_reply(unparsed_or_reply(clients, stage, MANIFEST_RPC, rng.randbytes(rng.randrange(256))))
            check_reachability_reply(unparsed_or_reply(clients, stage, CHECK, rng.randbytes(rng.randrange(256))))
    for stage in (FIRST, LAST):
        data = valid[stage]
        for _ in range(12):  # cut anywhere: in a tag, a length, the metadata, a tensor's buffer
            cut = data[: rng.randrange(len(data))]
            for name in (FORWARD, BACKWARD):
                clients.unary(stage, name, cut, f"{name.split('.')[-1]}: truncated protobuf")
        for _ in range(10):
            corrupted = bytearray(data)
            for _ in range(rng.choice([1, 1, 2, 8, 64])):
                corrupted[rng.randrange(len(corrupted))] = rng.randrange(256)
            corrupted = bytes(corrupted)
            for name in (FORWARD, BACKWARD):
                if not might_change_weights(corrupted, name, stage):  # a flipped `train` could make it train
                    clients.unary(stage, name, corrupted, f"{name.split('.')[-1]}: corrupted protobuf")
    swarm.alive()


@integration
def test_bad_metadata(swarm: Swarm):
    rng = random.Random(2)
    clients = swarm.clients
    for label, raw in metadata_garbage():
        clients.unary(
            LAST,
            FORWARD,
            make_request([hidden(), tokens()], raw).SerializeToString(),
            f"rpc_forward: metadata {label}",
            {"bad_request"},
        )
        clients.unary(
            FIRST,
            BACKWARD,
            make_request([hidden()], raw).SerializeToString(),
            f"rpc_backward: metadata {label}",
            {"bad_request"},
        )
        clients.unary(
            LAST, PROBE, make_request([], raw).SerializeToString(), f"rpc_probe: metadata {label}", {"bad_request"}
        )
    for stage in (FIRST, LAST):
        tensors = [tokens()] if stage == FIRST else [hidden(), tokens()]
        for label, meta, valid in metadata_fields(stage, rng)[:: 1 if stage == LAST else 2]:
            data = make_request(tensors, meta).SerializeToString()
            expected = {"ok", "bad_request"} if valid is None else {"ok"} if valid else {"bad_request"}
            clients.unary(stage, FORWARD, data, f"rpc_forward: metadata {label}", expected)
    for label, meta, valid in metadata_fields(FIRST, rng)[::4]:  # backward of a microbatch never seen
        data = make_request([hidden()], meta).SerializeToString()
        expected = (
            {"unknown_microbatch", "bad_request"}
            if valid is None
            else {"unknown_microbatch"}
            if valid
            else {"bad_request"}
        )
        clients.unary(FIRST, BACKWARD, data, f"rpc_backward: metadata {label}", expected)
    swarm.alive()


def train_request(stage: int, tensors: list | None = None, **fields: Any) -> bytes:
    """A train request (stage-to-stage forwarding) that does not train: valid unless `fields` or `tensors` say
    otherwise."""
    tensors = tensors if tensors is not None else ([tokens()] if stage == FIRST else [hidden()]) + [tokens()]
    meta = metadata(stage=stage, **{"budget": 10.0, "route": [], **fields})
    return make_request(tensors, {k: v for k, v in meta.items() if v is not DELETE}).SerializeToString()


@integration
def test_bad_train_requests(swarm: Swarm):
    """rpc_train (a microbatch forwarded from stage to stage): bad routes, budgets, tensors; a valid one that does
    not train is served; one for another stage is refused. (The two peers are swarms of their own: stage 0 finds
    no stage 1 to pass a microbatch on to, and says so at once when its budget leaves no time to look.)"""
    clients = swarm.clients
    last_peer = str(clients.targets[LAST])
    assert clients.unary(LAST, TRAIN, train_request(LAST), "rpc_train stage 1: valid, no training") == "ok"
    unknown = "12D3KooW" + "A" * 44  # nobody announces it: the hop does not dial a peer just because a route says so
    for route in ([], [last_peer], [unknown]):
        label = f"rpc_train stage 0: valid, route {route}"
        data = train_request(FIRST, route=route, budget=2.0)
        clients.unary(FIRST, TRAIN, data, label, {"downstream_failed"})
    bad_fields = {
        "route": [None, "peer", 5, [5], [""], ["x" * 200], [last_peer, last_peer], {"0": last_peer}],
        "budget": [DELETE, None, 0, -1, "10", True, float("nan"), float("inf"), 1e9, [10]],
    }
    for key, values in bad_fields.items():
        for value in values:
            for stage in (FIRST, LAST):
                if key == "route" and stage == LAST and value in ([], None):
                    continue
                label = f"rpc_train stage {stage}: {key} {repr(value)[:30]}"
                clients.unary(stage, TRAIN, train_request(stage, **{key: value}), label, {"bad_request"})
    tensor_cases = [
        ("no targets", FIRST, [tokens()]),
        ("no tensors", LAST, []),
        ("three tensors", LAST, [hidden(), tokens(), tokens()]),
        ("hidden states to stage 0", FIRST, [hidden(), tokens()]),
        ("tokens to stage 1", LAST, [tokens(), tokens()]),
        ("targets of another shape", LAST, [hidden(), tokens(length=LENGTH + 1)]),
        ("token ids out of range", FIRST, [tokens() + VOCAB, tokens()]),
        ("NaN hidden states", LAST, [with_value(hidden(), float("nan")), tokens()]),
        ("a batch too large", FIRST, [tokens(batch=1000), tokens(batch=1000)]),
    ]
    for label, stage, tensors in tensor_cases:
        clients.unary(stage, TRAIN, train_request(stage, tensors), f"rpc_train: {label}", {"bad_request"})
    # meant for the other stage: the peer has moved (or the caller's view is old); nothing is applied
    tensors = [hidden(), tokens()]
    clients.unary(FIRST, TRAIN, train_request(LAST, tensors), "rpc_train: for stage 1, at stage 0", {"wrong_stage"})
    swarm.alive()


@integration
def test_bad_tensors(swarm: Swarm):
    clients = swarm.clients
    y = tokens()
    for label, proto in header_cases():
        data = make_request([proto, y]).SerializeToString()
        expected = {"ok"} if label in ("dtype 'float32' compression 0", "requires_grad set") else {"bad_request"}
        clients.unary(LAST, FORWARD, data, f"rpc_forward: {label}", expected)
    for label, tensors in stage_one_tensor_cases():
        clients.unary(
            LAST, FORWARD, make_request(tensors).SerializeToString(), f"rpc_forward: {label}", {"bad_request"}
        )
    # every value finite, their sum 0: accepted (not training, the peer just computes a useless loss)
    data = make_request([alternating(3e38, (BATCH, LENGTH, WIDTH)), y]).SerializeToString()
    clients.unary(LAST, FORWARD, data, "rpc_forward: ±3e38 inputs", {"ok", "bad_request"})
    for label, tensors in stage_zero_tensor_cases():
        data = make_request(tensors, metadata(stage=FIRST)).SerializeToString()
        clients.unary(FIRST, FORWARD, data, f"rpc_forward: {label}", {"bad_request"})
    for stage, other in ((FIRST, LAST), (LAST, FIRST)):
        tensors = [tokens()] if other == FIRST else [hidden(), tokens()]
        data = make_request(tensors, metadata(stage=other)).SerializeToString()
        clients.unary(stage, FORWARD, data, "rpc_forward: another stage", {"wrong_stage"})
        data = make_request([hidden()], metadata(stage=other)).SerializeToString()
        clients.unary(stage, BACKWARD, data, "rpc_backward: another stage", {"wrong_stage", "bad_request"})
    for label, stage, tensors, expected in backward_cases():
        data = make_request(
            tensors, metadata(stage=stage, microbatch_id=f"never-seen-{label}"[:64])
        ).SerializeToString()
        clients.unary(stage, BACKWARD, data, f"rpc_backward: {label}", {expected})
    swarm.alive()


@integration
def test_random_requests(swarm: Swarm):
    rng = random.Random(3)
    clients = swarm.clients
    fields = {stage: metadata_fields(stage, random.Random(stage)) for stage in (FIRST, LAST)}
    sent = 0
    while sent < 150:
        stage, name = rng.choice(
            [(FIRST, FORWARD), (LAST, FORWARD), (FIRST, BACKWARD), (LAST, BACKWARD), (rng.choice([FIRST, LAST]), PROBE)]
        )
        data = random_request(rng, stage, fields[stage])
        if might_change_weights(data, name, stage) or len(data) > 3 * 2**20:
            continue
        clients.unary(stage, name, data, f"{name.split('.')[-1]}: random request")
        sent += 1
    swarm.alive()


def parts(request: runtime_pb2.ExpertRequest) -> list[bytes]:
    """A request as the stream frames a client sends (the first part carries the metadata)."""
    return [frame(part.SerializeToString()) for part in protocol.split_message(request)]


def chunk_part(buffer: bytes, dtype: str = "", size: list[int] | None = None) -> bytes:
    tensor = runtime_pb2.Tensor(buffer=buffer, dtype=dtype, size=size or [])
    return frame(runtime_pb2.ExpertRequest(tensors=[tensor]).SerializeToString())


def stream_cases(stage: int) -> list[tuple[str, list[bytes], set[str]]]:
    """(label, frames, expected outcomes) of request streams that end (hivemind's end-of-stream follows)."""
    valid = valid_forward(stage)
    head = frame(runtime_pb2.ExpertRequest(metadata=valid.metadata).SerializeToString())
    too_big = protocol.max_message_bytes(MANIFEST) + 2**17
    n = BATCH * LENGTH * WIDTH
    # refused before the stream's end: the reply may be lost (see test_a_stream_refused_midway_still_gets_its_reply)
    refused = {"bad_request", "closed"}
    return [
        ("a valid request", parts(valid), {"ok"}),
        ("no message at all", [], {"bad_request"}),
        ("metadata only", [head], {"bad_request"}),
        ("an empty chunk", [head, chunk_part(b"", "float32", [BATCH, LENGTH, WIDTH])], refused),
        ("an empty chunk after a full one", parts(valid) + [chunk_part(b"")], refused),
        ("3 tensors", [head] + [chunk_part(bytes(8), "int64", [1])] * 3, refused),
        (
            "more bytes than any request",
            [head] + [chunk_part(bytes(2**16), "float32", [2**14])] * (too_big // 2**16),
            refused,
        ),
        (
            "1000 one-byte chunks",
            [head, chunk_part(b"\x00", "float32", [BATCH, LENGTH, WIDTH])] + [chunk_part(b"\x00")] * 999,
            {"bad_request"},
        ),
        (
            "a chunk without a header first",
            [head, chunk_part(bytes(4 * n)), chunk_part(bytes(8), "int64", [1])],
            {"bad_request"},
        ),
        ("the metadata in the second part", [frame(b""), head] + parts(valid)[1:], {"bad_request"}),
        ("an error frame first", [frame(b"\x0a\x03abc", P2P.ERROR_MARKER)] + parts(valid), refused),
        ("a foreign swarm id", parts(make_request([hidden(), tokens()], metadata(swarm_id="0" * 16))), {"bad_request"}),
    ]


RAW_STREAMS: list[tuple[str, list[bytes]]] = [
    # framing hivemind cannot read: it drops the stream (no reply), the handler's work is cancelled
    ("an unknown marker byte", [b"\x07" + bytes(16)]),
    ("a frame that is not a protobuf", [frame(b"\xff" * 64)]),
    ("a frame declaring 2**63 bytes, cut short", [P2P.MESSAGE_MARKER + (2**63).to_bytes(8, "big") + bytes(100)]),
    ("half a header", [P2P.MESSAGE_MARKER + b"\x00\x00"]),
]


@integration
def test_broken_request_streams(swarm: Swarm):
    rng = random.Random(5)
    clients = swarm.clients
    for stage, name in ((LAST, FORWARD_STREAM), (FIRST, BACKWARD_STREAM), (FIRST, FORWARD_STREAM)):
        method = name.split(".")[-1]
        for label, chunks, expected in stream_cases(stage):
            if name == BACKWARD_STREAM and expected == {"ok"}:
                expected = {"unknown_microbatch", "bad_request"}  # a forward as backward: never applied
            clients.stream(stage, name, chunks, f"{method}: {label}", expected)
        for label, chunks in RAW_STREAMS:
            clients.stream(stage, name, chunks, f"{method}: {label}", {"closed", "bad_request"}, ending="eof")
        for _ in range(8):
            garbage = [rng.randbytes(rng.choice([1, 9, 100, 5000]))]
            clients.stream(stage, name, garbage, f"{method}: random bytes", {"closed", "bad_request"}, ending="eof")
    swarm.alive()


def state_request(**fields: Any) -> bytes:
    meta = {"swarm_id": MANIFEST.swarm_id, "protocol_version": PROTOCOL_VERSION, **fields}
    return frame(runtime_pb2.ExpertRequest(metadata=packb(meta)).SerializeToString())


@integration
def test_bad_state_downloads_probes_and_manifest_requests(swarm: Swarm):
    clients = swarm.clients
    for stage in (FIRST, LAST):
        for label, raw in metadata_garbage()[:12]:
            chunks = [frame(runtime_pb2.ExpertRequest(metadata=raw).SerializeToString())]
            clients.stream(stage, DOWNLOAD_STATE, chunks, f"rpc_download_state: metadata {label}", {"bad_request"})
        for value in (None, 1 - stage, -1, 2, "0", 0.0, True, [stage], 2**64 - 1):
            chunks = [state_request(stage=value)]
            expected = {"ok", "bad_request"} if value == stage else {"bad_request"}  # 0.0 == 0, True == 1
            clients.stream(stage, DOWNLOAD_STATE, chunks, f"rpc_download_state: stage {value!r}", expected)
        clients.stream(stage, DOWNLOAD_STATE, [state_request(stage=stage)], "rpc_download_state: valid", {"ok"})
        for _, raw in metadata_garbage()[:6]:
            data = runtime_pb2.ExpertRequest(metadata=raw).SerializeToString()
            check_manifest_reply(unparsed_or_reply(clients, stage, MANIFEST_RPC, data))
        # a probe answers with up to PROBE_BYTES of zeros, whatever payload comes with it
        for value in (-1, 2**63 - 1, 2**64 - 1, "10", 1.5, None, [], {}, 10**9):
            data = protocol.make_control_request(MANIFEST, reply_bytes=value).SerializeToString()
            clients.unary(stage, PROBE, data, f"rpc_probe: reply_bytes {value!r}", {"bad_request"})
        for value in (0, 1, 4096, True):
            data = protocol.make_control_request(MANIFEST, reply_bytes=value).SerializeToString()
            clients.unary(stage, PROBE, data, f"rpc_probe: reply_bytes {value!r}", {"ok"})
        # the tokenizer: hostile offsets and garbage are refused (this swarm's vocabulary is bytes: no file at all)
        for value in (-1, 2**64 - 1, "0", 1.5, None, [], 0):
            data = protocol.make_control_request(MANIFEST, offset=value).SerializeToString()
            clients.unary(stage, TOKENIZER_RPC, data, f"rpc_tokenizer: offset {value!r}", {"bad_request"})
        for label, raw in metadata_garbage()[:6]:
            data = runtime_pb2.ExpertRequest(metadata=raw).SerializeToString()
            clients.unary(stage, TOKENIZER_RPC, data, f"rpc_tokenizer: metadata {label}", {"bad_request"})
        payload = protocol.make_control_request(MANIFEST)
        payload.tensors.extend([raw_tensor("evil", [2**32 - 1], bytes(3 * 2**20))] + [runtime_pb2.Tensor()] * 1000)
        clients.unary(stage, PROBE, payload.SerializeToString(), "rpc_probe: a 3 MB garbage payload", {"ok"})
    # download_state's request is one message in a stream: a second one, or none, is refused
    for label, chunks in (("two requests", [state_request(stage=0)] * 2), ("no request", [])):
        result = clients.run(
            open_stream(
                clients.identity(FIRST), clients.targets[FIRST], DOWNLOAD_STATE, chunks, "message", STREAM_WAIT
            ),
            STREAM_WAIT + 5,
        )
        assert [stage_outcome(reply) for reply in result.replies] == ["bad_request"], (label, result)
        CASES["rpc_download_state"] += 1
    swarm.alive()


@integration
def test_hostile_reachability_checks(swarm: Swarm):
    """rpc_check dials only the asker, at addresses on the IP it connects from: whatever it is told, it answers a
    verdict, and dials nobody else."""
    clients = swarm.clients
    p2p = clients.identity(FIRST)  # checks are not held against anyone
    own = [str(a) for a in clients.run(p2p.get_visible_maddrs())]
    claims: list[tuple[str, Any]] = [
        ("no maddrs", {}),
        ("maddrs not a list", {"maddrs": "/ip4/127.0.0.1/tcp/1"}),
        ("maddrs a dictionary", {"maddrs": {"a": 1}}),
        ("non-strings", {"maddrs": [1, None, b"x", [], {}]}),
        ("10000 addresses", {"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 10_000}),
        ("a 100 kB address", {"maddrs": ["/ip4/127.0.0.1/tcp/1/" + "x" * 100_000]}),
        (
            "invalid multiaddrs",
            {"maddrs": ["", "/", "/ip4/999.0.0.1/tcp/1", "/garbage", "\x00", "/ip4/127.0.0.1/tcp/99999"]},
        ),
        ("relay circuits", {"maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmRelay/p2p-circuit"]}),
        ("other hosts", {"maddrs": ["/ip4/10.0.0.1/tcp/1", "/ip6/::1/tcp/1", "/dns4/example.org/tcp/1"]}),
        ("another peer's id", {"maddrs": [f"/ip4/127.0.0.1/tcp/1/p2p/{swarm.ids[LAST]}"]}),
        ("a closed port", {"maddrs": ["/ip4/127.0.0.1/tcp/1"]}),
    ]
    for label, meta in claims:
        data = runtime_pb2.ExpertRequest(metadata=packb(meta)).SerializeToString()
        raw = clients.run(p2p._client.call_unary_handler(clients.targets[FIRST], CHECK, data), 30)
        verdict = check_reachability_reply(runtime_pb2.ExpertResponse.FromString(raw))
        assert verdict is not None and verdict["reachable"] is not True, (label, verdict)
    for _, raw_meta in metadata_garbage()[:12]:
        data = runtime_pb2.ExpertRequest(metadata=raw_meta).SerializeToString()
        check_reachability_reply(unparsed_or_reply(clients, FIRST, CHECK, data))
    # its own addresses, several checks at once: each is dialed back or told the helper is busy (a verdict of
    # False or None is possible too on a loaded machine: the probe daemon or the dial may be slow)
    data = runtime_pb2.ExpertRequest(metadata=packb({"maddrs": own})).SerializeToString()

    async def at_once() -> list[bytes]:
        return await asyncio.gather(
            *[p2p._client.call_unary_handler(clients.targets[LAST], CHECK, data) for _ in range(5)]
        )

    verdicts = [
        check_reachability_reply(runtime_pb2.ExpertResponse.FromString(raw)) for raw in clients.run(at_once(), 30)
    ]
    assert all(v is not None and (v["reachable"] is not None or v["error"]) for v in verdicts), verdicts
    swarm.alive()


BACKGROUND: dict[str, concurrent.futures.Future] = {}  # slow cases started early, checked by a later test


def start_stalled_download(clients: Clients) -> concurrent.futures.Future:
    """A state request whose stream never ends (no end-of-stream message)."""
    chunks = [state_request(stage=FIRST)]
    coroutine = open_stream(
        clients.fresh(), clients.targets[FIRST], DOWNLOAD_STATE, chunks, "none", FORWARD_TIMEOUT + 4
    )
    return asyncio.run_coroutine_threadsafe(coroutine, clients.loop)


@integration
def test_streams_that_never_end_are_answered_within_the_forward_timeout(swarm: Swarm):
    clients = swarm.clients
    valid = valid_forward(LAST)
    head = frame(runtime_pb2.ExpertRequest(metadata=valid.metadata).SerializeToString())
    endless = P2P.MESSAGE_MARKER + (2**40).to_bytes(8, "big") + bytes(1000)
    cases = [
        ("nothing at all", LAST, FORWARD_STREAM, []),
        ("metadata, then nothing", LAST, FORWARD_STREAM, [head]),
        ("a request without its end", LAST, FORWARD_STREAM, parts(valid)),
        ("half a tensor", LAST, FORWARD_STREAM, parts(valid)[:2]),
        ("a frame that never ends", LAST, FORWARD_STREAM, [endless]),
        ("metadata, then nothing", FIRST, BACKWARD_STREAM, [head]),
        ("a frame that never ends", FIRST, BACKWARD_STREAM, [endless]),
    ]
    p2p = clients.identity(LAST, room=len(cases))
    clients.strikes[LAST] += len(cases)  # (the two to stage 0 as well, to be safe)

    async def all_at_once() -> list[StreamResult]:
        return await asyncio.gather(
            *[
                open_stream(p2p, clients.targets[stage], name, chunks, "none", STREAM_WAIT)
                for _, stage, name, chunks in cases
            ]
        )

    for (label, _, name, _), result in zip(cases, clients.run(all_at_once(), STREAM_WAIT + 5)):
        kind = f"{name.split('.')[-1]}: {label}"
        if label == "a frame that never ends":  # it declares 2**40 bytes: the stream is closed at its header
            assert stream_outcome(result, kind) == "closed", kind
        else:
            assert stream_outcome(result, kind) == "bad_request", kind
            assert "in time" in MSGPackSerializer.loads(result.replies[0].metadata)["error"], kind
        assert result.seconds < FORWARD_TIMEOUT + 5, (kind, result.seconds)
        CASES[kind.split(":")[0]] += 1
    swarm.alive()


@integration
def test_a_state_request_that_never_ends_is_answered_or_closed(swarm: Swarm):
    future = BACKGROUND.pop("stalled download", None) or start_stalled_download(swarm.clients)
    CASES["rpc_download_state"] += 1
    result = future.result(STREAM_WAIT + 5)  # raises AssertionError if neither a reply nor a close came
    assert result.replies or result.rpc_errors is not None


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


@integration
def test_a_stream_refused_midway_still_gets_its_reply(swarm: Swarm):
    """A stream refused before its end (an empty chunk here; busy and banned alike) still gets its reply: the peer
    reads the rest of the request (up to a valid request's size) before it answers, since closing a stream with
    parts unread resets it and loses the reply. (A request larger than any valid one may lose it.)"""
    clients = swarm.clients
    head = frame(runtime_pb2.ExpertRequest(metadata=valid_forward(LAST).metadata).SerializeToString())
    chunks = [head, chunk_part(bytes(2**12), "float32", [2**10]), chunk_part(b"")] + [chunk_part(bytes(2**12))] * 8
    sender = clients.identity(LAST, room=8)
    outcomes = []
    for _ in range(8):
        replies = clients.run(send_then_read(sender, clients.targets[LAST], FORWARD_STREAM, chunks), STREAM_WAIT)
        outcomes.append(stage_outcome(replies[0]) if replies else "closed")
        clients.strikes[LAST] += 1
        CASES["rpc_forward_stream: refused midway"] += 1
    swarm.alive()
    assert outcomes == ["bad_request"] * len(outcomes), outcomes


@integration
def test_bad_backward_of_a_cached_forward_changes_nothing(swarm: Swarm):
    """Stage 0 keeps the activations of training forwards: bad gradients for them are refused, not applied."""
    clients = swarm.clients
    p2p = clients.fresh()  # its own identity: the activations it leaves cached are keyed by it
    ids = ["cached-0", "cached-1"]  # 14 bad requests: fewer than a ban takes

    def send(name: str, request: runtime_pb2.ExpertRequest) -> str:
        raw = clients.run(p2p._client.call_unary_handler(clients.targets[FIRST], name, request.SerializeToString()))
        return stage_outcome(runtime_pb2.ExpertResponse.FromString(raw))

    for microbatch_id in ids:
        assert send(FORWARD, valid_forward(FIRST, train=True, microbatch_id=microbatch_id)) == "ok"
    grad = hidden()
    bad_grads = [
        ("a NaN gradient", [with_value(grad, float("nan"))]),
        ("an Inf gradient", [with_value(grad, float("-inf"))]),
        ("a gradient of 3e38 everywhere", [with_value(grad, 3e38, True)]),
        ("a gradient of another shape", [hidden(BATCH, LENGTH - 1)]),
        ("a gradient of the whole microbatch size", [hidden(8)]),
        ("an int64 gradient", [tokens()]),
        ("a float16-compressed NaN", [protocol.encode_tensor(with_value(grad, float("nan")), "float16")]),
    ]
    for microbatch_id in ids:
        for label, tensors in bad_grads:
            request = make_request(tensors, metadata(stage=FIRST, microbatch_id=microbatch_id))
            assert send(BACKWARD, request) == "bad_request", label
            CASES["rpc_backward: bad gradient of a cached forward"] += 1
    clients.retire(p2p)  # nobody else can send backward for its cached forwards
    swarm.alive()


@integration
def test_floods_get_busy_or_served_promptly(swarm: Swarm):
    clients = swarm.clients
    senders = [clients.fresh() for _ in range(4)]
    requests = {stage: valid_forward(stage).SerializeToString() for stage in (FIRST, LAST)}
    rss = {stage: group_rss(peer.pgid) for stage, peer in swarm.peers.items()}

    async def timed(coroutine: Coroutine) -> tuple[float, Any]:
        started = time.monotonic()
        try:
            return time.monotonic() - started, await coroutine
        except Exception as e:
            return time.monotonic() - started, e

    async def flood() -> list[tuple[str, float, Any]]:
        calls: list[tuple[str, Coroutine]] = []
        for i in range(400):  # a quarter of them from one sender: more than its share of slots
            stage = LAST if i % 4 else FIRST
            sender = senders[0] if i < 100 else senders[i % 4]
            calls.append(
                ("forward", sender._client.call_unary_handler(clients.targets[stage], FORWARD, requests[stage]))
            )
        for i in range(100):
            garbage = random.Random(i).randbytes(100)
            calls.append(
                ("garbage", senders[i % 4]._client.call_unary_handler(clients.targets[i % 2], FORWARD, garbage))
            )
        for i in range(60):
            chunks = parts(valid_forward(LAST))
            stream = open_stream(senders[i % 4], clients.targets[LAST], FORWARD_STREAM, chunks, "message", STREAM_WAIT)
            calls.append(("stream", stream))
        results = await asyncio.gather(*[timed(call) for _, call in calls])
        return [(kind, seconds, result) for (kind, _), (seconds, result) in zip(calls, results)]

    started = time.monotonic()
    results = clients.run(flood(), 60)
    took = time.monotonic() - started
    outcomes: collections.Counter[str] = collections.Counter()
    for kind, seconds, result in results:
        if kind == "garbage":
            assert isinstance(result, Exception) and is_parse_refusal(result), result
            outcome = "unparsed"
        elif kind == "stream":
            assert isinstance(result, StreamResult), result
            outcome = stream_outcome(result, "flood")
        else:
            assert isinstance(result, bytes), result
            outcome = stage_outcome(runtime_pb2.ExpertResponse.FromString(result))
        allowed = (
            {"unparsed"} if kind == "garbage" else {"ok", "busy", "closed"} if kind == "stream" else {"ok", "busy"}
        )
        assert outcome in allowed, (kind, outcome)  # closed: a busy reply lost (test_a_stream_refused_midway_...)
        assert seconds < 20, (kind, seconds)
        outcomes[f"{kind} {outcome}"] += 1
        CASES[f"flood: {kind}"] += 1
    print(f"\nflood of {len(results)} requests in {took:.1f} s: {dict(outcomes)}")
    assert outcomes["forward ok"] >= 1, outcomes  # how many: a slower peer (a loaded machine) takes fewer at once
    assert outcomes["forward busy"] >= 1, "one sender had more requests in flight than its share; none was refused"
    for stage in (FIRST, LAST):  # busy replies are not held against anyone
        swarm.served(stage, senders[0])
        chunks = parts(valid_forward(stage))
        assert clients.stream(stage, FORWARD_STREAM, chunks, "flood: stream", {"ok"}, p2p=senders[1]) == "ok"
        growth = group_rss(swarm.peers[stage].pgid) - rss[stage]
        print(f"stage {stage}: memory grew by {growth / 2**20:.1f} MiB over the flood")
        assert growth < RSS_GROWTH_LIMIT / 2, f"stage {stage}: memory grew by {growth / 2**20:.0f} MiB over the flood"
    for sender in senders:
        clients.retire(sender)
    swarm.alive()


def call(clients: Clients, p2p: P2P, stage: int, name: str, request: runtime_pb2.ExpertRequest) -> str:
    """A unary call from a given identity; its outcome, 'banned' included."""
    raw = clients.run(p2p._client.call_unary_handler(clients.targets[stage], name, request.SerializeToString()))
    return stage_outcome(runtime_pb2.ExpertResponse.FromString(raw), banned_ok=True)


@integration
def test_a_client_that_keeps_sending_bad_requests_is_banned(swarm: Swarm):
    clients = swarm.clients
    offender, bystander = clients.fresh(), clients.identity(LAST)
    bad = make_request([hidden(), tokens()], metadata(swarm_id="0" * 16))
    outcomes = [call(clients, offender, LAST, FORWARD, bad) for _ in range(BAD_REQUESTS_BEFORE_BAN)]
    assert outcomes == ["bad_request"] * BAD_REQUESTS_BEFORE_BAN, outcomes
    # banned now, at every handler, even for valid requests
    assert call(clients, offender, LAST, FORWARD, bad) == "banned"
    assert call(clients, offender, LAST, FORWARD, valid_forward(LAST)) == "banned"
    assert call(clients, offender, LAST, BACKWARD, make_request([hidden()])) == "banned"
    assert call(clients, offender, LAST, PROBE, protocol.make_control_request(MANIFEST)) == "banned"
    for name, chunks in ((FORWARD_STREAM, parts(valid_forward(LAST))), (DOWNLOAD_STATE, [state_request(stage=LAST)])):
        # refused before the request is read: the reply may be lost (test_a_stream_refused_midway_...)
        outcomes = [clients.stream(LAST, name, chunks, "ban", {"banned", "closed"}, p2p=offender) for _ in range(3)]
        assert "banned" in outcomes, outcomes
    raw = clients.run(
        offender._client.call_unary_handler(clients.targets[LAST], FORWARD, valid_forward(LAST).SerializeToString())
    )
    assert "bans you" in MSGPackSerializer.loads(runtime_pb2.ExpertResponse.FromString(raw).metadata)["error"]
    # others are served; a ban is one peer's: the other still serves the offender
    assert call(clients, bystander, LAST, FORWARD, valid_forward(LAST)) == "ok"
    assert call(clients, offender, FIRST, FORWARD, valid_forward(FIRST)) == "ok"
    CASES["ban"] += BAD_REQUESTS_BEFORE_BAN + 10
    clients.retire(offender)
    swarm.alive()


@integration
def test_after_all_cases_the_peers_serve_and_are_unchanged(swarm: Swarm):
    """Runs after the other process tests (file order): a fresh identity is served, the parameters are exactly
    as before, the memory stayed bounded."""
    p2p = swarm.clients.fresh()
    for stage, peer in swarm.peers.items():
        reply = swarm.served(stage, p2p)
        outputs = protocol.decode_reply(reply, protocol.max_request_elements(MANIFEST))
        assert [tuple(t.shape) for t in outputs] == ([(BATCH, LENGTH, WIDTH)] if stage == FIRST else [()])
        state = swarm.state(stage, p2p)
        assert [name for name, _ in state] == [name for name, _ in swarm.states[stage]]
        for (name, after), (_, before) in zip(state, swarm.states[stage]):
            assert torch.equal(after, before), f"stage {stage}: {name} changed"
        growth = group_rss(peer.pgid) - swarm.rss[stage]
        report = memory_report(peer.pgid)
        print(f"stage {stage}: memory grew by {growth / 2**20:.1f} MiB over all cases; now (MiB): {report}")
        assert growth < RSS_GROWTH_LIMIT, f"stage {stage}: memory grew by {growth / 2**20:.0f} MiB over all cases"
    swarm.clients.retire(p2p)
    swarm.alive()


# The last two leave a peer's memory high or the peer dead: they come after the check above.


@integration
def test_a_frame_that_declares_a_huge_size_is_not_buffered(swarm: Swarm):
    """A stream message's header declares its length; the peer must not buffer far more than any request."""
    clients = swarm.clients
    p2p = clients.identity(FIRST)
    pgid = swarm.peers[FIRST].pgid
    before = group_rss(pgid)

    async def send() -> tuple[int, bool, int]:
        """(bytes sent, whether the peer closed the stream, the peer's memory then)."""
        _, _, writer = await p2p.call_binary_stream_handler(clients.targets[FIRST], FORWARD_STREAM)
        sent, refused, deadline = 0, False, time.monotonic() + FORWARD_TIMEOUT - 0.5
        try:
            writer.write(P2P.MESSAGE_MARKER + (2**40).to_bytes(8, "big"))
            while sent < 192 * 2**20 and time.monotonic() < deadline:
                writer.write(bytes(2**20))
                await writer.drain()
                sent += 2**20
            await asyncio.sleep(0.3)  # let the peer take in what is on its way
        except ConnectionError:  # the peer closed the stream: it refused the frame
            refused = True
        rss = group_rss(pgid)
        writer.close()
        return sent, refused, rss

    sent, refused, rss = clients.run(send(), 30)
    CASES["rpc_forward_stream: a huge frame"] += 1
    growth = rss - before
    swarm.alive()
    if not refused and sent < 96 * 2**20:
        pytest.skip(f"inconclusive: only {sent / 2**20:.0f} MiB could be sent in time (a loaded machine)")
    assert growth < 64 * 2**20, (
        f"{sent / 2**20:.0f} MiB sent in one frame: the peer's memory grew by {growth / 2**20:.0f} MiB"
    )


@integration
def test_deeply_nested_msgpack_metadata_gets_an_error_reply(swarm: Swarm):
    clients, peer = swarm.clients, swarm.peers[LAST]
    data = make_request([hidden(), tokens()], nested_tuples(1000)).SerializeToString()
    CASES["rpc_forward: metadata of tuples nested 1000 deep"] += 1
    sockets = peer.socket_files()  # a crashed peer cannot remove its socket files
    try:
        raw = clients.run(clients.identity(LAST)._client.call_unary_handler(clients.targets[LAST], FORWARD, data), 3)
    except Exception:  # no reply (AssertionError: none in time)
        raw = None
    time.sleep(0.5)
    if peer.process.poll() is not None:
        peer.kill(sockets)  # its DHT process and p2pd daemon too
    swarm.alive()
    assert raw is not None and stage_outcome(runtime_pb2.ExpertResponse.FromString(raw)) == "bad_request"
