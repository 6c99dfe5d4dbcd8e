"""The pipelined asyncio RESP link (kvstore.wire.resp_pipe) against a real redis-server: concurrent
calls each get their own reply, a caller that gives up does not shift anyone's reply, scripts
survive a SCRIPT FLUSH and a restart, AUTH and SELECT on connect, and a server that stops answering
is replaced instead of holding calls forever."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis

from kvstore.harness.servers import redis_server
from kvstore.wire.resp_pipe import PipelinedLink, ReplyError, tcp_settings

ECHO_KEYS = "return KEYS[1] .. ARGV[1]"


async def test_concurrent_calls_each_get_their_own_reply() -> None:
    with redis_server() as server:
        r = redis.Redis(port=server.port)
        for i in range(200):
            r.set(f"k{i}", f"v{i}")
        link = PipelinedLink("127.0.0.1", server.port)
        try:
            got = await asyncio.gather(*(link.call("GET", f"k{i}") for i in range(200)))
            assert got == [f"v{i}".encode() for i in range(200)]
            assert await link.call("GET", "missing") is None
            with pytest.raises(ReplyError, match="WRONGTYPE"):
                r.rpush("list", "x")
                await link.call("GET", "list")
            assert await link.call("GET", "k7") == b"v7"  # an error reply leaves the connection usable
        finally:
            link.close()


async def test_a_caller_that_gives_up_does_not_shift_the_next_reply() -> None:
    with redis_server() as server:
        redis.Redis(port=server.port).set("k", "v")
        link = PipelinedLink("127.0.0.1", server.port)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await link.call("BLPOP", "empty", "0.3")  # its reply (nil) comes 0.3 s later
            assert await link.call("GET", "k") == b"v"  # not the BLPOP's late nil
        finally:
            link.close()


async def test_scripts_survive_a_flush_and_a_restart() -> None:
    with redis_server() as server:
        link = PipelinedLink("127.0.0.1", server.port)
        try:
            assert await link.script(ECHO_KEYS, [b"a"], ["1"]) == b"a1"
            assert await link.script(ECHO_KEYS, [b"b"], ["2"]) == b"b2"  # by SHA now
            server.cli("SCRIPT", "FLUSH")
            assert await link.script(ECHO_KEYS, [b"c"], ["3"]) == b"c3"  # NOSCRIPT: sent whole again
            server.stop()
            with pytest.raises(OSError):
                await link.script(ECHO_KEYS, [b"d"], ["4"])
            server.start()
            assert await link.script(ECHO_KEYS, [b"e"], ["5"]) == b"e5"  # a new connection
        finally:
            link.close()


async def test_it_authenticates_and_selects_as_the_redis_py_client_does() -> None:
    with redis_server("--requirepass", "s3cret") as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        redis.Redis.from_url(url).set("k", "in db 3")
        client = redis.asyncio.Redis.from_url(url)
        settings = tcp_settings(client)
        assert settings is not None
        link = PipelinedLink("127.0.0.1", server.port, **settings)
        wrong = PipelinedLink("127.0.0.1", server.port, password="nope")
        try:
            assert await link.call("GET", "k") == b"in db 3"
            with pytest.raises(ConnectionError, match="AUTH"):
                await wrong.call("GET", "k")
        finally:
            link.close()
            wrong.close()
            await client.aclose()
    assert tcp_settings(redis.asyncio.Redis.from_url("rediss://127.0.0.1:1/0")) is None  # TLS: not this path
    assert tcp_settings(redis.asyncio.Redis.from_url("unix:///tmp/redis.sock")) is None


async def test_a_server_that_stops_answering_is_replaced() -> None:
    """A listener that accepts and never replies: calls time out at their callers, and once the
    oldest has waited past ``timeout_s`` the next call opens a new connection."""
    silent = socket.create_server(("127.0.0.1", 0))
    silent.setblocking(False)
    port = silent.getsockname()[1]
    accepted: list[socket.socket] = []
    link = PipelinedLink("127.0.0.1", port, timeout_s=0.1, connect_timeout_s=1.0)
    try:
        for _ in range(2):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await link.call("PING")
            while True:  # every connection the link opened
                try:
                    accepted.append(silent.accept()[0])
                except BlockingIOError:
                    break
        assert len(accepted) == 2  # the second call did not queue behind the first's dead connection
    finally:
        link.close()
        for s in accepted:
            s.close()
        silent.close()
