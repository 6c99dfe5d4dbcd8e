"""The cluster replay against the real thing: three ``kvstore serve`` processes with one
redis-server as their directory serve a segment of the shared conversation trace, round-robin,
and reach exactly the prefix and peer hit rates ``kvstore replay --nodes 3`` predicts for it.

The segment fits every node's DRAM, so no eviction happens on either side: what is compared is
what the directory and peer fetch find (eviction order under pressure is the replay's own policy
code, tested in tests/sim/)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import SyncClient
from kvstore.harness.servers import RedisServer, redis_server
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import Namespace
from kvstore.sim.cluster import replay_cluster
from kvstore.sim.traces import Trace, load_trace

REPO = Path(__file__).resolve().parents[2]
SEGMENT = 300  # requests: 8,490 block references
NODES = 3
BLOCK = 4096


@pytest.fixture(scope="module")
def directory() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def trace_key(block_id: int) -> bytes:
    return hashlib.sha256(b"trace block %d" % block_id).digest()


def test_three_sidecars_reach_the_hit_rates_the_cluster_replay_predicts(
    directory: RedisServer, tmp_path: Path
) -> None:
    full = load_trace(REPO / "data/traces/conversation_trace.jsonl.gz")
    segment = Trace("conversation-segment", full.requests[:SEGMENT], full.block_tokens)
    predicted = replay_cluster(segment, NODES, capacity=10**9, mode="cluster", routing="round-robin")

    ns = Namespace(model="trace", kv_layout="raw", dtype="int8", block_size=full.block_tokens)
    data = np.zeros(BLOCK, dtype=np.uint8)
    procs = [
        ServeProcess([
            "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / f"n{i}"),
            "--dram-bytes", str(64 << 20),
        ], env={
            "KVSTORE_SSD__ENABLED": "false", "KVSTORE_CLUSTER__ENABLED": "true",
            "KVSTORE_CLUSTER__DIRECTORY_URL": directory.url, "KVSTORE_CLUSTER__NODE_ID": f"n{i}",
            "KVSTORE_CLUSTER__PEER_ADDRESS": "127.0.0.1:0", "KVSTORE_CLUSTER__TOKEN": "replay-check",
            "KVSTORE_CLUSTER__KEY_PREFIX": "replay-check",
        })
        for i in range(NODES)
    ]
    clients = [SyncClient(p.grpc) for p in procs]
    try:
        references = prefix_hits = peer_hits = 0
        for i, req in enumerate(segment.requests):
            c = clients[i % NODES]
            keys = [trace_key(k) for k in req.keys]
            found = c.lookup(ns, keys)
            references += len(keys)
            prefix_hits += found.matched
            peer_hits += sum(1 for tier, _ in found.blocks if tier == "peer")
            if found.matched:
                with c.acquire(ns, keys[: found.matched]) as lease:  # the peers' blocks come over, kept here
                    assert len(lease.views) == found.matched
            if found.matched < len(keys):
                rest = keys[found.matched :]
                c.put_blocks(ns, rest, [data] * len(rest), first_parent=keys[found.matched - 1] if found.matched
                             else b"", wait_published=True)
        assert references == predicted.references
        assert (prefix_hits, peer_hits) == (predicted.prefix_hits, predicted.peer_hits)
        assert peer_hits > 0.3 * prefix_hits  # round-robin: most of what is found lies on another node
    finally:
        for c in clients:
            c.close()
        for p in procs:
            p.stop()
