"""Buffers in and out of a stream socket without copying them: ``sendmsg`` of many buffers at once
(:func:`send_buffers`) and ``recv_into`` straight into the caller's buffer (:func:`recv_into`,
:func:`recv_into_async` on the running loop). Every wire of :mod:`kvstore.wire` moves its bytes
with these; each says what a closed connection is called on it (``closed``)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence

Buffer = bytes | bytearray | memoryview
IOV_MAX = 512  # buffers handed to one sendmsg (Linux allows 1024)
# (sent by the last call, bytes left): may raise to give up a send that keeps too slow a pace
Pace = Callable[[int, int], None]


class SendStalled(ConnectionError):
    """A blocking socket's send timeout (``SO_SNDTIMEO``) passed with no byte taken: the other end
    reads nothing."""


def send_buffers(sock: socket.socket, buffers: Sequence[Buffer], pace: Pace | None = None) -> None:
    """Send ``buffers`` in order, from their own memory: one ``sendmsg`` takes up to
    :data:`IOV_MAX` of them, and whatever it did not take goes with the next. On a blocking socket
    with ``SO_SNDTIMEO`` a call that passes its timeout having taken some returns what it took (the
    rest goes next); one that took none raises :class:`SendStalled`, so the timeout bounds how long
    the send goes without progress. ``pace`` is told after each call what it took and what is left."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    left = sum(v.nbytes for v in views)
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + IOV_MAX])
        except BlockingIOError:  # (EAGAIN: the kernel's timeout, the socket itself is blocking)
            raise SendStalled("took no bytes within the send timeout") from None
        if sent == 0:
            raise ConnectionError("stopped taking bytes")
        left -= sent
        if pace is not None:
            pace(sent, left)
        while sent:
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def recv_into(sock: socket.socket, into: memoryview, closed: str, flags: int = 0) -> None:
    """Fill ``into`` from a blocking socket (``flags``: ``MSG_WAITALL`` for one call where no signal
    or timeout cuts it); the connection closing first raises ``ConnectionResetError(closed)``."""
    view = into
    while view:
        n = sock.recv_into(view, 0, flags)
        if not n:
            raise ConnectionResetError(closed)
        view = view[n:]


def recv_bytes(sock: socket.socket, n: int, closed: str, flags: int = 0) -> bytes:
    """``n`` bytes from a blocking socket (:func:`recv_into`)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), closed, flags)
    return bytes(buf)


async def recv_into_async(sock: socket.socket, into: memoryview, closed: str) -> None:
    """:func:`recv_into` from a non-blocking socket, on the running loop."""
    loop = asyncio.get_running_loop()
    view = into
    while view:
        n = await loop.sock_recv_into(sock, view)
        if not n:
            raise ConnectionResetError(closed)
        view = view[n:]


async def recv_bytes_async(sock: socket.socket, n: int, closed: str) -> bytes:
    """``n`` bytes from a non-blocking socket, on the running loop."""
    buf = bytearray(n)
    await recv_into_async(sock, memoryview(buf), closed)
    return bytes(buf)
