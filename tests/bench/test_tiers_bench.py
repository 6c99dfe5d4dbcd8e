"""Smoke test: ``benchmarks.tiers`` runs end to end with tiny sizes and returns its JSON shape.

No timed assertions: only that every figure and ratio it promises is there and well formed.
"""

from __future__ import annotations

import json

from benchmarks import tiers


def test_tiers_bench_shape(tmp_path) -> None:
    args = tiers.parser().parse_args(
        ["--blocks", "2", "--block-mib", "0.0625", "--repeat", "1", "--tiers", "ssd,redis", "--ssd-dir", str(tmp_path)]
    )
    result = tiers.run(args)
    json.dumps(result)  # serialisable as the CLI prints it
    assert result["suite"] == "tiers"
    for tier in ("ssd", "redis"):
        for kind in ("tier", "service"):
            for op in ("put", "get"):
                assert result["ratios"][f"{kind}_{op}_{tier}"] > 0
                for side in ("ours", "raw"):
                    fig = result["figures"][f"{kind}.{tier}.{op}.{side}"]
                    assert fig["unit"] == "MiB/s" and fig["value"] > 0
    for side in ("ours", "raw"):  # Redis memory per block byte, each side holding the same blocks
        fig = result["figures"][f"tier.redis.memory.{side}"]
        assert fig["unit"] == "bytes per block byte" and fig["value"] >= 1
    assert result["ratios"]["memory_redis"] > 0
    assert result["figures"]["block_bytes"]["value"] == 65536
    assert result["figures"]["blocks"]["value"] == 2


def test_peers_absent_says_why_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    """``--peers`` where LMCache cannot be imported (as in CI): kvstore's figures as usual, no
    LMCache figure or ratio, and ``notes.lmcache`` with the exact error."""
    from benchmarks.peers import lmcache_backends

    def missing():
        raise ModuleNotFoundError("No module named 'lmcache'")

    monkeypatch.setattr(lmcache_backends, "_import_lmcache", missing)
    args = tiers.parser().parse_args(
        ["--blocks", "2", "--block-mib", "0.0625", "--repeat", "1", "--tiers", "ssd", "--no-service", "--peers", "--ssd-dir", str(tmp_path)]
    )
    result = tiers.run(args)
    assert result["notes"]["lmcache"] == "not run: ModuleNotFoundError: No module named 'lmcache'"
    assert not [k for k in result["ratios"] if k.startswith("vs_")]
    assert not [k for k in result["figures"] if k.startswith("lmcache")]
    for tier in ("ssd", "ssd_nofsync", "ssd_direct_nofsync"):  # the like-for-like modes still run
        assert result["ratios"][f"tier_put_{tier}"] > 0 and result["ratios"][f"tier_get_{tier}"] > 0
