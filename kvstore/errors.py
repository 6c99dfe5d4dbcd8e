"""One exception hierarchy for the service and its clients.

Each error says whether retrying can help, and carries the gRPC status it maps to. The mapping to
status codes happens in exactly one place: the ``_rpc`` wrapper around every method of
``kvstore.server.service.KVStoreServicer`` (the local socket serves the same servicer). Clients turn
status codes back into these classes with :func:`from_status_code`.
"""

from __future__ import annotations

import grpc

SHOWN_CHARS = 64  # of a client-sent value an error message repeats
MAX_MESSAGE_CHARS = 2048  # of a status message: far under gRPC's 16 KiB metadata limit


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to ``SHOWN_CHARS`` characters: a message repeats
    what the client sent, and a status message over gRPC's 16 KiB metadata limit reaches the
    client as RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit"), not its code."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


class KVStoreError(Exception):
    """Base class. ``retryable`` says whether the same call may succeed later."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False


class InvalidArgument(KVStoreError):
    """A malformed request; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVStoreError):
    """An allocation, lease or block the request names does not exist (or no longer does)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KVStoreError):
    """The request is well formed but out of order (commit after abort, twice, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KVStoreError):
    """Nothing could be evicted to make room. Retrying after leases expire may help."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class ChecksumMismatch(KVStoreError):
    """Block bytes do not match their checksum. Never served: treated as a miss."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(KVStoreError):
    """A server or tier cannot be reached right now."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class Unauthenticated(KVStoreError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ConfigError(KVStoreError):
    """An invalid configuration value; raised at start-up, names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        ChecksumMismatch,
        Unavailable,
        Unauthenticated,
    )
}


def from_status_code(code: grpc.StatusCode, message: str) -> KVStoreError:
    """The client-side twin of the server's mapping."""
    exc = _BY_CODE.get(code, KVStoreError)(message)
    if exc.__class__ is KVStoreError:
        exc.code = code
        exc.retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return exc
