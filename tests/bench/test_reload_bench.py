"""Smoke test: ``benchmarks.reload`` runs end to end on the CPU with tiny sizes (a real sidecar,
the connector's load verified under each load guard and unverified) and returns its JSON shape:
wall and CPU times of each, the guard in force, what the hashing costs and how much of it ran beside the copy. No timed
assertions."""

from __future__ import annotations

import argparse
import json

from benchmarks import reload


def test_reload_bench_shape_on_cpu() -> None:
    p = argparse.ArgumentParser()
    reload.add_arguments(p)
    result = reload.run(p.parse_args(["--shapes", "qwen25_05b", "--blocks", "8", "--rounds", "2"]))
    json.dumps(result)
    assert result["suite"] == "reload" and result["notes"]["device"] == "cpu"
    assert result["notes"]["cpus"] >= 1 and result["notes"]["load_before"] >= 0
    figures, s = result["figures"], "qwen25_05b"
    assert figures[f"{s}_blocks"]["value"] == 8
    assert result["notes"][f"{s}_guard_in_force"] == "read_only"  # the sidecar is another process
    for way in ("verified", "hashed", "unverified"):
        for what in ("", "_median", "_cpu", "_caller_cpu"):
            assert figures[f"{s}_reload_{way}{what}_ms"]["value"] > 0
    for name in ("serial_hash_ms", "first_chunk_hash_ms", "hash_GBps", "copy_GBps"):
        assert figures[f"{s}_{name}"]["value"] > 0
    assert 0 <= figures[f"{s}_hash_hidden"]["value"] <= 1
    assert set(result["ratios"]) == {f"{s}_{way}_vs_unverified{k}" for way in ("verified", "hashed")
                                     for k in ("", "_median", "_cpu", "_caller_cpu")}
    assert all(r > 0 for r in result["ratios"].values())
