"""A holder on a real loopback socket that says the hello right (the token, the incarnation, the
address dialled) and answers one fetch as the test tells it, for a real PeerClient: where the
answer itself is the case (a retention no hint could give, a codec the fetcher does not know)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kvstore.cluster import peer_frames, peer_hello
from kvstore.cluster.cluster_key import ClusterKey
from kvstore.cluster.peer_client import FetchResult, PeerClient
from kvstore.wire import peer as peer_wire
from tests.cluster.nodes import BLOCK, TOKEN

KEY, INCARNATION = ClusterKey(TOKEN), 7


@dataclass
class OneAnswer:
    """The holder's task (it ends when the fetcher drops the connection), whether it answered,
    and the client dialled to it; :meth:`fetch` asks it for one block."""

    serving: asyncio.Task[None]
    client: PeerClient
    answered: list[bool] = field(default_factory=list)
    into: np.ndarray = field(default_factory=lambda: np.zeros(BLOCK, dtype=np.uint8))

    async def fetch(self) -> FetchResult:
        return await self.client.fetch(bytes(32), [bytes(32)], [self.into], 5.0)


@contextlib.asynccontextmanager
async def answering(entry: peer_wire.Entry, body: bytes) -> AsyncIterator[OneAnswer]:
    """A holder whose answer to the first request is ``entry``'s head, then ``body``."""
    answered: list[bool] = []

    async def holder(listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(listener)
        conn.setblocking(False)
        with conn:
            at = f"127.0.0.1:{listener.getsockname()[1]}"  # (the address the fetcher dialled)
            _, session = await peer_hello.welcome(conn, KEY, "a", INCARNATION, at)
            frames = peer_frames.frames(session, fetcher=False)
            head = await peer_wire.recv_bytes(conn, peer_wire.REQUEST.size)
            (n,) = peer_wire.REQUEST.unpack(head)
            assert frames.opened_request(head, await peer_wire.recv_bytes(conn, 32 + 32 * n + 16)) is not None
            await loop.sock_sendall(conn, frames.answer_head([entry]) + body)
            answered.append(True)
            await peer_wire.recv_bytes(conn, 1)  # (until the fetcher drops the connection)

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        serving = asyncio.create_task(holder(listener))
        client = PeerClient(f"127.0.0.1:{listener.getsockname()[1]}", KEY, "b", "a", INCARNATION, 5.0)
        try:
            yield OneAnswer(serving, client, answered)
        finally:
            serving.cancel()
            client.close()
