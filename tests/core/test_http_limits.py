"""The sidecar's HTTP side holds no descriptor for ever (issue 29, case 5): a connection that sends
nothing, half a request line, or falls idle after a request is closed after
``server.http_idle_timeout_s``; past ``server.http_max_connections`` a connection is answered 503
and closed. 8dc5782 kept such connections open (130 s and counting) and accepted any number, so
idle connections ran the process out of file descriptors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

WAIT_S = 30.0


@pytest.fixture
async def limited(tmp_path: Path) -> AsyncIterator[Sidecar]:
    cfg = small_config(tmp_path, **{"server.http_idle_timeout_s": 0.5, "server.http_max_connections": 4})
    async with Sidecar(cfg) as sc:
        yield sc


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded wait)."""
    return await asyncio.wait_for(reader.read(), WAIT_S)


async def test_silent_half_sent_and_idle_connections_are_closed(limited: Sidecar) -> None:
    port = limited.http_port
    silent = await asyncio.open_connection("127.0.0.1", port)
    half = await asyncio.open_connection("127.0.0.1", port)
    half[1].write(b"GET /heal")  # half a request line, never finished
    idle = await asyncio.open_connection("127.0.0.1", port)
    idle[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then kept alive and idle
    try:
        assert await closed_by_server(silent[0]) == b""
        assert await closed_by_server(half[0]) == b""
        answer = await closed_by_server(idle[0])
        assert answer.startswith(b"HTTP/1.1 200") and b'"ok"' in answer
    finally:
        for _, w in (silent, half, idle):
            w.close()


async def test_connections_past_the_cap_are_refused_and_the_cap_frees_up(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, **{"server.http_max_connections": 4})
    async with Sidecar(cfg) as sc:
        port = sc.http_port
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        try:
            for hr, hw in held:  # each one answered (and so counted by the server), then kept alive
                hw.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await asyncio.wait_for(hr.read(4096), WAIT_S)).startswith(b"HTTP/1.1 200")
            r, w = await asyncio.open_connection("127.0.0.1", port)
            answer = await closed_by_server(r)
            w.close()
            assert answer.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in answer
        finally:
            for _, hw in held:
                hw.close()
        deadline = time.monotonic() + WAIT_S
        while True:  # once the held ones are gone, a new connection is served
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await closed_by_server(r)
            w.close()
            if answer.startswith(b"HTTP/1.1 200"):
                break
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.05)
