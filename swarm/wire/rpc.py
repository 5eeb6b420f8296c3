"""The RPCs a peer answers, as declared to hivemind: their names, and the protobuf types of their requests and replies.

hivemind builds both sides of an RPC from one `ServicerBase` class: `add_p2p_handlers` registers the class's
`rpc_*` methods as handlers, and `get_stub` makes a client stub whose `rpc_*` methods call them on another peer;
the request and reply types come from the methods' annotations (a stream is `typing.AsyncIterator[...]`). The
classes here only declare the methods. The server implements them (swarm/server/service.py's StageService,
swarm/server/reachability.py's ReachabilityService, subclasses of these) and the client calls them through
`stub` (swarm/client/rpc.py), so the client never needs the server's code.

A handler's name on the wire is "<namespace>::<service>.<method>", e.g. "swarm::StageService.rpc_forward".
hivemind takes <service> from the class it is called on; here it is fixed by SERVICE, so that a declaration and
its implementation register and call the same handlers, as every peer since protocol 5 does.
"""

from __future__ import annotations

from typing import AsyncIterator, ClassVar  # noqa: UP035 (hivemind detects streams by typing.AsyncIterator only)

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.servicer import StubBase
from hivemind.proto import runtime_pb2

TOKENIZER_CHUNK_BYTES = 2 * 1024 * 1024  # of rpc_tokenizer replies (hivemind's unary messages stop at 4 MiB)
DATA_PIECE_BYTES = 2 * 1024 * 1024  # of rpc_piece replies: a data chunk or index travels in pieces of this size

Request, Reply = runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse


class _Service(ServicerBase):
    """A service whose handlers are named after SERVICE in NAMESPACE, whichever class registers or calls them."""

    SERVICE: ClassVar[str]
    NAMESPACE: ClassVar[str]

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:  # hivemind's: named by cls.__name__
        name = f"{cls.SERVICE}.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    @classmethod
    def _collect_rpc_handlers(cls) -> None:
        # hivemind keeps the list in a class attribute that subclasses inherit: once a client's stub had filled it
        # for StageRPC, StageService would reuse it and silently skip an rpc_* method declared only on the server
        if "_rpc_handlers" not in cls.__dict__:
            cls._rpc_handlers = None
        super()._collect_rpc_handlers.__func__(cls)

    @classmethod
    def handle_name(cls, method_name: str) -> str:
        """The name of the handler of `method_name` on the wire."""
        return cls._get_handle_name(cls.NAMESPACE, method_name)

    @classmethod
    def stub(cls, p2p: P2P, peer_id: str | PeerID) -> StubBase:
        """A client of this service at `peer_id` (a base58 string or a PeerID)."""
        peer = PeerID.from_base58(peer_id) if isinstance(peer_id, str) else peer_id
        return cls.get_stub(p2p, peer, namespace=cls.NAMESPACE)


def _declared(method_name: str) -> NotImplementedError:
    return NotImplementedError(f"{method_name} is declared in swarm/wire/rpc.py; a server's subclass implements it")


class StageRPC(_Service):
    """What a stage peer answers (swarm/wire/messages.py has the messages). forward, backward and train go unary
    when they fit one message and by stream otherwise (swarm/wire/messages.py, needs_stream)."""

    SERVICE = "StageService"
    NAMESPACE = "swarm"

    async def rpc_forward(self, request: Request, context: P2PContext) -> Reply:
        raise _declared("rpc_forward")

    async def rpc_backward(self, request: Request, context: P2PContext) -> Reply:
        raise _declared("rpc_backward")

    async def rpc_train(self, request: Request, context: P2PContext) -> Reply:
        """A forwarded microbatch: forward here, on to the next stage, backward here."""
        raise _declared("rpc_train")

    async def rpc_forward_stream(self, requests: AsyncIterator[Request], context: P2PContext) -> AsyncIterator[Reply]:
        raise _declared("rpc_forward_stream")

    async def rpc_backward_stream(self, requests: AsyncIterator[Request], context: P2PContext) -> AsyncIterator[Reply]:
        raise _declared("rpc_backward_stream")

    async def rpc_train_stream(self, requests: AsyncIterator[Request], context: P2PContext) -> AsyncIterator[Reply]:
        raise _declared("rpc_train_stream")

    async def rpc_probe(self, request: Request, context: P2PContext) -> Reply:
        """Bandwidth probe: takes the request's payload, replies with `reply_bytes` bytes of zeros."""
        raise _declared("rpc_probe")

    async def rpc_download_state(self, requests: AsyncIterator[Request], context: P2PContext) -> AsyncIterator[Reply]:
        """The stage's state (swarm/wire/state.py), streamed, for a peer that starts serving the stage."""
        raise _declared("rpc_download_state")

    async def rpc_tokenizer(self, request: Request, context: P2PContext) -> Reply:
        """A chunk of TOKENIZER_CHUNK_BYTES of the swarm's tokenizer file, from `offset`."""
        raise _declared("rpc_tokenizer")

    async def rpc_manifest(self, request: Request, context: P2PContext) -> Reply:
        """The swarm's manifest as JSON, for a peer that joins by this peer's address (not in a private swarm)."""
        raise _declared("rpc_manifest")


class DataRPC(_Service):
    """What every peer that holds training data answers: a piece of a chunk (or of the data's index) it holds,
    named by its SHA-256 (swarm/dataset/sharing.py)."""

    SERVICE = "DataService"
    NAMESPACE = "swarm.data"

    async def rpc_piece(self, request: Request, context: P2PContext) -> Reply:
        """`length` bytes (at most DATA_PIECE_BYTES) from `offset` of the file whose SHA-256 is `sha256`."""
        raise _declared("rpc_piece")


class CheckpointRPC(_Service):
    """What every peer that keeps checkpoints answers: the state of a stage from its checkpoint, in the form of
    rpc_download_state's reply, even for a stage it no longer serves (swarm/server/checkpoint_sharing.py)."""

    SERVICE = "CheckpointService"
    NAMESPACE = "swarm.checkpoints"

    async def rpc_checkpoint(self, requests: AsyncIterator[Request], context: P2PContext) -> AsyncIterator[Reply]:
        """The state of the stage the request names, from this peer's checkpoint of it, streamed."""
        raise _declared("rpc_checkpoint")


class ReachabilityRPC(_Service):
    """What every peer answers for a peer that starts: "can you dial me back?" (swarm/server/reachability.py)."""

    SERVICE = "ReachabilityService"
    NAMESPACE = "swarm.reachability"

    async def rpc_check(self, request: Request, context: P2PContext) -> Reply:
        raise _declared("rpc_check")
