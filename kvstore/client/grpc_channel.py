"""The gRPC transport of the clients: the channel for a URL, the bearer token on every call, and
gRPC errors turned into :mod:`kvstore.errors` exceptions. :class:`GrpcChannel` is the blocking
transport (gRPC's synchronous stub, on the caller's own thread), :class:`AsyncGrpcChannel` the
asyncio one; both have the one ``call(name, request, timeout)`` of :mod:`kvstore.client.calls`."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf.message import Message

from kvstore.errors import KVStoreError, from_status_code
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE = 64 << 20
Metadata = tuple[tuple[str, str], ...]


class _Token(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)


def open_channel(
    url: str, token: str, root_certificates: bytes | None, max_message_bytes: int, aio: bool,
) -> tuple[Any, Metadata]:
    """A channel for grpc://host:port, grpcs://host:port, host:port or unix:/path, and the
    metadata every call must carry."""
    tls = url.startswith("grpcs://")
    target = url.split("://", 1)[1] if url.startswith(("grpc://", "grpcs://")) else url
    options = [
        ("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes),
    ]
    mod = grpc.aio if aio else grpc
    if tls or root_certificates:
        creds = grpc.ssl_channel_credentials(root_certificates)
        if token:  # over TLS the token travels as call credentials
            creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_Token(token)))
        return mod.secure_channel(target, creds, options=options), ()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return mod.insecure_channel(target, options=options), metadata


def _not_ready(timeout: float) -> KVStoreError:
    return from_status_code(grpc.StatusCode.UNAVAILABLE, f"sidecar not reachable within {timeout}s")


class GrpcChannel:
    """Blocking calls on gRPC's synchronous stub (thread-safe; no event loop)."""

    kind = "grpc"

    def __init__(self, channel: grpc.Channel, metadata: Metadata = ()) -> None:
        self.channel = channel
        self.stub = pb_grpc.KVStoreStub(channel)  # type: ignore[no-untyped-call]  # generated, unannotated
        self._metadata = metadata

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        try:
            return getattr(self.stub, name)(request, metadata=self._metadata, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            raise from_status_code(code, exc.details() or code.name) from None

    def wait_ready(self, timeout: float) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise _not_ready(timeout) from None

    def close(self) -> None:
        self.channel.close()


class AsyncGrpcChannel:
    """Calls on a ``grpc.aio`` channel's stub."""

    kind = "grpc"

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata = ()) -> None:
        self.channel = channel
        self.stub = pb_grpc.KVStoreStub(channel)  # type: ignore[no-untyped-call]  # generated, unannotated
        self._metadata = metadata

    async def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        try:
            return await getattr(self.stub, name)(request, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_status_code(exc.code(), exc.details() or exc.code().name) from None

    async def wait_ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except TimeoutError:
            raise _not_ready(timeout) from None

    async def aclose(self) -> None:
        await self.channel.close()
