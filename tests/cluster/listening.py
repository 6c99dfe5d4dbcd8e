"""A real TCP server on a loopback port that the cluster tests put on a node's path: the relay
between two nodes (tests/cluster/relay.py) and the attacker's listener posing as a node
(tests/cluster/test_cluster_auth.py). Each says what one connection does (:meth:`handle`); this
base listens, counts the connections and closes."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass


@dataclass(kw_only=True)
class LoopbackServer:
    connections: int = 0  # connections accepted so far
    port: int = 0  # the port it listens on, once started
    _server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> None:
        """Listen on 127.0.0.1:``port`` (0: any free one)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self.handle(reader, writer)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
