"""Members entries no node can read (issue 29): how long a node takes to delete N of them, and its
heartbeat rate once they are gone.

One redis-server (``kvstore.harness.servers.redis_server``); N fields of the ``members`` hash that
are not UTF-8 written first; then one in-process sidecar joins (heartbeat 1 s, lease 6 s). It
counts them (``members_unreadable``) and deletes each once it has stayed unchanged for a lease,
``kvstore.cluster.membership.FORGET_MEMBERS_BATCH`` a heartbeat. Printed: the seconds from the start
until only its own entry is left, and its heartbeats a second over the 10 s after.

    python3 -m benchmarks.unreadable_members 200000
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aredis

from kvstore.config import load_config
from kvstore.harness.servers import redis_server
from kvstore.server.sidecar import Sidecar


async def run(url: str, n: int, lease_ms: int = 6000, window_s: float = 10.0) -> dict[str, float]:
    """Returns (and prints) the seconds until they are deleted and the heartbeat rate after."""
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, {
            "data_dir": str(Path(d) / "data"), "server.grpc_address": "127.0.0.1:0",
            "server.http_address": "127.0.0.1:0", "server.local_socket": "off", "dram.capacity_bytes": 4 * 65536,
            "dram.page_bytes": 65536, "dram.min_slot_bytes": 4096, "ssd.enabled": False,
            "cluster.enabled": True, "cluster.directory_url": url, "cluster.node_id": "a",
            "cluster.peer_address": "127.0.0.1:0", "cluster.token": "bench", "cluster.key_prefix": "bench",
            "cluster.heartbeat_ms": min(1000, lease_ms // 2), "cluster.lease_ms": lease_ms,
        })
        r = aredis.Redis.from_url(url)
        key = "bench:members"
        for i in range(0, n, 10_000):
            await r.hset(key, mapping={f"bad{j}".encode() + b"\xff": b"x" for j in range(i, min(n, i + 10_000))})
        started = time.monotonic()
        async with Sidecar(cfg) as a:
            stats = a.store.stats.cluster
            while await r.hlen(key) > 1:
                await asyncio.sleep(0.1)
            deleted_s = time.monotonic() - started
            before = stats["heartbeats"]
            await asyncio.sleep(window_s)
            rate = (stats["heartbeats"] - before) / window_s
            print(f"{n} unreadable entries: all deleted {deleted_s:.1f} s after the start (lease {lease_ms} ms); "
                  f"then {rate:.2f} heartbeats/s; members_unreadable {stats['members_unreadable']}, "
                  f"members_forgotten {stats['members_forgotten']}")
            out = {"deleted_s": deleted_s, "heartbeats_per_s": rate, "unreadable": stats["members_unreadable"],
                   "forgotten": stats["members_forgotten"]}
        await r.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("entries", type=int, nargs="?", default=200_000)
    args = p.parse_args()
    with redis_server() as server:
        asyncio.run(run(server.url, args.entries))


if __name__ == "__main__":
    main()
