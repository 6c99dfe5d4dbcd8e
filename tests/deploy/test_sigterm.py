"""SIGTERM: the sidecar drains, releases leases and allocations, flushes the SSD tier, unlinks
its shared memory, releases the data-directory lock and exits 0."""

from __future__ import annotations

import json
import os
import signal

import numpy as np

from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
SMALL_DRAM = {  # 32 slots of 8 KiB
    "KVSTORE_DRAM__CAPACITY_BYTES": str(4 * 65536),
    "KVSTORE_DRAM__PAGE_BYTES": "65536",
    "KVSTORE_DRAM__MIN_SLOT_BYTES": "4096",
    "KVSTORE_INDEX__REAPER_INTERVAL_MS": "50",
}


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in range(n)]


def test_sigterm_drains_and_cleans_up_then_a_restart_finds_the_ssd_blocks(serve_process, tmp_path):
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    sc = serve_process(args, SMALL_DRAM)
    first = prefix_keys(NS, list(range(16 * 16)))  # 16 blocks, pushed down to SSD by the next 32
    second = prefix_keys(NS, list(range(100_000, 100_000 + 16 * 32)))
    first_data = blocks(16, 1)
    with SyncClient(sc.grpc) as c:
        c.put_blocks(NS, first, first_data, checksums=True)
        c.put_blocks(NS, second, blocks(32, 2), checksums=True)
        assert {t for t, _ in c.lookup(NS, first).blocks} == {"ssd"}
        alloc = c.allocate(NS, prefix_keys(NS, list(range(50_000, 50_000 + 16 * 4))), 8192).__enter__()  # left open
        lease = c.acquire(NS, second[:4]).__enter__()  # held while the sidecar stops
        assert len(lease.views) == 4
        segment = sc.ready["segment"]
        assert os.path.exists(f"/dev/shm/{segment}")
        assert sc.stop(signal.SIGTERM) == 0
        del alloc, lease
    assert not os.path.exists(f"/dev/shm/{segment}"), "the slab must be unlinked"
    assert not (tmp_path / "d" / "segment").exists()
    events = [json.loads(line) for line in sc.logs().splitlines() if line.startswith("{")]
    assert any(e["msg"] == "signal received; draining" and e["level"] == "info" for e in events)
    assert all({"ts", "level", "logger", "msg"} <= e.keys() for e in events)

    again = serve_process(args, SMALL_DRAM)  # the lock was released; SSD blocks were flushed
    with SyncClient(again.grpc) as c:
        r = c.lookup(NS, first)
        assert r.matched == 16 and {t for t, _ in r.blocks} == {"ssd"}
        got = c.get_blocks(NS, first, verify=True)
        assert all(np.array_equal(a, b) for a, b in zip(got, first_data))
        assert c.stats()["index"]["allocations"] == 0
    assert again.stop(signal.SIGTERM) == 0
