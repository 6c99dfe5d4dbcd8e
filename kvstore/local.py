"""Local transport: the kvstore.v1 calls over a Unix socket, for clients on the sidecar's host.

A gRPC call after an idle spell wakes several threads on each side (C-core pollers, the asyncio
loop): a Lookup after 0.3 s idle took 2.9-4.3 ms on the 2-core test machine, against 0.6 ms for a
plain Unix-socket round trip to an asyncio server. An engine's lookup sits on a request's time to
first token, so co-located clients (``SyncClient``, which the engine connectors use, and
``KVStoreClient``) send their calls here. Requests and responses are the kvstore.v1 protobuf messages, handled by the same
servicer methods as over gRPC (same validation, same errors); only the framing differs. A client
learns the socket's path from the ``Hello`` RPC; one that cannot open it (another host, another
container) stays on gRPC.

Framing, both directions: a big-endian u32 length of the rest of the frame, then

* request:  u8 length of the method name, the method name (ASCII, e.g. ``Lookup``), the
  serialized request message;
* response: u8 status (``grpc.StatusCode`` value; 0 is OK), then the serialized response message
  (OK) or the UTF-8 error message.

The first frame of a connection is the hello: method name ``""``, payload the bearer token
(``server.auth_token``, empty when none), answered OK or UNAUTHENTICATED (and closed). The socket
file is created 0600: the shared-memory slab is 0600 too, so its clients run as the same user.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.auth import token_matches
from kvstore.errors import KVStoreError, from_status_code
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.local")

_LEN = struct.Struct(">I")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL
METHODS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods)
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def socket_path(configured: str, data_dir: str | Path, segment: str) -> Path | None:
    """Where the sidecar listens: ``configured``; "" means ``<data_dir>/kvstore.sock`` (or, when
    that is longer than a socket path may be, ``$TMPDIR/kvstore-<segment>.sock``); "off": nowhere."""
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    path = Path(data_dir).resolve() / "kvstore.sock"
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        path = Path(tempfile.gettempdir()) / f"kvstore-{segment.strip('/')}.sock"
    return path


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses: ``abort``."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)


def _frame(*parts: bytes) -> bytes:
    body = b"".join(parts)
    return _LEN.pack(len(body)) + body


def _request(name: str, request: Message) -> bytes:
    wire = name.encode()
    return _frame(bytes((len(wire),)), wire, request.SerializeToString())


def _response(name: str, status: int, payload: bytes) -> Any:
    """The call's response message, or its error raised as the one gRPC would give."""
    if status:
        raise from_status_code(_STATUS.get(status, grpc.StatusCode.UNKNOWN), payload.decode("utf-8", "replace"))
    return getattr(pb, f"{name}Response").FromString(payload)


def _unavailable(path: str, exc: BaseException) -> KVStoreError:
    return from_status_code(grpc.StatusCode.UNAVAILABLE, f"local socket {path}: {str(exc) or type(exc).__name__}")


class LocalServer:
    """Serves the servicer's unary methods on a Unix socket (one task per connection)."""

    def __init__(self, servicer: Any, path: Path, *, token: str = "", max_message_bytes: int = 64 << 20) -> None:
        self.path = path
        self._token = token.encode()
        self._max = max_message_bytes
        self._handlers = {name: (getattr(servicer, name), getattr(pb, f"{name}Request")) for name in METHODS}
        self._server: asyncio.AbstractServer | None = None
        self._context = _Context()

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a socket left by a killed sidecar
        old = os.umask(0o177)  # created 0600, never briefly wider
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        authed = False
        try:
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(4))
                if n > self._max or n == 0:
                    writer.write(_frame(bytes((grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],)),
                                        f"frame: {n} bytes, limit {self._max} (server.max_message_bytes)".encode()))
                    break
                body = await reader.readexactly(n)
                name = body[1 : 1 + body[0]].decode("ascii", "replace")
                payload = body[1 + body[0] :]
                if not authed:
                    if name or not token_matches(payload, self._token):
                        writer.write(_frame(bytes((grpc.StatusCode.UNAUTHENTICATED.value[0],)), b"local socket: missing or wrong token"))
                        break
                    authed = True
                    writer.write(_frame(b"\0"))
                    continue
                writer.write(await self._call(name, payload))
                await writer.drain()  # a client that stops reading must not grow our buffer
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()

    async def _call(self, name: str, payload: bytes) -> bytes:
        handler = self._handlers.get(name)
        if handler is None:
            return _frame(bytes((grpc.StatusCode.UNIMPLEMENTED.value[0],)), f"method: unknown {name!r}".encode())
        method, request_type = handler
        try:
            request = request_type.FromString(payload)
        except DecodeError as exc:
            return _frame(bytes((grpc.StatusCode.INVALID_ARGUMENT.value[0],)), f"request: not a {request_type.__name__}: {exc}".encode())
        try:
            response = await method(request, self._context)
        except _Abort as exc:
            return _frame(bytes((exc.code.value[0],)), exc.details.encode())
        return _frame(b"\0", response.SerializeToString())


