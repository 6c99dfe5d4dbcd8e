"""Smoke test: ``benchmarks.retention`` runs end to end with tiny sizes and returns its JSON shape
(a write's and /healthz's times with 0, some and all blocks retained, each against none). No
timed assertions: the retained counts it reports are checked instead."""

from __future__ import annotations

import argparse
import json

from benchmarks import retention


def test_retention_bench_shape() -> None:
    p = argparse.ArgumentParser()
    retention.add_arguments(p)
    argv = ["--blocks", "512", "--levels", "0,100,512", "--writes", "6", "--batch", "256"]
    result = retention.run(p.parse_args(argv))
    json.dumps(result)
    assert result["suite"] == "retention"
    figures = result["figures"]
    for n in (0, 100, 512):
        assert figures[f"write_p50_{n}_retained"]["unit"] == "ms" and figures[f"write_p50_{n}_retained"]["value"] > 0
        assert figures[f"healthz_p50_{n}_retained"]["value"] > 0
        assert result["ratios"][f"write_{n}_vs_0_retained"] > 0
        # The level's retained blocks and the writer's 3 hinted writes; with all 512 retained, 3 of
        # them made room for its 3 unretained writes (each hinted write evicts the one before).
        assert figures[f"retained_blocks_held_{n}"]["value"] == (n + 3 if n < 512 else 512)
    assert result["ratios"]["write_0_vs_0_retained"] == 1.0
