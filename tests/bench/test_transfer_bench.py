"""Smoke test: ``benchmarks.transfer`` runs end to end on the CPU with tiny sizes (NumpyTransfer
through a real slab against a memcpy of the same bytes) and returns its JSON shape. No timed
assertions. The GPU half runs in scripts/gpu-check."""

from __future__ import annotations

import argparse
import json

import pytest

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
        # the GPU path's host work per batch, measured on the CPU (a batch of --blocks)
        assert result["figures"][f"{shape}_host_plan_blocks"]["value"] == 4
        per_batch = result["figures"][f"{shape}_host_plan_us_per_batch"]
        per_block = result["figures"][f"{shape}_host_plan_us_per_block"]
        assert per_batch["unit"] == per_block["unit"] == "us" and per_batch["value"] > 0
        assert per_block["value"] == pytest.approx(per_batch["value"] / 4, rel=1e-3, abs=1e-5)
        assert result["figures"][f"{shape}_host_plan_views_us_per_block"]["value"] > 0
        # its fixed part (a batch of one block) and what a further slot adds
        assert result["figures"][f"{shape}_host_plan_one_block_us"]["value"] > 0
        assert result["figures"][f"{shape}_host_plan_us_per_slot_above_one"]["value"] >= 0
    ops = ("gather_vs_memcpy", "scatter_vs_memcpy", "host_plan_vs_memcpy_per_block")
    assert set(result["ratios"]) == {f"{s}_{op}" for s in ("qwen25_05b", "llama3_70b_tp8") for op in ops}
    assert all(r > 0 for r in result["ratios"].values())
