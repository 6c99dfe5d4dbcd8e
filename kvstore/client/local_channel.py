"""The client ends of the local socket (wire format: :mod:`kvstore.framing`): a blocking channel
(one connection per calling thread) and an asyncio one (a connection per call in flight), each a
transport with the one ``call(name, request, timeout)`` of :mod:`kvstore.client.wire`.
:func:`open_local` and :func:`open_local_async` open one only where the socket answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import Any

from google.protobuf.message import Message

from kvstore.errors import KVStoreError, from_status_code
from kvstore.framing import (
    STATUS,
    frame,
    read_async,
    read_frame,
    request_frame,
    response,
    unavailable,
)
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.client")


class LocalChannel:
    """The client end: one connection per calling thread (calls on it are serial), opened on first use."""

    kind = "local"

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
                s.sendall(frame(b"\0", self._token))
            status, message = read_frame(s)
            if status:
                raise from_status_code(STATUS[status], message.decode())
        except BaseException:
            s.close()
            raise
        with self._lock:
            self._socks.append(s)
        return s

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """One call; a connection that broke while idle (the sidecar restarted) is reopened and
        the call sent once more (a sidecar that died mid-call took the call's effects with it)."""
        s: socket.socket | None = getattr(self._local, "sock", None)
        frame = request_frame(name, request)
        for attempt in (0, 1):
            reused = s is not None
            try:
                if s is None:
                    s = self._local.sock = self._connect()
                s.settimeout(timeout or self._timeout)
                s.sendall(frame)
                status, payload = read_frame(s)
                break
            except OSError as exc:
                self._drop(s)
                s = None
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue
                raise unavailable(self.path, exc) from None
        return response(name, status, payload)

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

    kind = "local"

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
            writer.write(frame(b"\0", self._token))
            status, message = await asyncio.wait_for(read_async(reader), self._timeout)
            if status:
                raise from_status_code(STATUS[status], message.decode())
        except BaseException:
            self._close(writer)
            raise
        return reader, writer

    async def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """One call; a connection that broke while idle (the sidecar restarted) is reopened and
        the call sent once more. A call that times out or is cancelled closes its connection:
        its answer may still be on the way."""
        conn = self._idle.pop() if self._idle else None
        frame = request_frame(name, request)
        for attempt in (0, 1):
            reused = conn is not None
            try:
                if conn is None:
                    conn = await self._connect()
                conn[1].write(frame)
                status, payload = await asyncio.wait_for(read_async(conn[0]), timeout or self._timeout)
                self._idle.append(conn)
                break
            except BaseException as exc:
                if conn is not None:
                    self._close(conn[1])
                conn = None
                if not isinstance(exc, (OSError, asyncio.IncompleteReadError)):
                    raise  # cancelled, or the sidecar's own error
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue  # broke while idle: the call never reached the sidecar
                raise unavailable(self.path, exc) from None  # (a timed-out call may have: not sent again)
        return response(name, status, payload)

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def aclose(self) -> None:
        writers, self._open, self._idle = list(self._open), set(), []
        for w in writers:
            w.close()
        for w in writers:
            with contextlib.suppress(OSError):
                await w.wait_closed()


def open_local(path: str, token: str) -> LocalChannel | None:
    """A channel to the socket at ``path`` once a Hello went through it, else None."""
    channel = LocalChannel(path, token=token)
    try:
        channel.call("Hello", pb.HelloRequest())
    except KVStoreError as exc:  # another host or container: the path is not ours to open
        log.info("local socket %s not usable (%s); using gRPC", path, exc)
        channel.close()
        return None
    return channel


async def open_local_async(path: str, token: str) -> AsyncLocalChannel | None:
    """:func:`open_local` for asyncio."""
    channel = AsyncLocalChannel(path, token=token)
    try:
        await channel.call("Hello", pb.HelloRequest())
    except KVStoreError as exc:  # another host or container: the path is not ours to open
        log.info("local socket %s not usable (%s); using gRPC", path, exc)
        await channel.aclose()
        return None
    return channel
