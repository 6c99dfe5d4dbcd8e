"""One client call on a test host, as a process of its own: ``python host_client.py JSON``.

The cluster tests run it inside a sidecar's network and mount namespaces (``nsenter -t PID -m
-n``), so it reaches that sidecar's gRPC port and maps its shared memory like any engine on that
host, and nothing else's. It prints one JSON line. Blocks are made from a seed
(:func:`make_blocks`), so the test computes the same bytes to compare with.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from kvstore.checksum import checksum
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys


def namespace(salt: str = "") -> Namespace:
    return Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16, cache_salt=salt)


def make_keys(seed: int, n: int, salt: str = "") -> list[bytes]:
    ns = namespace(salt)
    return prefix_keys(ns, list(range(seed * 100_000, seed * 100_000 + n * ns.block_size)))


def make_blocks(seed: int, n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def main(req: dict[str, Any]) -> dict[str, Any]:
    ns, salt = namespace(req.get("salt", "")), req.get("salt", "")
    keys = make_keys(req["seed"], req["n"], salt)
    with SyncClient(req["grpc"]) as c:
        op = req["op"]
        if op == "put":
            got = c.put_blocks(ns, keys, make_blocks(req["seed"], req["n"], req["size"]), checksums=True,
                               wait_published=True)
            return {"stored": got.stored, "present": got.present}
        if op == "lookup":
            found = c.lookup(ns, keys)
            return {"matched": found.matched, "tiers": [t for t, _ in found.blocks]}
        if op == "get":
            blocks = c.get_blocks(ns, keys, verify=True)
            return {"sums": [checksum(b) for b in blocks]}
        if op == "corrupt":  # flip a byte of block i in this host's slab, its recorded checksum unchanged
            from tests.support.corrupt import flip  # (this process's own mapping is read-only)

            with c.acquire(ns, keys) as lease:
                slot = lease.slots[req["i"]]
                flip(slot.segment, slot.offset + 11)
            return {"ok": True}
        if op == "stats":
            return dict(c.stats())
        raise SystemExit(f"unknown op {op!r}")


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
