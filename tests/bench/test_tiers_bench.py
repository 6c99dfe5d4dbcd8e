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
    assert result["figures"]["block_bytes"]["value"] == 65536
    assert result["figures"]["blocks"]["value"] == 2
