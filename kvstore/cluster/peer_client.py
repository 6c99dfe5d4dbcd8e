"""The fetcher's end of the peer data path: read another node's blocks straight into local slots.

One :class:`PeerClient` per holder address keeps a few idle connections (hello done once per
connection). :meth:`PeerClient.fetch` sends one request for a run of blocks and reads each block
with ``sock_recv_into`` into the slot view it was given, under one deadline. It never raises for
what the peer does: a refused or broken connection, a deadline passed or a malformed answer end
the run there, and the connection is dropped (a half-read answer cannot be resumed). The caller
verifies the bytes against the checksums (:class:`FetchResult`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.cluster import peer_wire as w

IDLE_CONNECTIONS = 4


@dataclass(slots=True)
class FetchResult:
    checksums: list[int]  # the holder's checksum of each block received in full, in order
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
        """Read ``keys``' blocks into ``into`` (one view each, of the block's expected size)."""
        got: list[int] = []
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(timeout_s):
                sock = await self._connect()
                loop = asyncio.get_running_loop()
                await loop.sock_sendall(sock, w.request(root, list(keys)))
                head = bytearray(w.BLOCK.size)
                for view in into:
                    await w.recv_exactly(sock, memoryview(head))
                    status, size, checksum = w.BLOCK.unpack(head)
                    if status != w.OK:
                        break  # the holder has no more of the run: the answer ends here
                    if size != view.nbytes:
                        raise w.PeerProtocolError(f"block of {size} bytes where {view.nbytes} were expected")
                    await w.recv_exactly(sock, memoryview(view).cast("B"))  # type: ignore[arg-type]
                    got.append(checksum)
            self._idle.append(sock)
            sock = None
            if len(self._idle) > IDLE_CONNECTIONS:
                self._idle.pop(0).close()
            return FetchResult(got)
        except TimeoutError:
            return FetchResult(got, f"deadline of {timeout_s} s passed")
        except (OSError, w.PeerProtocolError) as exc:  # ConnectionError is an OSError
            return FetchResult(got, f"{type(exc).__name__}: {exc}")
        finally:
            if sock is not None:
                sock.close()

    def close(self) -> None:
        for sock in self._idle:
            with contextlib.suppress(OSError):
                sock.close()
        self._idle.clear()
