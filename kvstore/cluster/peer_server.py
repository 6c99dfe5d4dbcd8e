"""The holder's end of the peer data path: serves this node's blocks to the other nodes.

Each connection says hello within ``HELLO_TIMEOUT_S``: both sides prove they hold the cluster
token, which never crosses the wire (:mod:`kvstore.cluster.peer_hello`); then it sends requests
(:mod:`kvstore.wire.peer`). The blocks of a request are lent by the node (:class:`Lender`:
promoted into DRAM and leased while they are sent) and written from their slots by blocking
``sendmsg`` calls on an I/O thread (:func:`~kvstore.wire.peer.blocking`; a 64 MiB answer
is a few system calls, no event-loop round per socket-buffer's worth), within ``send_timeout_s``
and never past the lease's end (:attr:`Lent.left_s`: a holder slow to begin the send loses the
connection before the slots can be reused; a lease over before the send begins sends nothing).

A send thread is the scarce thing (``IO_THREADS`` a process), so an answer holds one only while
its fetcher takes bytes fast enough for the answer to go out in time: a send that makes no
progress for ``send_stall_s`` (each blocking call is bounded by it), or that, over a window of
``send_stall_s``, goes too slowly for the rest to go out before its deadline at that rate (a
fetcher that reads a byte now and then), is abandoned
(:func:`~kvstore.wire.peer.send_buffers`), its lease released and its connection closed.
The deadline is twice the fetch's, so such a send would need more than twice its rate to reach
its fetcher in time. And an answer takes its send slot (:attr:`PeerServer._sending`,
one per send thread) before its blocks are lent, not after: answers waiting for a thread hold no
lease, so however many connections ask at once, at most ``IO_THREADS`` requests' blocks are
leased (peers that ask and stop reading cannot keep DRAM leased until Allocate runs out).
A connection may sit idle between requests for ``IDLE_TIMEOUT_S``, but a request once begun is
read whole (head and body) within ``request_timeout_s`` (the fetch timeout: its fetcher has given
up by then), so a peer that sends part of one and stalls cannot hold its connection open for ever.
A malformed or stalled request, a wrong token or a broken connection ends that connection only;
the server keeps serving. An accept that fails (the process out of file descriptors) is retried
with back-off, as the local socket's: the listener is read again once descriptors are free.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from kvstore.cluster import peer_frames, peer_hello
from kvstore.cluster.cluster_key import MAC_BYTES, ClusterKey
from kvstore.cluster.peer_frames import Frames
from kvstore.codec import IDENTITY
from kvstore.stats.latency import Latencies
from kvstore.util.address import split_host_port
from kvstore.util.backoff import accept_backoff
from kvstore.util.logs import Throttled
from kvstore.util.tasks import cancel_and_wait
from kvstore.wire import peer as w

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 5.0
MAX_PENDING = 64  # connections that have not said hello yet; past it the oldest is dropped
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256


class Lent(NamedTuple):
    """A run lent to be sent: its blocks as (checksum, bytes), what to call once they are sent (the
    lease's release), the seconds left of the lease, now (the send is over by then), and each
    block's retention here now (ms left, priority: the answer tells the fetcher, which adopts it)."""

    blocks: list[tuple[int, np.ndarray]]
    release: Callable[[], None]
    left_s: Callable[[], float]
    retained: list[tuple[int, int]]


NOTHING_LENT = Lent([], lambda: None, lambda: math.inf, [])  # (no lease: the send has send_timeout_s)


class Lender(Protocol):
    """What the server serves from: the node's blocks, lent while they are sent."""

    max_blocks: int

    async def lend(self, root: bytes, keys: Sequence[bytes]) -> Lent:
        """The leading run of ``keys`` readable here, leased while it is sent."""
        ...


class PeerServer:
    def __init__(
        self,
        lender: Lender,
        key: ClusterKey,
        name: str,
        incarnation: Callable[[], int],
        address: Callable[[], str],
        send_timeout_s: float,
        send_stall_s: float,
        request_timeout_s: float,
        latency: Latencies | None = None,
        encrypt: bool = False,
    ) -> None:
        self.lender = lender
        self.name = name  # this node's id: the holder's name in the hello
        self.incarnation = incarnation  # this node's incarnation now: the hello proves it too
        self.address = address  # where its member entry says it lives: the hello proves that as well
        self.encrypt = encrypt  # ask for encrypted connections (cluster.peer_encryption; a fetcher may ask too)
        self.latency = latency if latency is not None else Latencies()  # answers' (kvstore/stats/latency.py)
        self.send_timeout_s = send_timeout_s
        self.send_stall_s = send_stall_s
        self.request_timeout_s = request_timeout_s
        # answers lent at once: one per send thread (of the process's pool: a sidecar runs one server)
        self._sending = asyncio.Semaphore(w.IO_THREADS)
        self._key = key
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._pending: dict[asyncio.Task[None], None] = {}  # before their hello, oldest first
        self._closing = False  # connections end after the request in hand (a cancellation can be lost)
        self._warn = Throttled(log)
        self.port = 0
        # connections dropped: wrong token, bad or stalled request, no send slot in time, an answer not read, too many
        self.refused = 0
        self.accept_failures = 0  # accepts that failed (out of file descriptors): retried with back-off
        self.served_blocks = 0

    async def start(self, address: str) -> int:
        host, port = split_host_port(address, listen=True)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(), name="kvstore-peer-accept")
        return self.port

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        backoff = accept_backoff()
        while not self._closing:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: wait for some to be freed
                wait = backoff.next()
                self.accept_failures += 1
                self._warn.warning("peer data path: accept failed (%s); retrying in %.2f s", exc, wait)
                await asyncio.sleep(wait)
                continue
            backoff.reset()
            if len(self._pending) >= MAX_PENDING:  # silent connections must not lock real peers out
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                oldest.cancel()
                self.refused += 1
            if len(self._conns) - len(self._pending) >= MAX_CONNECTIONS:
                self.refused += 1
                self._warn.warning("peer data path: %d connections open; refusing more", len(self._conns))
                conn.close()
                continue
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # (reset before it was set up: nothing to serve)
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn), name="kvstore-peer-conn")
            self._conns.add(task)
            self._pending[task] = None
            task.add_done_callback(self._gone)

    def _gone(self, task: asyncio.Task[None]) -> None:
        self._conns.discard(task)
        self._pending.pop(task, None)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                # (HelloRefused: a PeerProtocolError)
                _, session = await peer_hello.welcome(
                    conn, self._key, self.name, self.incarnation(), self.address(), self.encrypt
                )
            frames = peer_frames.frames(session, fetcher=False)
            current = asyncio.current_task()
            if current is not None:
                self._pending.pop(current, None)  # it said hello: a connection like any other now
            while not self._closing:
                if not await self._answer(conn, frames):
                    return
        except w.PeerProtocolError as exc:
            self.refused += 1
            self._warn.warning("peer data path: dropped a connection: %s", exc)
        except (ConnectionError, TimeoutError, OSError):
            pass  # the fetcher went away, gave up or fell idle: nothing is owed to it
        except Exception:
            self.refused += 1
            log.exception("peer data path: dropped a connection on an internal error")
        finally:
            conn.close()

    async def _answer(self, conn: socket.socket, frames: Frames) -> bool:
        loop = asyncio.get_running_loop()
        head = bytearray(w.REQUEST.size)
        async with asyncio.timeout(IDLE_TIMEOUT_S):  # an idle connection goes (its fetcher reconnects)
            first = await loop.sock_recv_into(conn, head)
        if first == 0:
            return False  # closed between requests: a clean end
        try:
            async with asyncio.timeout(self.request_timeout_s):  # begun, a request comes in whole
                if first < len(head):
                    await w.recv_exactly(conn, memoryview(head)[first:])
                (n,) = w.REQUEST.unpack(head)
                if not 0 < n <= self.lender.max_blocks:
                    raise w.PeerProtocolError(f"request for {n} blocks (1..{self.lender.max_blocks})")
                body = await w.recv_bytes(conn, w.ROOT_BYTES + n * w.KEY_BYTES + MAC_BYTES)
        except TimeoutError:
            raise w.PeerProtocolError(f"a request begun was not in whole within {self.request_timeout_s} s") from None
        opened = frames.opened_request(bytes(head), body)
        if opened is None:
            raise w.PeerProtocolError("a request not sealed with this connection's key (sent by another party)")
        body = opened
        root = body[: w.ROOT_BYTES]
        keys = [body[i : i + w.KEY_BYTES] for i in range(w.ROOT_BYTES, len(body), w.KEY_BYTES)]
        try:
            async with asyncio.timeout(self.request_timeout_s):  # (its fetcher has given up by then)
                await self._sending.acquire()
        except TimeoutError:
            self.refused += 1
            self._warn.warning("peer data path: no send slot free for %s s; dropped a request", self.request_timeout_s)
            return False
        try:
            return await self._lend_and_send(conn, root, keys, frames)
        finally:
            self._sending.release()

    async def _lend_and_send(self, conn: socket.socket, root: bytes, keys: list[bytes], frames: Frames) -> bool:
        """Lend the run asked for and send it (holding a send slot). The send ends, and with it
        the lease and the connection, at the lease's end or after a window of ``send_stall_s`` in
        which the fetcher took too little for the rest to go out by then (no byte, or a trickle),
        whichever comes first."""
        start = time.perf_counter()
        outcome = "error"
        lent = await self.lender.lend(root, keys)
        try:
            blocks = lent.blocks
            answer = frames.answer_head(
                [(data.nbytes, checksum, *held, IDENTITY.id) for (checksum, data), held in zip(blocks, lent.retained)]
            )
            # (a 1-D uint8 array is a buffer; numpy's stubs do not say so before Python 3.12)
            payload = [memoryview(data) for _, data in blocks]  # type: ignore[arg-type]
            budget = min(self.send_timeout_s, lent.left_s())  # the slots are ours until the lease ends
            if budget <= 0:
                self._warn.warning("peer data path: the lease on %d blocks ended before their send began", len(blocks))
                return False
            stall = min(self.send_stall_s, budget)  # each blocking call's bound, and the pace's window
            deadline = time.monotonic() + budget  # when asyncio.timeout below cuts the send
            async with asyncio.timeout(budget):
                await w.blocking(conn, w.SENDING, _send, conn, frames, answer, payload, stall, deadline)
            outcome = "ok"
        except w.PeerStalled as e:
            self.refused += 1
            self._warn.warning("peer data path: dropped an answer (%d blocks) its fetcher takes too slowly: %s",
                               len(lent.blocks), e)
            return False
        finally:
            lent.release()
            self.latency.histogram("peer_answer", (outcome,)).since(start)
        frames.next()
        self.served_blocks += len(blocks)
        return True

    async def close(self) -> None:
        # (a connection's task that lost its cancellation, see ClusterNode.close, ends after the
        # request it was answering instead of waiting up to IDLE_TIMEOUT_S for the next one)
        self._closing = True
        await cancel_and_wait([self._accepting])
        self._accepting = None
        await cancel_and_wait(list(self._conns))
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _send(
    conn: socket.socket, frames: Frames, head: bytes, blocks: list[memoryview], stall_s: float, deadline: float
) -> None:
    """Send an answer on an I/O thread: ``conn`` blocking while it does (each call bounded by
    ``stall_s``; no progress for that long, or a window of it too slow to finish by ``deadline``,
    raises :class:`~kvstore.wire.peer.PeerStalled`), back to the loop's after."""
    w.set_blocking(conn, stall_s)
    try:
        frames.send(conn, head, blocks, w.pacer(stall_s, deadline))
    finally:
        conn.setblocking(False)
