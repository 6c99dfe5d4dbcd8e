"""Bearer-token check for the gRPC server (``server.auth_token``).

    server = grpc.aio.server(interceptors=[TokenInterceptor(token)])

Every call must carry ``authorization: Bearer <token>`` metadata (what
``KVStoreClient.from_url(url, token=...)`` sends); otherwise it ends with UNAUTHENTICATED before
reaching the servicer. The standard health service stays open so orchestrators can probe the
sidecar without the secret. :func:`~kvstore.util.tokens.token_matches` is the one comparison of a
supplied secret: gRPC metadata here, HTTP headers in :mod:`kvstore.server.http`, the hello of
:mod:`kvstore.server.local_server`, the cluster token in :mod:`kvstore.cluster.peer_server`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvstore.util.tokens import token_matches

__all__ = ["OPEN_PREFIXES", "TokenInterceptor", "token_matches"]

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Context = grpc.aio.ServicerContext[Any, Any]


def _deny(message: str) -> Callable[[Any, Context], Awaitable[Any]]:
    async def deny(request_or_iterator: Any, context: Context) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return deny


def _deny_stream(message: str) -> Callable[[Any, Context], AsyncIterator[Any]]:
    async def deny(request_or_iterator: Any, context: Context) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    return deny


def _rejecting(handler: grpc.RpcMethodHandler[Req, Resp], message: str) -> grpc.RpcMethodHandler[Req, Resp]:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    deser, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny_stream(message), deser, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny(message), deser, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny_stream(message), deser, ser)
    return grpc.unary_unary_rpc_method_handler(_deny(message), deser, ser)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenInterceptor: empty token")
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return token_matches(value, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _rejecting(handler, "missing or wrong bearer token (authorization: Bearer <token>)")
