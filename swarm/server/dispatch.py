"""A peer's stage RPC handlers, registered once: each request goes to the StageService of the stage it names.

A peer that serves a span serves several stages, each with its own StageServer (its worker, step gate, averaging
rounds and state), but it has one p2p node, and hivemind names a handler by service and method only. So the peer
registers this dispatcher once and each StageServer adds its service while it serves. A request naming a stage
the peer does not serve goes to one of the services it has, which answers it as it answers any request for another
stage (`wrong_stage`, or `bad_request` for a request it cannot read): a peer serving one stage behaves exactly as
it did when its service registered itself. Requests that name no stage (a bandwidth probe, the tokenizer, the
manifest) go to any service. With no stage served (a peer between two spans), the answer is `busy`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 (hivemind detects streams by typing's only)

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from swarm.manifests.manifest import Manifest
from swarm.server.service import StageService
from swarm.wire.codes import ErrorCode
from swarm.wire.messages import make_error_reply, unpack
from swarm.wire.rpc import StageRPC

Request, Reply = runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse


class StageDispatcher(StageRPC):  # the same handler names as a StageService's
    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.services: dict[int, StageService] = {}
        self._registered_on: P2P | None = None

    async def register(self, p2p: P2P) -> None:
        """Register the handlers on the peer's p2p node (once)."""
        if self._registered_on is None:
            await self.add_p2p_handlers(p2p, namespace=self.NAMESPACE)
            self._registered_on = p2p

    async def unregister(self) -> None:
        if self._registered_on is not None:
            p2p, self._registered_on = self._registered_on, None
            await self.remove_p2p_handlers(p2p, namespace=self.NAMESPACE)

    def add(self, service: StageService) -> None:
        self.services[service.stage] = service

    def remove(self, service: StageService) -> None:
        if self.services.get(service.stage) is service:
            del self.services[service.stage]

    def local(self, stage: int) -> StageService | None:
        """The service of `stage` if this peer serves it."""
        return self.services.get(stage)

    async def handle(self, kind: str, request: Request, caller: str) -> Reply:
        """A request from this peer itself (its trainer, or a hop to the next stage of its span): libp2p cannot
        dial itself, so it is handed to the stage's service directly."""
        service = self._service_for(request)
        return await service.handle(kind, request, caller) if service else _not_serving()

    def _service_for(self, request: Request | None) -> StageService | None:
        stage = _named_stage(request) if request is not None else None
        service = self.services.get(stage) if stage is not None else None
        if service is None and self.services:
            service = next(iter(self.services.values()))  # it answers for a stage it does not serve, as ever
        return service

    # ------------------------------------------------------------------------------------------ unary

    async def rpc_forward(self, request: Request, context: P2PContext) -> Reply:
        service = self._service_for(request)
        return await service.rpc_forward(request, context) if service else _not_serving()

    async def rpc_backward(self, request: Request, context: P2PContext) -> Reply:
        service = self._service_for(request)
        return await service.rpc_backward(request, context) if service else _not_serving()

    async def rpc_train(self, request: Request, context: P2PContext) -> Reply:
        service = self._service_for(request)
        return await service.rpc_train(request, context) if service else _not_serving()

    async def rpc_probe(self, request: Request, context: P2PContext) -> Reply:
        service = self._service_for(None)
        return await service.rpc_probe(request, context) if service else _not_serving()

    async def rpc_tokenizer(self, request: Request, context: P2PContext) -> Reply:
        service = self._service_for(None)
        return await service.rpc_tokenizer(request, context) if service else _not_serving()

    async def rpc_manifest(self, request: Request, context: P2PContext) -> Reply:
        service = self._service_for(None)
        return await service.rpc_manifest(request, context) if service else _not_serving()

    # ---------------------------------------------------------------------------------------- streams

    async def rpc_forward_stream(
        self, requests: TypingAsyncIterator[Request], context: P2PContext
    ) -> TypingAsyncIterator[Reply]:
        async for part in self._stream("rpc_forward_stream", requests, context):
            yield part

    async def rpc_backward_stream(
        self, requests: TypingAsyncIterator[Request], context: P2PContext
    ) -> TypingAsyncIterator[Reply]:
        async for part in self._stream("rpc_backward_stream", requests, context):
            yield part

    async def rpc_train_stream(
        self, requests: TypingAsyncIterator[Request], context: P2PContext
    ) -> TypingAsyncIterator[Reply]:
        async for part in self._stream("rpc_train_stream", requests, context):
            yield part

    async def rpc_download_state(
        self, requests: TypingAsyncIterator[Request], context: P2PContext
    ) -> TypingAsyncIterator[Reply]:
        async for part in self._stream("rpc_download_state", requests, context):
            yield part

    async def _stream(self, method: str, requests: AsyncIterator[Request], context: P2PContext) -> AsyncIterator[Reply]:
        """To the one service the peer has, untouched (its admission decides whether to read it at all); with
        several, the stream's first part names the stage: it is read here (within the forward timeout, as any part
        of a request stream), then the whole stream goes to that stage's service."""
        if len(self.services) <= 1:
            service = self._service_for(None)
            if service is None:
                yield _not_serving()
                return
            async for part in getattr(service, method)(requests, context):
                yield part
            return
        try:
            timeout = self.manifest.training.timeouts.forward
            first = await asyncio.wait_for(anext(requests), timeout=timeout)
        except (StopAsyncIteration, TimeoutError):
            yield make_error_reply("the request stream did not start in time", ErrorCode.BAD_REQUEST)
            return
        service = self._service_for(first)
        if service is None:
            yield _not_serving()
            return
        async for part in getattr(service, method)(_prepend(first, requests), context):
            yield part


def _named_stage(request: Request) -> int | None:
    """The stage a request's metadata names, read without trusting it (the service validates it all)."""
    try:
        metadata = unpack(request.metadata)
    except Exception:
        return None
    stage = metadata.get("stage") if isinstance(metadata, dict) else None
    return stage if type(stage) is int else None


def _not_serving() -> Reply:
    return make_error_reply("this peer serves no stage right now; try another peer", ErrorCode.BUSY)


async def _prepend(first: Request, rest: AsyncIterator[Request]) -> AsyncIterator[Request]:
    yield first
    async for part in rest:
        yield part
