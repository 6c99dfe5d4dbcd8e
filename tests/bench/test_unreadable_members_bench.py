"""Smoke test: ``benchmarks.unreadable_members`` runs end to end with a few entries and a short
lease. No timed assertions."""

from __future__ import annotations

from benchmarks import unreadable_members
from kvstore.harness.servers import redis_server


async def test_unreadable_members_bench_shape() -> None:
    with redis_server() as server:
        out = await unreadable_members.run(server.url, 300, lease_ms=500, window_s=0.5)
    assert out["unreadable"] == out["forgotten"] == 300
    assert out["deleted_s"] > 0 and out["heartbeats_per_s"] >= 0
