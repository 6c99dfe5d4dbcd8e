"""The peer data path's wire format: what one node sends another to fetch blocks.

A raw TCP stream, not gRPC: block bytes go from the holder's DRAM slots (blocking ``sendmsg`` of
the slots' memoryviews, as few calls as the kernel takes, :func:`send_buffers`) straight into the
fetcher's slots (blocking ``recv_into`` with ``MSG_WAITALL``, one call a block,
:func:`recv_into_all`), with no message to build or parse around them (``kvstore bench cluster``
measures both ways). The payload moves on an I/O thread (:func:`blocking`), not through the event
loop: the loop's way (a non-blocking call, then a wait for readiness and a callback each time the
socket buffer runs dry) costs a loop round per 64-200 KiB, which on a busy host is most of a
fetch's CPU. The deadline stays the loop's: when it passes, the socket is shut down, which ends
the thread's call at once.

    hello    both ways           a challenge and response proving both sides hold the cluster token,
                                 which never crosses the wire (:mod:`kvstore.cluster.peer_hello`);
                                 it ends with holder -> fetcher "OK\\0\\0"
    request  fetcher -> holder   u32 n, namespace root (32 bytes), n block keys (32 bytes each),
                                 MAC (16 bytes, the connection's key: its hello's Session)
    answer   holder -> fetcher   u32 m (the leading m <= n blocks the holder has), then m times
                                 (u64 size, u64 checksum, u32 retention left in ms, u8 its
                                 priority, u8 the codec of the bytes sent), MAC of those (16
                                 bytes), then the m blocks' bytes back to back

The codec (:mod:`kvstore.codec`; 0, identity: the holder's slot as it is) is what the fetcher
decodes the block's bytes by before it hashes them: the checksum is always of the raw bytes. A
codec the fetcher does not know ends the fetch (:class:`PeerProtocolError`), a miss.

The retention is the holder's now, on its own clock (0 ms: not retained): the one a fetcher that
keeps the block adopts (kvstore/store/exchange.py). It comes from the holder it names, under the
connection's MAC (or sealed), in answer to this request: a record of it that a directory writer
kept and wrote back after the holder ended it has nothing to say here (docs/security.md).

All integers little-endian. A connection carries one request at a time, any number in turn. The
fetcher knows every size before the first payload byte, so it checks them all up front and reads
each block straight into the slot it has for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol, TypeVar

from kvstore.util.threads import _Once
from kvstore.wire import stream

T = TypeVar("T")

WELCOME = b"OK\0\0"  # the hello's last word (kvstore.cluster.peer_hello)
REQUEST = struct.Struct("<I")
COUNT = struct.Struct("<I")  # blocks in the answer
# size, checksum, the holder's retention of the block: ms left (0: none), priority; the bytes' codec
ENTRY = struct.Struct("<QQIBB")
ROOT_BYTES = KEY_BYTES = 32
ASKED, ANSWERED = b"request", b"answer"  # what a Session MAC seals
IO_THREADS = 16  # fetches moving at once, per process, and as many answers (each holds a thread while it moves)
# Two pools, not one: a fetch holds its thread while it waits for the holder's answer, and an answer
# needs a thread of the holder's process. Sharing one pool, a node whose threads all wait on fetches
# could answer nobody, and two nodes fetching from each other waited on each other until every
# fetch's deadline passed. An answer only ever waits on a fetcher already reading (its thread sent
# the request), so with pools of their own nothing waits in a cycle.
FETCHING = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvstore-peer-fetch")
SENDING = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvstore-peer-send")
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class Sealer(Protocol):
    """The connection's key, as the hello left it (:class:`kvstore.cluster.cluster_key.Session`):
    the MAC of an exchange's request or answer head."""

    def seal(self, what: bytes, data: bytes) -> bytes: ...


class PeerProtocolError(ConnectionError):
    """The other end sent something this format does not allow: drop the connection."""


class PeerStalled(ConnectionError):
    """The other end takes an answer too slowly for it to go out in time (no byte at all within the
    socket's send timeout, or too few over a window of it, :func:`send_buffers`): drop the connection."""


class Entry(NamedTuple):
    """One block of an answer: its size and checksum, the holder's retention of it now (ms
    left on the holder's clock, 0: none; its priority), and the codec of the bytes sent."""

    size: int
    checksum: int
    retain_ms: int = 0
    retain_priority: int = 0
    codec: int = 0


Fields = tuple[int, int, int, int, int]  # an Entry's, as a plain tuple (what a head packs, and unpacks to)


def entries(blocks: Sequence[Fields]) -> bytes:
    """The entries of an answer's head (:class:`Entry` or its fields), packed."""
    return b"".join(ENTRY.pack(*e) for e in blocks)


def request(root: bytes, keys: list[bytes], session: Sealer) -> bytes:
    """A request, sealed with the connection's key (the exchange's MAC: the session moves on to
    the next once the answer is in)."""
    body = REQUEST.pack(len(keys)) + root + b"".join(keys)
    return body + session.seal(ASKED, body)


def answer_head(blocks: Sequence[Fields], session: Sealer) -> bytes:
    """The answer's head for blocks of these entries, sealed with the connection's key."""
    head = COUNT.pack(len(blocks)) + entries(blocks)
    return head + session.seal(ANSWERED, head)


