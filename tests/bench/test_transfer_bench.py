"""Smoke test: ``benchmarks.transfer`` runs end to end on the CPU with tiny sizes (NumpyTransfer
through a real slab against a memcpy of the same bytes) and returns its JSON shape. No timed
assertions. The GPU half runs in scripts/gpu-check."""

from __future__ import annotations

import argparse
import json

from benchmarks import transfer


def test_transfer_bench_shape_on_cpu() -> None:
    p = argparse.ArgumentParser()
    transfer.add_arguments(p)
    result = transfer.run(p.parse_args(["--device", "cpu", "--blocks", "4", "--rounds", "2",
                                        "--shapes", "qwen25_05b,llama3_70b_tp8"]))
    json.dumps(result)
    assert result["suite"] == "transfer" and result["notes"]["device"] == "cpu"
    for shape in ("qwen25_05b", "llama3_70b_tp8"):
        for name in ("memcpy", "gather", "scatter"):
            figure = result["figures"][f"{shape}_{name}_GBps"]
            assert figure["unit"] == "GB/s" and figure["value"] > 0
        assert result["figures"][f"{shape}_blocks"]["value"] == 4
    assert set(result["ratios"]) == {f"{s}_{op}_vs_memcpy" for s in ("qwen25_05b", "llama3_70b_tp8")
                                     for op in ("gather", "scatter")}
    assert all(r > 0 for r in result["ratios"].values())
