"""Drops under write pressure: an eviction after which no tier holds the block is counted on /stats
(``tiers.<tier>.drops.<reason>``) and /metrics (``kvstore_tier_drops_total{tier,reason}``), and the
counts equal the blocks a real ``kvstore serve`` lost, by reason. Before, a drop was visible only
as evictions minus demotions."""

from __future__ import annotations

import signal
import time
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
BLOCK = 8192
DROP_REASONS = ("backlog", "refused", "failed", "no_tier")
SMALL_DRAM = {  # 32 slots of 8 KiB
    "KVSTORE_DRAM__CAPACITY_BYTES": str(4 * 65536),
    "KVSTORE_DRAM__PAGE_BYTES": "65536",
    "KVSTORE_DRAM__MIN_SLOT_BYTES": "4096",
}


def _put_and_count(sc, rounds: int) -> tuple[int, dict[str, dict[str, int]]]:
    """Put ``rounds`` x 32 blocks (one request each: 32 evictions at once from the second on); the
    blocks no tier holds afterwards (each key looked up alone), and the drops /stats counts."""
    rng = np.random.default_rng(7)
    keys: list[bytes] = []
    with SyncClient(sc.grpc) as c:
        for r in range(rounds):
            ks = prefix_keys(NS, list(range(r * 100_000, r * 100_000 + 16 * 32)))
            c.put_blocks(NS, ks, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in ks], checksums=True)
            keys += ks
        deadline = time.monotonic() + 60  # (a bound on the wait, not an assertion)
        while c.stats()["tiers"]["dram"]["demotions_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the demotions in flight land (or are dropped) before the count
        tiers = c.stats()["tiers"]
        assert tiers["dram"]["demotions_in_flight"] == 0
        lost = sum(1 for k in keys if c.lookup(NS, [k]).matched == 0)
        after = c.stats()["tiers"]
        assert [(after[t]["drops"], after[t]["blocks"]) for t in ("dram", "ssd")] == [
            (tiers[t]["drops"], tiers[t]["blocks"]) for t in ("dram", "ssd")]  # (nothing moved meanwhile)
    return lost, {t: tiers[t]["drops"] for t in ("dram", "ssd")}


def _metric_drops(http: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://{http}/metrics") as r:
        text = r.read().decode()
    return {(s.labels["tier"], s.labels["reason"]): s.value
            for f in text_string_to_metric_families(text) if f.name == "kvstore_tier_drops"
            for s in f.samples if s.name == "kvstore_tier_drops_total"}


def _serve(serve_process, tmp_path, env: dict[str, str]):
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d")]
    return serve_process(args, {**SMALL_DRAM, **env})


def test_an_ssd_behind_its_evictions_drops_blocks_counted_as_backlog(serve_process, tmp_path):
    """Staging for one block: of 32 evictions at once, the first is staged for the SSD and the rest
    cannot wait for it -- each dropped, and counted as ``backlog`` on DRAM, nothing else."""
    sc = _serve(serve_process, tmp_path, {"KVSTORE_TIERING__STAGING_BYTES": str(BLOCK)})
    lost, drops = _put_and_count(sc, 3)
    assert lost > 0
    assert drops["dram"] == {r: lost if r == "backlog" else 0 for r in DROP_REASONS}
    assert drops["ssd"] == dict.fromkeys(DROP_REASONS, 0)
    assert _metric_drops(sc.http)[("dram", "backlog")] == lost
    assert sc.stop(signal.SIGTERM) == 0


def test_a_full_ssd_drops_its_victims_counted_as_no_tier(serve_process, tmp_path):
    """An SSD of 64 KiB (the last tier): what it evicts to take DRAM's demotions is dropped,
    counted as ``no_tier`` on the SSD; DRAM drops nothing (its evictions all reach the SSD)."""
    sc = _serve(serve_process, tmp_path, {"KVSTORE_SSD__CAPACITY_BYTES": str(65536)})
    lost, drops = _put_and_count(sc, 3)
    assert lost > 0
    assert sum(drops["ssd"].values()) + sum(drops["dram"].values()) == lost
    assert drops["ssd"]["no_tier"] > 0 and drops["dram"]["backlog"] == drops["dram"]["failed"] == 0
    metric = _metric_drops(sc.http)
    assert {k: v for k, v in metric.items() if v} == {
        (t, r): n for t in ("dram", "ssd") for r, n in drops[t].items() if n}
    assert sc.stop(signal.SIGTERM) == 0