async def blocking(sock: socket.socket, pool: ThreadPoolExecutor, call: Callable[..., T], *args: object) -> T:
    """``call(*args)``, blocking I/O on ``sock``, on a thread of ``pool`` (:data:`FETCHING` or
    :data:`SENDING`). Cancelled (a deadline passed, the server closing), it shuts ``sock`` down,
    which ends the thread's call, and returns only once the thread is done: the caller's buffers
    (slots) are never freed under a thread that still reads or writes them. A call still queued
    for a thread is dropped at once (the deadline holds when the pool is busy). ``sock`` is then
    unusable: the caller closes it. The thread lets go of ``call`` and ``args`` (the slots' views)
    as it starts (:class:`~kvstore.util.threads._Once`): its pool holds the work item until after
    the caller has resumed."""
    work = pool.submit(_Once(functools.partial(call, *args)))
    fut = asyncio.wrap_future(work)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        work.cancel()  # (only if no thread took it yet: then it never touches the buffers)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller hears of
        raise
    finally:
        # An exception raised here holds this frame (its traceback), the frame the futures, and
        # they the exception: a cycle that kept ``args`` (the slots' views) alive until the next
        # garbage collection, after their lease was released and possibly past the slab's close.
        del work, fut


def set_blocking(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking, each call bounded by the kernel at ``timeout_s`` (``SO_RCVTIMEO``,
    ``SO_SNDTIMEO``): a thread never blocks for ever even if nobody shuts the socket down."""
    sock.setblocking(True)
    sec = max(0.001, timeout_s)
    tv = _TIMEVAL.pack(int(sec), int((sec % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def send_buffers(
    sock: socket.socket, buffers: Sequence[memoryview], window_s: float | None = None, deadline: float | None = None
) -> None:
    """Send ``buffers`` in order on a blocking socket (:func:`kvstore.wire.stream.send_buffers`):
    one ``sendmsg`` takes up to ``IOV_MAX`` of them and returns once the kernel has them all, or
    once its timeout (``SO_SNDTIMEO``) passed with some taken: the rest goes next. A call that
    passes its timeout with none taken (the socket buffer full all along: the other end reads
    nothing) raises :class:`PeerStalled`, so the timeout bounds how long the send goes without
    progress, not how long it takes.

    With a ``deadline`` (``time.monotonic()``) and ``window_s`` (the socket's send timeout), the
    send must also keep the pace that finishes it in time: after each window of ``window_s``, if
    the rest cannot go out before the deadline at the rate of that window, it raises
    :class:`PeerStalled` now rather than at the deadline. A fetcher that reads a byte now and then
    (a trickle) makes each call take something, so the timeout alone would never fire and the send
    would hold its thread, and its caller's slots, until the deadline; the deadline cuts a send that
    cannot finish anyway, so giving up once it is out of reach costs nothing that could arrive.
    A window rather than the whole send's average: a fetcher that read fast, then slows to a
    trickle, is caught one window later, not after its early bytes are averaged away."""
    send_paced(sock, buffers, pacer(window_s, deadline))


def pacer(window_s: float | None, deadline: float | None) -> stream.Pace | None:
    """The pace a send of ``window_s`` windows must keep to finish by ``deadline`` (see
    :func:`send_buffers`); None without both."""
    return _Pace(window_s, deadline) if window_s is not None and deadline is not None else None


def send_paced(sock: socket.socket, buffers: Sequence[memoryview], pace: stream.Pace | None) -> None:
    """:func:`send_buffers` with a pace of the caller's (one over several sends: the frames of an
    encrypted answer, :mod:`kvstore.cluster.peer_frames`)."""
    try:
        stream.send_buffers(sock, buffers, pace)
    except stream.SendStalled as exc:
        raise PeerStalled(f"peer {exc}") from None


class _Pace:
    """The windows of one send (:func:`send_buffers`): each must take enough for the rest to go out
    by the deadline at its rate."""

    def __init__(self, window_s: float, deadline: float) -> None:
        self.window_s, self.deadline = window_s, deadline
        self.begun, self.taken = time.monotonic(), 0  # this window's start and the bytes taken in it

    def __call__(self, sent: int, left: int) -> None:
        self.taken += sent
        now = time.monotonic()
        if left and now - self.begun >= self.window_s:
            if _out_of_reach(self.taken, now - self.begun, left, self.deadline - now):
                raise PeerStalled(
                    f"peer took {self.taken} bytes in {now - self.begun:.2f} s: at that rate the {left} left "
                    f"cannot go out in the {max(0.0, self.deadline - now):.2f} s before the deadline"
                )
            self.begun, self.taken = now, 0


def _out_of_reach(taken: int, elapsed_s: float, left: int, left_s: float) -> bool:
    """Whether ``left`` bytes cannot go out in ``left_s`` at the rate of ``taken`` in ``elapsed_s``
    (the minimum a window must take: the rest's share of the time left, ``left * elapsed_s / left_s``)."""
    return taken * left_s < left * elapsed_s


CLOSED = "peer closed the connection"


def recv_into_all(sock: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from a blocking socket, in one ``recv_into`` (``MSG_WAITALL``) unless a
    signal or the timeout cuts it; EOF first is an error."""
    stream.recv_into(sock, into, CLOSED, socket.MSG_WAITALL)


def recv_all(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket."""
    return stream.recv_bytes(sock, n, CLOSED, socket.MSG_WAITALL)


async def recv_exactly(sock: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``sock`` (non-blocking, on the running loop); EOF first is an error."""
    await stream.recv_into_async(sock, into, CLOSED)


async def recv_bytes(sock: socket.socket, n: int) -> bytes:
    return await stream.recv_bytes_async(sock, n, CLOSED)
