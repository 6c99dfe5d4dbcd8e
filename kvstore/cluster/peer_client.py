"""The fetcher's end of the peer data path: read another node's blocks straight into local slots.

One :class:`PeerClient` per holder address keeps a few idle connections (hello done once per
connection: the holder proves it holds the cluster token, and is the node, the incarnation and the
address meant, before anything else is sent, :mod:`kvstore.cluster.peer_hello`).
:meth:`PeerClient.fetch` sends one request for a run of blocks and, on an I/O thread
(:func:`~kvstore.wire.peer.blocking`), reads each block with one blocking ``recv_into`` straight
into the slot view it was given and hashes it there (xxh3 at ~28 GB/s a core: 1 MiB in under 40 us,
while the kernel goes on filling the socket buffer with the next), all under one deadline. One
holder's fetches take at most :data:`HOLDER_THREADS` of those threads at once. It never raises for
what the peer does: a refused or broken connection, a deadline passed or a malformed answer end the
run there, and the connection is dropped (a half-read answer cannot be resumed). The caller compares
the hashes with the holder's and the directory's checksums (:class:`FetchResult`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvstore.checksum import checksum
from kvstore.cluster import peer_frames, peer_hello
from kvstore.cluster.cluster_key import MAC_BYTES, ClusterKey
from kvstore.cluster.peer_frames import Frames
from kvstore.codec import UnknownCodec, codec_of, decode
from kvstore.store.books.retention import MAX_RETAIN_MS, PRIORITIES
from kvstore.util.address import split_host_port
from kvstore.wire import peer as w

IDLE_CONNECTIONS = 4
# Fetch threads (peer_wire.FETCHING) one holder's fetches may hold at once; the others wait on the
# loop, under their deadline. A holder that welcomes a fetcher and never answers keeps each thread
# it is given until that fetch's deadline: without a cap, a few concurrent fetches from it took
# every thread, and fetches from healthy holders queued behind them until those deadlines passed.
HOLDER_THREADS = w.IO_THREADS // 4


@dataclass(slots=True)
class FetchResult:
    checksums: list[int]  # the holder's checksum of each block received in full, in order
    hashes: list[int]  # the checksum of the bytes that arrived, block by block
    retained: list[tuple[int, int]] = field(default_factory=list)  # the holder's retention of each (ms left, priority)
    error: str = ""  # why the run ended early ("" when every block came, or the holder had no more)


class PeerClient:
    def __init__(
        self,
        address: str,
        key: ClusterKey,
        node: str,
        holder: str,
        incarnation: int,
        io_timeout_s: float,
        encrypt: bool = False,
    ) -> None:
        self.address = address
        self._host, self._port = split_host_port(address)  # (ValueError: not an address to dial)
        self.holder = holder  # the node meant: the one at ``address`` must prove it is that node, with the token
        self.incarnation = incarnation  # ... and this life of it (the one its member entry names)
        self.io_timeout_s = io_timeout_s  # the kernel's bound on one blocking call (the deadline is the loop's)
        self.encrypt = encrypt  # ask for encrypted connections (cluster.peer_encryption)
        self._key = key
        self._node = node
        self._idle: list[Conn] = []
        self._turns = asyncio.Semaphore(HOLDER_THREADS)
        self._closed = False  # a fetch in flight at close() closes its socket instead of idling it

    async def _connect(self) -> Conn:
        if self._idle:
            return self._idle.pop()
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (self._host, self._port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = await peer_hello.greet(
                sock, self._key, self._node, self.holder, self.incarnation, self.address, self.encrypt
            )
            w.set_blocking(sock, self.io_timeout_s)  # from here on only I/O threads use it
        except BaseException:
            sock.close()
            raise
        return Conn(sock, peer_frames.frames(session, fetcher=True))

    async def fetch(
        self, root: bytes, keys: Sequence[bytes], into: Sequence[np.ndarray], timeout_s: float
    ) -> FetchResult:
        """Read ``keys``' blocks into ``into`` (one view each, of the block's expected size). A
        connection kept idle that turns out dead before answering (the holder restarted, or closed
        it) is replaced once."""
        result = FetchResult([], [])
        try:
            async with asyncio.timeout(timeout_s), self._turns:
                reused = bool(self._idle)
                try:
                    await self._fetch_on(await self._connect(), root, keys, into, result)
                except (ConnectionError, w.PeerProtocolError):
                    if not reused or result.checksums:
                        raise
                    result = FetchResult([], [])
                    await self._fetch_on(await self._connect(), root, keys, into, result)
            return result
        except TimeoutError:
            result.error = f"deadline of {timeout_s} s passed"
        except (OSError, w.PeerProtocolError) as exc:  # ConnectionError is an OSError
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    async def _fetch_on(
        self, conn: Conn, root: bytes, keys: Sequence[bytes], into: Sequence[np.ndarray], out: FetchResult
    ) -> None:
        """One request on ``conn``, exchanged on an I/O thread. ``conn`` goes back to the idle ones
        after a whole answer, else it is closed."""
        sock = conn.sock
        try:
            request = conn.frames.request(root, list(keys))
            await w.blocking(sock, w.FETCHING, _exchange, sock, conn.frames, request, into, out)
        except BaseException:
            sock.close()
            raise
        if self._closed:
            sock.close()
            return
        self._idle.append(conn)
        if len(self._idle) > IDLE_CONNECTIONS:
            self._idle.pop(0).sock.close()

    def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._idle.clear()


class Conn(NamedTuple):
    """A connection that said hello, and how its exchanges go on the wire (its key's MACs, or sealed whole)."""

    sock: socket.socket
    frames: Frames


def _exchange(
    sock: socket.socket, frames: Frames, request: bytes, into: Sequence[np.ndarray], out: FetchResult
) -> None:
    """Send ``request`` and read its answer into ``into`` (blocking; on an I/O thread). The
    answer's head must carry the connection's MAC (or open under its key, and each block frame
    too), and each entry a retention a hint could have given. Each block is hashed as soon as
    it is in; ``out`` holds every block received in full when this raises."""
    sock.sendall(request)
    count = w.recv_all(sock, w.COUNT.size)
    (m,) = w.COUNT.unpack(count)
    if m > len(into):
        raise w.PeerProtocolError(f"an answer of {m} blocks to a request for {len(into)}")
    entries = frames.opened_answer(count, w.recv_all(sock, m * w.ENTRY.size + MAC_BYTES))
    if entries is None:
        raise w.PeerProtocolError("an answer not sealed with this connection's key (sent by another party)")
    heads: list[w.Fields] = list(w.ENTRY.iter_unpack(entries))
    for (size, _, ms, priority, codec), view in zip(heads, into):
        try:
            codec_of(codec)
        except UnknownCodec as exc:
            raise w.PeerProtocolError(f"answer entry: {exc}") from None
        if size != view.nbytes:
            raise w.PeerProtocolError(f"block of {size} bytes where {view.nbytes} were expected")
        if ms > MAX_RETAIN_MS or priority >= PRIORITIES:
            raise w.PeerProtocolError(
                f"retention of {ms} ms, priority {priority} (0..{MAX_RETAIN_MS}, 0..{PRIORITIES - 1})"
            )
    for (_, sent, ms, priority, codec), view in zip(heads, into):
        got = memoryview(view).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
        frames.recv_block(sock, got)
        decode(codec, got)  # (the checksum is of the raw bytes)
        out.checksums.append(sent)
        out.hashes.append(checksum(view))
        out.retained.append((ms, priority))
    frames.next()
