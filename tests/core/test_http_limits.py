"""The sidecar's HTTP side holds no descriptor for ever (issue 29, case 5): a connection that sends
nothing, half a request line, or falls idle after a request is closed after
``server.http_idle_timeout_s``; past ``server.http_max_connections`` a connection is served the
probes only (``server.http_probe_connections`` of them, the oldest closed for a new one), any other
path answered 503. 8dc5782 kept such connections open (130 s and counting) and accepted any number, so
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


async def get(port: int, path: str) -> bytes:
    """One GET of ``path`` on a fresh connection; the whole answer (the server closes it)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return await closed_by_server(r)
    finally:
        w.close()


async def test_connections_past_the_cap_are_served_the_probes_only_and_the_cap_frees_up(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, **{"server.http_max_connections": 4})
    async with Sidecar(cfg) as sc:
        port = sc.http_port
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        try:
            for hr, hw in held:  # each one answered (and so counted by the server), then kept alive
                hw.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await asyncio.wait_for(hr.read(4096), WAIT_S)).startswith(b"HTTP/1.1 200")
            answer = await get(port, "/stats")
            assert answer.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in answer
            assert (await get(port, "/healthz")).startswith(b"HTTP/1.1 200")
        finally:
            for _, hw in held:
                hw.close()
        deadline = time.monotonic() + WAIT_S
        while True:  # once the held ones are gone, a new connection is served
            answer = await get(port, "/stats")
            if answer.startswith(b"HTTP/1.1 200"):
                break
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.05)


PROBES = 48


async def test_probes_answer_while_idle_connections_fill_the_cap(tmp_path: Path) -> None:
    """Issue 37, part 5: unauthenticated connections that connect and send nothing fill
    ``server.http_max_connections`` (and, twice over, the probes' room past it); the liveness and
    readiness probes and a scrape, each on a new connection, are still answered, while any other
    path past the cap is 503. On 66d9839 48 of 48 probes were answered 503 (a liveness probe
    would have restarted the sidecar and dropped its DRAM)."""
    cap, room = 16, 8  # (server.http_probe_connections's default)
    cfg = small_config(tmp_path, **{"server.http_max_connections": cap, "server.auth_token": "t0k3n"})
    async with Sidecar(cfg) as sc:
        port = sc.http_port
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap + 2 * room)]
        try:
            answers = []
            for i in range(PROBES):
                path = ("/healthz", "/readyz", "/metrics?token=t0k3n")[i % 3]
                answers.append((path, (await get(port, path))[:12]))
            assert [a for a in answers if a[1] != b"HTTP/1.1 200"] == []
            assert (await get(port, "/metrics"))[:12] == b"HTTP/1.1 401"  # (the token still asked for)
            answer = await get(port, "/stats?token=t0k3n")
            assert answer.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in answer
        finally:
            for _, w in idle:
                w.close()
