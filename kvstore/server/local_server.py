"""The sidecar's end of the local socket (wire format: :mod:`kvstore.wire.framing`): the servicer's unary
methods served on a Unix socket, one task per connection, with its own accept loop and limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.server.auth import token_matches
from kvstore.util.backoff import accept_backoff
from kvstore.util.logs import Throttled
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import HELLO_MAX_BYTES, LEN, METHODS, error_frame, frame, frame_refusal, hello_answer

if TYPE_CHECKING:
    from kvstore.config import ServerConfig
    from kvstore.stats.counters import Stats

log = logging.getLogger(__name__)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses: ``abort``; and the transport
    its calls are timed under (the ``rpc`` latency histogram's label; gRPC's context has none)."""

    transport = "local"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)


class _Refusal(Exception):
    """The server's own error answer on a connection it then closes."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.frame = code, error_frame(code, details)


def connection_cap(configured: int) -> int:
    """``configured``, but at most half the process's open-file limit: idle local connections must
    leave descriptors to gRPC, HTTP and the tiers (at the limit every accept and open fails)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return configured if soft == resource.RLIM_INFINITY else max(1, min(configured, soft // 2))


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
        self._servicer = servicer
        self._handlers = {name: (getattr(servicer, name), getattr(pb, f"{name}Request")) for name in METHODS}
        self._context = _Context()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], socket.socket] = {}  # each connection's task: its socket
        self._closing = False  # the loops end at their next turn (a cancellation can be lost: close)
        self._refused_warning = Throttled(log)
        self._accept_warning = Throttled(log)

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
        # Cancelled, and told to end: a cancellation can be lost. On Python 3.11 asyncio.wait_for,
        # which redis-py runs every socket write under (a call that promotes from a Redis tier),
        # returns the write's result instead of raising CancelledError when the cancel lands in
        # the loop pass in which the write finished (CPython gh-86296, fixed in 3.12). A connection
        # whose handler lost it answers the call in hand and ends at the loop's next turn; one
        # asleep in its idle read (which has no deadline) is woken by its socket's shutdown.
        self._closing = True
        for conn in self._connections.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
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
        backoff = accept_backoff()
        while not self._closing:
            try:
                conn, _ = await loop.sock_accept(listener)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: wait for some to be freed
                wait = backoff.next()
                self._accept_warning.warning("local socket: accept failed (%s); retrying in %.2f s", exc, wait)
                await asyncio.sleep(wait)
                continue
            backoff.reset()
            if self._closing:  # accepted as close() began: not served
                conn.close()
                return
            if len(self._connections) >= self._cap:
                self._refuse(conn)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._connections[task] = conn
            task.add_done_callback(self._gone)

    def _gone(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)

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
            while not self._closing:
                first = await reader.readexactly(1)  # idle between calls: no deadline (close wakes it)
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
                (n,) = LEN.unpack(await reader.readexactly(4))
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
        writer.write(hello_answer(self._max))

    async def _read_call(self, reader: asyncio.StreamReader, first: bytes) -> tuple[str, bytes]:
        """The rest of a call's frame, whose first byte is ``first``, in ``local_frame_timeout_s``."""
        try:
            async with asyncio.timeout(self._frame_timeout):
                (n,) = LEN.unpack(first + await reader.readexactly(3))
                if why := frame_refusal(n, self._max):
                    raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
                body = await reader.readexactly(n)
        except TimeoutError:
            raise _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"frame: not complete within {self._frame_timeout} s "
                           "(server.local_frame_timeout_s)") from None
        return body[1 : 1 + body[0]].decode("ascii", "replace"), body[1 + body[0] :]

    async def _call(self, name: str, payload: bytes) -> bytes:
        handler = self._handlers.get(name)
        if handler is None:
            return error_frame(grpc.StatusCode.UNIMPLEMENTED, f"method: unknown {name!r}")
        method, request_type = handler
        try:
            request = request_type.FromString(payload)
        except DecodeError as exc:  # counted and logged as over gRPC
            return error_frame(grpc.StatusCode.INVALID_ARGUMENT, self._servicer.bad_request(name, request_type, exc))
        try:
            response = await method(request, self._context)
        except _Abort as exc:
            return error_frame(exc.code, exc.details)
        return frame(b"\0", response.SerializeToString())


