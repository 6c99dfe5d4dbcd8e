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

Limits, each answered with an error frame and the close: a hello over ``HELLO_MAX_BYTES`` (refused
on its length, before its bytes are read) or not in within ``server.local_hello_timeout_s``; a frame
not in full within ``server.local_frame_timeout_s`` of its first byte; a connection past
``server.local_max_connections``. A connection may stay idle between calls for as long as it likes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.auth import token_matches
from kvstore.errors import KVStoreError, from_status_code
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.config import ServerConfig
    from kvstore.stats import Stats

log = logging.getLogger("kvstore.local")

_LEN = struct.Struct(">I")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL
METHODS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods)
_STATUS = {c.value[0]: c for c in grpc.StatusCode}
HELLO_MAX_BYTES = 4096  # the hello carries the token only (a longer token raises the limit to fit it)
_ACCEPT_BACKOFF_MIN, _ACCEPT_BACKOFF_MAX = 0.01, 1.0  # seconds between accepts that fail


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


def _error(code: grpc.StatusCode, details: str) -> bytes:
    return _frame(bytes((code.value[0],)), details.encode())


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


class _Refusal(Exception):
    """The server's own error answer on a connection it then closes."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.frame = code, _error(code, details)


def connection_cap(configured: int) -> int:
    """``configured``, but at most half the process's open-file limit: idle local connections must
    leave descriptors to gRPC, HTTP and the tiers (at the limit every accept and open fails)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return configured if soft == resource.RLIM_INFINITY else max(1, min(configured, soft // 2))


class _Throttled:
    """A warning logged at most once per ``interval`` seconds, with how many were held back."""

    def __init__(self, interval: float = 10.0) -> None:
        self._interval = interval
        self._last = -interval
        self._held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        if held:
            msg, args = msg + " (%d more since the last warning)", (*args, held)
        log.warning(msg, *args)


class LocalServer:
    """Serves the servicer's unary methods on a Unix socket (one task per connection).

    Its own accept loop: at most ``local_max_connections`` connections (fewer when the process's
    file limit is low, see :func:`connection_cap`); one more is answered RESOURCE_EXHAUSTED and
    closed at once. An accept that fails (out of file descriptors) backs off, logged at most every
    10 s. A connection must send its hello within ``local_hello_timeout_s`` and, once a frame's first
    byte has arrived, the rest within ``local_frame_timeout_s``; between calls it may stay idle
    (clients pool connections)."""

    def __init__(self, servicer: Any, path: Path, config: ServerConfig, stats: Stats) -> None:
        self.path = path
        self._token = config.auth_token.encode()
        self._max = config.max_message_bytes
        self._hello_max = max(HELLO_MAX_BYTES, 1 + len(self._token))
        self._hello_timeout = config.local_hello_timeout_s
        self._frame_timeout = config.local_frame_timeout_s
        self._cap = connection_cap(config.local_max_connections)
        if self._cap < config.local_max_connections:
            log.warning("local socket: at most %d connections (server.local_max_connections %d is over half the "
                        "open-file limit)", self._cap, config.local_max_connections)
        self._stats = stats
        self._handlers = {name: (getattr(servicer, name), getattr(pb, f"{name}Request")) for name in METHODS}
        self._context = _Context()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._refused_warning = _Throttled()
        self._accept_warning = _Throttled()

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a socket left by a killed sidecar
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # created 0600, never briefly wider
            try:
                listener.bind(str(self.path))
            finally:
                os.umask(old)
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_loop(listener), name="kvstore-local-accept")

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.path.unlink(missing_ok=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = _ACCEPT_BACKOFF_MIN
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: wait for some to be freed
                self._accept_warning.warning("local socket: accept failed (%s); retrying in %.2f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _ACCEPT_BACKOFF_MAX)
                continue
            backoff = _ACCEPT_BACKOFF_MIN
            if len(self._connections) >= self._cap:
                self._refuse(conn)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    def _refuse(self, conn: socket.socket) -> None:
        """Over the cap: the error frame (a fresh socket's buffer takes it without blocking), closed."""
        refusal = _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"local socket: too many connections ({self._cap} open, server.local_max_connections)")
        self._count(refusal)
        self._refused_warning.warning("local socket: connection refused: %d open, the limit", self._cap)
        with contextlib.suppress(OSError):
            conn.send(refusal.frame)
        conn.close()

    def _count(self, refusal: _Refusal) -> None:
        self._stats.errors[refusal.code.name] += 1

    async def _serve(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn)
        except BaseException:
            conn.close()
            raise
        try:
            await self._hello(reader, writer)
            while True:
                first = await reader.readexactly(1)  # idle between calls: no deadline
                name, payload = await self._read_call(reader, first)
                writer.write(await self._call(name, payload))
                try:
                    async with asyncio.timeout(self._frame_timeout):
                        await writer.drain()  # a client that stops reading must not grow our buffer
                except TimeoutError:
                    writer.transport.abort()
                    return
        except _Refusal as refusal:
            self._count(refusal)
            writer.write(refusal.frame)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The first frame, in ``local_hello_timeout_s``: the token, or the connection is refused."""
        try:
            async with asyncio.timeout(self._hello_timeout):
                (n,) = _LEN.unpack(await reader.readexactly(4))
                if n > self._hello_max or n == 0:
                    raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"hello: {n} bytes, limit {self._hello_max}")
                body = await reader.readexactly(n)
        except TimeoutError:
            raise _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"hello: none within {self._hello_timeout} s (server.local_hello_timeout_s)") from None
        name = body[1 : 1 + body[0]].decode("ascii", "replace")
        payload = body[1 + body[0] :]
        if name or not token_matches(payload, self._token):
            raise _Refusal(grpc.StatusCode.UNAUTHENTICATED, "local socket: missing or wrong token")
        writer.write(_frame(b"\0"))

    async def _read_call(self, reader: asyncio.StreamReader, first: bytes) -> tuple[str, bytes]:
        """The rest of a call's frame, whose first byte is ``first``, in ``local_frame_timeout_s``."""
        try:
            async with asyncio.timeout(self._frame_timeout):
                (n,) = _LEN.unpack(first + await reader.readexactly(3))
                if n > self._max or n == 0:
                    raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"frame: {n} bytes, limit {self._max} (server.max_message_bytes)")
                body = await reader.readexactly(n)
        except TimeoutError:
            raise _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"frame: not complete within {self._frame_timeout} s "
                           "(server.local_frame_timeout_s)") from None
        return body[1 : 1 + body[0]].decode("ascii", "replace"), body[1 + body[0] :]

    async def _call(self, name: str, payload: bytes) -> bytes:
        handler = self._handlers.get(name)
        if handler is None:
            return _error(grpc.StatusCode.UNIMPLEMENTED, f"method: unknown {name!r}")
        method, request_type = handler
        try:
            request = request_type.FromString(payload)
        except DecodeError as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a {request_type.__name__}: {exc}")
        try:
            response = await method(request, self._context)
        except _Abort as exc:
            return _error(exc.code, exc.details)
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
            with contextlib.suppress(BrokenPipeError):  # refused at once (too many connections): read why
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
