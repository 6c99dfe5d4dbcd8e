"""One pipelined asyncio connection to a Redis, for small calls whose latency matters (the cluster
directory's lookup script, on every Lookup that misses locally).

redis-py's asyncio client spends more on a call than the round trip does: a 16-key script call on
loopback took 129-166 µs through it against 57 µs written and parsed here, and 370-400 µs against
170-180 µs inside a running sidecar (its pool checkout, retry wrapper, timeout timers and stream
reader each run per call). Here a call is one ``write`` of the command packed by hiredis and one
future; replies are parsed by hiredis's reader (``redis[hiredis]`` is a dependency) as they arrive
and resolve the waiting futures in order, so concurrent callers share the connection, pipelined.

Only what that needs: plain TCP with AUTH and SELECT on connect (:func:`tcp_settings` says whether
a redis-py client connects that way, one decision for every raw path), and scripts by SHA with the
body sent once when the server does not know it (``NOSCRIPT``: a restarted or flushed Redis).
Everything else stays on redis-py.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections import deque
from typing import Any, TypeGuard

import hiredis
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import Connection as TcpConnection

Arg = bytes | str | int


class ReplyError(Exception):
    """An error reply (``-ERR ...``) to a call on a :class:`PipelinedLink`."""


def tcp_settings(client: Redis | RedisCluster) -> dict[str, Any] | None:
    """How redis-py connects: username, password, db and timeouts (host and port aside); None when
    a raw connection cannot connect the same way (TLS, Unix socket, credential provider)."""
    if isinstance(client, RedisCluster):
        kw = client.nodes_manager.connection_kwargs
        cls = kw.get("connection_class", TcpConnection)
    else:
        kw = client.connection_pool.connection_kwargs
        cls = client.connection_pool.connection_class
    if cls is not TcpConnection or kw.get("credential_provider") is not None:
        return None
    return dict(
        username=kw.get("username"), password=kw.get("password"), db=int(kw.get("db") or 0),
        timeout_s=kw.get("socket_timeout"), connect_timeout_s=kw.get("socket_connect_timeout"),
    )


@functools.cache
def _sha(body: str) -> str:
    return hashlib.sha1(body.encode()).hexdigest()  # what Redis names a script by


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()  # (future, when sent)
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                if not self.waiting:
                    raise hiredis.ProtocolError("a reply nobody asked for")
                fut, _ = self.waiting.popleft()
                if not fut.done():  # (a caller that gave up: its reply is read and dropped)
                    fut.set_result(reply)
        except hiredis.ProtocolError as exc:
            self.close(ConnectionError(f"redis: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(ConnectionError(f"redis connection lost: {exc}" if exc else "redis closed the connection"))

    def close(self, why: Exception) -> None:
        if self.lost is None:
            self.lost = why
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(self.lost)
        if self.transport is not None:
            self.transport.abort()

    def send(self, payload: bytes) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise self.lost
        assert self.transport is not None
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((fut, time.monotonic()))
        self.transport.write(payload)
        return fut


class PipelinedLink:
    """Calls to one Redis over one connection, opened on first use and again after it is lost.

    A call that fails on the connection raises :class:`ConnectionError` (or ``TimeoutError`` while
    connecting); an error reply raises :class:`ReplyError`. A caller's deadline is its own
    (``asyncio.timeout`` around the call): when it gives up, the reply is still read and dropped.
    A connection whose oldest call has waited longer than ``timeout_s`` is taken as dead and
    replaced at the next call, so a Redis that stopped answering cannot hold calls forever."""

    def __init__(
        self, host: str, port: int, *, username: str | None = None, password: str | None = None, db: int = 0,
        timeout_s: float | None = None, connect_timeout_s: float | None = None,
    ) -> None:
        self.host, self.port = host, port
        self._hello = [("AUTH", *((username,) if username else ()), password)] if password else []
        if db:
            self._hello.append(("SELECT", db))
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._known: set[str] = set()  # script SHAs sent on this connection or known to its server

    async def _connection(self) -> _Protocol:
        if self._usable(p := self._proto):
            return p
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._usable(p := self._proto):
                return p
            if p is not None:
                p.close(ConnectionError(f"redis at {self.host}:{self.port}: no reply in {self.timeout_s} s"))
            self._proto = None
            self._known.clear()
            async with asyncio.timeout(self.connect_timeout_s):
                _, p = await asyncio.get_running_loop().create_connection(_Protocol, self.host, self.port)
                replies = await asyncio.gather(*(p.send(hiredis.pack_command(c)) for c in self._hello))
            for cmd, reply in zip(self._hello, replies, strict=True):
                if isinstance(reply, hiredis.ReplyError):
                    p.close(ConnectionError(f"redis {cmd[0]}: {reply}"))
                    raise ConnectionError(f"redis at {self.host}:{self.port}: {cmd[0]} failed: {reply}")
            self._proto = p
            return p

    def _usable(self, p: _Protocol | None) -> TypeGuard[_Protocol]:
        """Open, and its oldest call has not waited past ``timeout_s``."""
        if p is None or p.lost is not None:
            return False
        return not (p.waiting and self.timeout_s and time.monotonic() - p.waiting[0][1] > self.timeout_s)

    async def call(self, *args: Arg) -> Any:
        p = await self._connection()
        reply = await p.send(hiredis.pack_command(args))  # type: ignore[arg-type]  # (its stub: a 1-tuple)
        if isinstance(reply, hiredis.ReplyError):
            raise ReplyError(str(reply))
        return reply

    async def script(self, body: str, keys: list[bytes], args: list[Arg] | None = None) -> Any:
        """EVALSHA of ``body``; the body itself (EVAL, which also caches it) when the server says
        it does not know it."""
        sha = _sha(body)
        tail = [*keys, *(args or ())]
        if sha in self._known:
            try:
                return await self.call("EVALSHA", sha, len(keys), *tail)
            except ReplyError as exc:
                if not str(exc).startswith("NOSCRIPT"):
                    raise
                self._known.discard(sha)
        reply = await self.call("EVAL", body, len(keys), *tail)
        self._known.add(sha)
        return reply

    def close(self) -> None:
        if self._proto is not None:
            self._proto.close(ConnectionError("closed"))
            self._proto = None
