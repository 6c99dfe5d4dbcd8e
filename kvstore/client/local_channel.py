"""The client ends of the local socket (wire format: :mod:`kvstore.wire.framing`): a blocking channel
(one connection per calling thread) and an asyncio one (a connection per call in flight), each a
transport with the one ``call(name, request, timeout)`` of :mod:`kvstore.client.calls`.
:func:`open_local` and :func:`open_local_async` open one only where the socket answers.

Both ends treat a call alike. A request over the limit the sidecar gave at hello is refused before
any of it is sent (RESOURCE_EXHAUSTED, what the sidecar would answer, as a gRPC client refuses a
message over its limit). A call whose sending fails reads the answer the sidecar wrote before it
closed the connection (a refusal), if one waits in the socket, and raises that. A call is sent once
more only when nothing of it went out on a pooled connection that broke while idle (the sidecar
restarted); once any of it went out, or it timed out, it fails UNAVAILABLE: the sidecar may have
applied it (a Commit must not be applied twice)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import Any

import grpc
from google.protobuf.message import Message

from kvstore.errors import KVStoreError, from_status_code
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.framing import (
    LEN,
    STATUS,
    BrokenStream,
    frame,
    frame_refusal,
    hello_limit,
    read_async,
    read_frame,
    request_frame,
    response,
    unavailable,
)

log = logging.getLogger(__name__)


def within_limit(request: bytes, limit: int) -> None:
    """Refuse a request frame over ``limit`` (0: none known) as the sidecar would."""
    if limit and (why := frame_refusal(len(request) - LEN.size, limit)):
        raise from_status_code(grpc.StatusCode.RESOURCE_EXHAUSTED, why)


def after_failure(path: str, s: socket.socket | None, exc: OSError, idle_break: bool) -> tuple[int, bytes] | None:
    """What a call that failed with ``exc`` on ``s`` (None: not connected) comes to: the answer the
    sidecar wrote before it closed the connection, read whole from the socket; else None, to send
    the call once more, when ``idle_break`` (a pooled connection, nothing of the call sent); else
    UNAVAILABLE, raised. A timed-out call's connection is still open: its answer is not awaited; a
    broken stream's next frame is not the call's answer (:class:`~kvstore.wire.framing.BrokenStream`)."""
    if s is not None and not isinstance(exc, (TimeoutError, BrokenStream)):
        s.setblocking(False)  # what the sidecar wrote before it closed is in the socket already
        with contextlib.suppress(OSError):
            return read_frame(s)
    if idle_break and not isinstance(exc, TimeoutError):
        return None
    raise unavailable(path, exc) from None


def connect(path: str, token: bytes, timeout: float) -> tuple[socket.socket, int]:
    """A connection to the socket at ``path`` once its hello went through (blocking, each call
    bounded by ``timeout``), and the longest call frame the sidecar takes (0: not known). The
    sidecar's refusal raises its error; a socket that cannot be opened, the ``OSError``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(path)
        with contextlib.suppress(BrokenPipeError):  # refused at once (too many connections): read why
            s.sendall(frame(b"\0", token))
        status, message = read_frame(s)
        if status:
            raise from_status_code(STATUS[status], message.decode())
    except BaseException:
        s.close()
        raise
    return s, hello_limit(message)


class LocalChannel:
    """The client end: one connection per calling thread (calls on it are serial), opened on first use."""

    kind = "local"

    def __init__(self, path: str, *, token: str = "", timeout: float = 30.0) -> None:
        self.path = path
        self._token = token.encode()
        self._timeout = timeout
        self._limit = 0  # the longest call frame the sidecar takes, from its hello (0: not known)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []

    def _connect(self) -> socket.socket:
        s, self._limit = connect(self.path, self._token, self._timeout)
        with self._lock:
            self._socks.append(s)
        return s

    def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """One call (the module's docstring says when it is sent again)."""
        s: socket.socket | None = getattr(self._local, "sock", None)
        frame = request_frame(name, request)
        within_limit(frame, self._limit)
        for attempt in (0, 1):
            reused, sent = s is not None, False
            try:
                if s is None:
                    s = self._local.sock = self._connect()
                s.settimeout(timeout or self._timeout)
                n = s.send(frame)
                sent = True
                s.sendall(memoryview(frame)[n:])
                status, payload = read_frame(s)
                break
            except OSError as exc:
                try:
                    answer = after_failure(self.path, s, exc, reused and attempt == 0 and not sent)
                finally:
                    self._drop(s)
                    s = None
                if answer is not None:
                    status, payload = answer
                    break
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
    """The client end for asyncio: non-blocking sockets on the running loop, opened on first use,
    one call on each at a time (a call takes an idle connection, or opens one when all are busy)."""

    kind = "local"

    def __init__(self, path: str, *, token: str = "", timeout: float = 30.0) -> None:
        self.path = path
        self._token = token.encode()
        self._timeout = timeout
        self._limit = 0  # the longest call frame the sidecar takes, from its hello (0: not known)
        self._idle: list[socket.socket] = []
        self._open: set[socket.socket] = set()

    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        self._open.add(s)
        try:
            async with asyncio.timeout(self._timeout):
                await loop.sock_connect(s, self.path)
                with contextlib.suppress(BrokenPipeError):  # refused at once (too many connections): read why
                    await loop.sock_sendall(s, frame(b"\0", self._token))
                status, message = await read_async(s)
            if status:
                raise from_status_code(STATUS[status], message.decode())
        except BaseException:
            self._close(s)
            raise
        self._limit = hello_limit(message)
        return s

    async def call(self, name: str, request: Message, timeout: float | None = None) -> Any:
        """One call (the module's docstring says when it is sent again). A call that times out or
        is cancelled closes its connection: its answer may still be on the way."""
        loop = asyncio.get_running_loop()
        frame = request_frame(name, request)
        within_limit(frame, self._limit)
        s = self._idle.pop() if self._idle else None
        for attempt in (0, 1):
            reused, sent = s is not None, False
            try:
                if s is None:
                    s = await self._connect()
                async with asyncio.timeout(timeout or self._timeout):
                    try:
                        n = s.send(frame)
                    except BlockingIOError:
                        n = 0
                    sent = True
                    await loop.sock_sendall(s, memoryview(frame)[n:])
                    status, payload = await read_async(s)
                self._idle.append(s)
                break
            except OSError as exc:
                try:
                    answer = after_failure(self.path, s, exc, reused and attempt == 0 and not sent)
                finally:
                    if s is not None:
                        self._close(s)
                    s = None
                if answer is not None:
                    status, payload = answer
                    break
            except BaseException:  # cancelled, or the sidecar's own error at hello
                if s is not None:
                    self._close(s)
                raise
        return response(name, status, payload)

    def _close(self, s: socket.socket) -> None:
        self._open.discard(s)
        s.close()

    async def aclose(self) -> None:
        socks, self._open, self._idle = list(self._open), set(), []
        for s in socks:
            s.close()


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
