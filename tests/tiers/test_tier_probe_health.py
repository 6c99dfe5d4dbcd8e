"""The tier probe is a background loop like the others (issue 29, case 3): an unexpected error in
a pass is counted, logged and retried with back-off, and ``/readyz`` names the loop until a pass
succeeds. 8dc5782 logged each such error every second and ``/readyz`` said ready."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession

from kvstore.errors import Unavailable
from kvstore.harness.servers import RedisServer
from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

WAIT_S = 30.0


async def test_a_probe_that_fails_unexpectedly_is_reported_and_retried(
    tmp_path: Path, redis_clean: RedisServer
) -> None:
    cfg = small_config(tmp_path, **{"redis.enabled": True, "redis.url": redis_clean.url})
    async with Sidecar(cfg) as sc, ClientSession() as http:
        level = next(lv for lv in sc.store.tiering.levels if lv.name == "redis")  # type: ignore[attr-defined]
        real = level.tier.contains

        async def broken(*args: Any) -> bool:
            raise RuntimeError("a probe bug")

        async def readyz() -> tuple[int, dict[str, Any]]:
            async with http.get(f"http://127.0.0.1:{sc.http_port}/readyz") as resp:
                return resp.status, await resp.json()

        level.tier.contains = broken
        level.mark_down(Unavailable("redis: down (the test)"))  # the next pass probes it
        deadline = time.monotonic() + WAIT_S
        while (await readyz())[1].get("failing", {}).get("kvstore-tier-probe", "") != "RuntimeError: a probe bug":
            assert time.monotonic() < deadline, await readyz()
            await asyncio.sleep(0.05)
        assert (await readyz())[0] == 503
        assert sc.store.stats.errors["task:kvstore-tier-probe"] >= 1
        level.tier.contains = real
        while level.down or (await readyz())[0] != 200:  # the next pass finds it back
            assert time.monotonic() < deadline, await readyz()
            await asyncio.sleep(0.05)
