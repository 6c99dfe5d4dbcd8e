"""The fetcher's end of the peer data path: read another node's blocks straight into local slots.

One :class:`PeerClient` per holder address keeps a few idle connections (hello done once per
connection). :meth:`PeerClient.fetch` sends one request for a run of blocks and reads each block
with ``sock_recv_into`` into the slot view it was given, under one deadline, and hashes each block
on a thread while the next arrives. It never raises for what the peer does: a refused or broken
connection, a deadline passed or a malformed answer end the run there, and the connection is
dropped (a half-read answer cannot be resumed). The caller compares the hashes with the holder's
and the directory's checksums (:class:`FetchResult`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.cluster import peer_wire as w
from kvstore.store.checksum import checksum_soon

IDLE_CONNECTIONS = 4


@dataclass(slots=True)
class FetchResult:
    checksums: list[int]  # the holder's checksum of each block received in full, in order
    hashes: list[int]  # the checksum of the bytes that arrived, block by block
    error: str = ""  # why the run ended early ("" when every block came, or the holder had no more)


class PeerClient:
    def __init__(self, address: str, token: str, node: str) -> None:
        self.address = address
        self._hello = w.hello(token, node)
        self._idle: list[socket.socket] = []

    async def _connect(self) -> socket.socket:
        if self._idle:
            return self._idle.pop()
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, int(port)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_sendall(sock, self._hello)
            if await w.recv_bytes(sock, len(w.WELCOME)) != w.WELCOME:
                raise w.PeerProtocolError("the holder did not welcome us")
        except BaseException:
            sock.close()
            raise
        return sock

    async def fetch(
        self, root: bytes, keys: Sequence[bytes], into: Sequence[np.ndarray], timeout_s: float
    ) -> FetchResult:
        """Read ``keys``' blocks into ``into`` (one view each, of the block's expected size). A
        connection kept idle that turns out dead before answering (the holder restarted, or closed
        it) is replaced once."""
        result = FetchResult([], [])
        try:
            async with asyncio.timeout(timeout_s):
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
        self, sock: socket.socket, root: bytes, keys: Sequence[bytes], into: Sequence[np.ndarray], out: FetchResult
    ) -> None:
        """One request on ``sock``; each block's bytes are hashed (on a thread) while the next
        arrives. ``sock`` goes back to the idle ones after a whole answer, else it is closed."""
        loop = asyncio.get_running_loop()
        hashing: list[asyncio.Future[int]] = []
        try:
            await loop.sock_sendall(sock, w.request(root, list(keys)))
            count = bytearray(w.COUNT.size)
            await w.recv_exactly(sock, memoryview(count))
            (m,) = w.COUNT.unpack(count)
            if m > len(into):
                raise w.PeerProtocolError(f"an answer of {m} blocks to a request for {len(into)}")
            entries = await w.recv_bytes(sock, m * w.ENTRY.size)
            heads = [w.ENTRY.unpack_from(entries, i * w.ENTRY.size) for i in range(m)]
            for (size, _), view in zip(heads, into):
                if size != view.nbytes:
                    raise w.PeerProtocolError(f"block of {size} bytes where {view.nbytes} were expected")
            for (_, sent), view in zip(heads, into):
                await w.recv_exactly(sock, memoryview(view).cast("B"))  # type: ignore[arg-type]
                out.checksums.append(sent)
                hashing.append(checksum_soon(view))
        except BaseException:
            sock.close()
            raise
        finally:
            if hashing:  # every thread is done with the slots before they may be freed
                done = await asyncio.gather(*hashing, return_exceptions=True)
                out.hashes = [h for h in done if isinstance(h, int)]
        self._idle.append(sock)
        if len(self._idle) > IDLE_CONNECTIONS:
            self._idle.pop(0).close()

    def close(self) -> None:
        for sock in self._idle:
            with contextlib.suppress(OSError):
                sock.close()
        self._idle.clear()
