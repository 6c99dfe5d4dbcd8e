"""The local socket's wire format: the kvstore.v1 calls over a Unix socket on the sidecar's host.

The server end is :mod:`kvstore.server.local_server`, the client ends :mod:`kvstore.client.local_channel`.

A gRPC call after an idle spell wakes several threads on each side (C-core pollers, the asyncio
loop): a Lookup after 0.3 s idle took 2.9-4.3 ms on the 2-core test machine, against 0.6 ms for a
plain Unix-socket round trip to an asyncio server. An engine's lookup sits on a request's time to
first token, so co-located clients (``SyncClient``, which the engine connectors use, and
``KVStoreClient``) send their calls here. Requests and responses are the kvstore.v1 protobuf
messages, handled by the same servicer methods as over gRPC (same validation, same errors); only the
framing differs. A client learns the socket's path from the ``Hello`` RPC; one that cannot open it
(another host, another container) stays on gRPC.

Framing, both directions: a big-endian u32 length of the rest of the frame, then

* request:  u8 length of the method name, the method name (ASCII, e.g. ``Lookup``), the
  serialized request message;
* response: u8 status (``grpc.StatusCode`` value; 0 is OK), then the serialized response message
  (OK) or the UTF-8 error message.

The first frame of a connection is the hello: method name ``""``, payload the bearer token
(``server.auth_token``, empty when none), answered OK or UNAUTHENTICATED (and closed). The OK
answer's payload is the longest call frame the sidecar takes (``server.max_message_bytes``, a
big-endian u32; absent from older sidecars): a client refuses a longer call itself, before sending
any of it, with the RESOURCE_EXHAUSTED the sidecar would give (as a gRPC client refuses a message
over its limit). The socket file is created 0600: the shared-memory slab is 0600 too, so its
clients run as the same user.

Limits, each answered with an error frame and the close: a hello over ``HELLO_MAX_BYTES`` (refused
on its length, before its bytes are read) or not in within ``server.local_hello_timeout_s``; a frame
not in full within ``server.local_frame_timeout_s`` of its first byte; a connection past
``server.local_max_connections``. A connection may stay idle between calls for as long as it likes.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.errors import KVStoreError, from_status_code
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.stream import recv_bytes, recv_bytes_async

LEN = struct.Struct(">I")
SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL
METHODS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods)
STATUS = {c.value[0]: c for c in grpc.StatusCode}
CLOSED = "sidecar closed the local socket"
HELLO_MAX_BYTES = 4096  # the hello carries the token only (a longer token raises the limit to fit it)


def socket_path(configured: str, data_dir: str | Path, segment: str) -> Path | None:
    """Where the sidecar listens: ``configured``; "" means ``<data_dir>/kvstore.sock`` (or, when
    that is longer than a socket path may be, ``$TMPDIR/kvstore-<segment>.sock``); "off": nowhere."""
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    path = Path(data_dir).resolve() / "kvstore.sock"
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        path = Path(tempfile.gettempdir()) / f"kvstore-{segment.strip('/')}.sock"
    return path


def frame(*parts: bytes) -> bytes:
    body = b"".join(parts)
    return LEN.pack(len(body)) + body


def error_frame(code: grpc.StatusCode, details: str) -> bytes:
    return frame(bytes((code.value[0],)), details.encode())


def hello_answer(limit: int) -> bytes:
    """The hello's OK answer: the longest call frame the sidecar takes (its length prefix aside)."""
    return frame(b"\0", LEN.pack(min(limit, (1 << 32) - 1)))


def hello_limit(payload: bytes) -> int:
    """The limit a hello's OK answer carries; 0 when it carries none (an older sidecar)."""
    return LEN.unpack(payload[: LEN.size])[0] if len(payload) >= LEN.size else 0


def frame_refusal(n: int, limit: int) -> str:
    """Why a call frame of ``n`` bytes (its length prefix aside) is refused under ``limit``
    (``server.max_message_bytes``), answered RESOURCE_EXHAUSTED; "" when it is not. The sidecar
    decides with it on a frame's length, a client on its request before it sends any of it."""
    return "" if 0 < n <= limit else f"frame: {n} bytes, limit {limit} (server.max_message_bytes)"


def request_frame(name: str, request: Message) -> bytes:
    wire = name.encode()
    return frame(bytes((len(wire),)), wire, request.SerializeToString())


def response(name: str, status: int, payload: bytes) -> Any:
    """The call's response message, or its error raised as the one gRPC would give (an OK answer
    that is not a ``<name>Response``: INTERNAL, as a gRPC client's failure to deserialize one)."""
    if status:
        raise from_status_code(STATUS.get(status, grpc.StatusCode.UNKNOWN), payload.decode("utf-8", "replace"))
    try:
        return getattr(pb, f"{name}Response").FromString(payload)
    except DecodeError as exc:
        raise from_status_code(
            grpc.StatusCode.INTERNAL, f"local socket: the {name} answer cannot be decoded ({exc})"
        ) from None


def unavailable(path: str, exc: BaseException) -> KVStoreError:
    return from_status_code(grpc.StatusCode.UNAVAILABLE, f"local socket {path}: {str(exc) or type(exc).__name__}")


async def read_async(s: socket.socket) -> tuple[int, bytes]:
    """:func:`read_frame` from a non-blocking socket, on the running loop."""
    head = await recv_bytes_async(s, 4, CLOSED)
    return _split(await recv_bytes_async(s, LEN.unpack(head)[0], CLOSED))


def read_frame(s: socket.socket) -> tuple[int, bytes]:
    """One frame from a blocking socket: its status byte and the rest."""
    head = recv_bytes(s, 4, CLOSED)
    return _split(recv_bytes(s, LEN.unpack(head)[0], CLOSED))


class BrokenStream(ConnectionResetError):
    """The peer sent a frame this format does not allow: the connection is dropped, as when the
    peer closes it, and nothing after that frame is read (it cannot be trusted to be the answer of
    the call that comes next)."""


def _split(body: bytes) -> tuple[int, bytes]:
    """A frame's status byte and payload; a frame without a status byte breaks the stream
    (:class:`BrokenStream`)."""
    if not body:
        raise BrokenStream("the local socket's peer sent an empty frame (no status byte)")
    return body[0], body[1:]
