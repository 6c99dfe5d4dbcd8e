"""Smoke test: ``benchmarks.dram`` runs end to end with tiny sizes (two sidecar processes, the
raw copy and both verification settings in the same rounds) and returns its JSON shape. No
timed assertions."""

from __future__ import annotations

import argparse
import json

from benchmarks import dram


def test_dram_bench_shape() -> None:
    p = argparse.ArgumentParser()
    dram.add_arguments(p)
    result = dram.run(p.parse_args(["--block-mib", "0.0625", "--batch", "4", "--rounds", "3"]))
    json.dumps(result)
    assert result["suite"] == "dram"
    for name in ("raw_put", "raw_get", "put", "get"):
        for tag in (("",) if name.startswith("raw") else ("_verify_off", "_verify_on")):
            figure = result["figures"][f"{name}_GBps{tag}"]
            assert figure["unit"] == "GB/s" and figure["value"] > 0
    assert set(result["ratios"]) == {f"{op}_vs_raw_verify_{v}" for op in ("put", "get") for v in ("off", "on")}
    assert all(r > 0 for r in result["ratios"].values())
    assert result["figures"]["blocks_per_batch"]["value"] == 4