class LocalChannel:
    """The client end: one connection per calling thread (calls on it are serial), opened on first use."""

    def __init__(self, path: str, *, token: str = "", timeout: float = 30.0) -> None:
        self.path = path
        self._token = token.encode()
        self._timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self._timeout)
            s.connect(self.path)
            s.sendall(_frame(b"\0", self._token))
            status, message = self._read(s)
            if status:
                raise from_status_code(_STATUS[status], message.decode())
        except BaseException:
            s.close()
            raise
        with self._lock:
            self._socks.append(s)
        return s

    @staticmethod
    def _read(s: socket.socket) -> tuple[int, bytes]:
        head = _recv_exactly(s, 4)
        body = _recv_exactly(s, _LEN.unpack(head)[0])
        return body[0], body[1:]

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """One call; a connection that broke while idle (the sidecar restarted) is reopened and
        the call sent once more (a sidecar that died mid-call took the call's effects with it)."""
        s: socket.socket | None = getattr(self._local, "sock", None)
        frame = _request(name, request)
        for attempt in (0, 1):
            reused = s is not None
            try:
                if s is None:
                    s = self._local.sock = self._connect()
                s.settimeout(timeout or self._timeout)
                s.sendall(frame)
                status, payload = self._read(s)
                break
            except OSError as exc:
                self._drop(s)
                s = None
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue
                raise _unavailable(self.path, exc) from None
        return _response(name, status, payload)

    def _drop(self, s: socket.socket | None) -> None:
        self._local.sock = None
        if s is not None:
            with self._lock:
                if s in self._socks:
                    self._socks.remove(s)
            s.close()

    def close(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()


class AsyncLocalChannel:
    """The client end for asyncio: connections opened on first use, one call on each at a time
    (a call takes an idle connection, or opens one when all are busy)."""

    def __init__(self, path: str, *, token: str = "", timeout: float = 30.0) -> None:
        self.path = path
        self._token = token.encode()
        self._timeout = timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), self._timeout)
        self._open.add(writer)
        try:
            writer.write(_frame(b"\0", self._token))
            status, message = await asyncio.wait_for(_read_async(reader), self._timeout)
            if status:
                raise from_status_code(_STATUS[status], message.decode())
        except BaseException:
            self._close(writer)
            raise
        return reader, writer

    async def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """One call; a connection that broke while idle (the sidecar restarted) is reopened and
        the call sent once more. A call that times out or is cancelled closes its connection:
        its answer may still be on the way."""
        conn = self._idle.pop() if self._idle else None
        frame = _request(name, request)
        for attempt in (0, 1):
            reused = conn is not None
            try:
                if conn is None:
                    conn = await self._connect()
                conn[1].write(frame)
                status, payload = await asyncio.wait_for(_read_async(conn[0]), timeout or self._timeout)
                break
            except BaseException as exc:
                if conn is not None:
                    self._close(conn[1])
                conn = None
                if not isinstance(exc, (OSError, asyncio.IncompleteReadError)):
                    raise  # cancelled, or the sidecar's own error
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue  # broke while idle: the call never reached the sidecar
                raise _unavailable(self.path, exc) from None  # (a timed-out call may have: not sent again)
        self._idle.append(conn)
        return _response(name, status, payload)

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def aclose(self) -> None:
        writers, self._open, self._idle = list(self._open), set(), []
        for w in writers:
            w.close()
        for w in writers:
            try:
                await w.wait_closed()
            except OSError:
                pass


async def _read_async(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readexactly(4)
    body = await reader.readexactly(_LEN.unpack(head)[0])
    return body[0], body[1:]


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise ConnectionResetError("sidecar closed the local socket")
        got += k
    return bytes(buf)
