"""Smoke test: ``benchmarks.ttft`` runs end to end with a tiny model and one tier and returns its
JSON shape, with both sides pinned to the same CPUs: this process and the sidecar it starts run
on the CPU set given, and ``notes.cpus`` states the split. No timed assertions."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import pytest

from benchmarks import ttft


@pytest.fixture
def restore_affinity() -> Iterator[None]:
    """The run pins this (pytest's) process and sets torch's thread count: both are put back
    afterwards (a later test comparing logits computed here with a subprocess's, bit for bit,
    failed when this process kept one torch thread: the reductions split differently)."""
    import torch

    saved, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        yield
    finally:
        ttft.pin(saved)
        torch.set_num_threads(threads)


def test_parse_cpus() -> None:
    assert ttft.parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert ttft.parse_cpus("3") == {3}
    assert ttft.parse_cpus("") == os.sched_getaffinity(0)


def test_ttft_bench_shape_and_both_sides_on_the_same_cpus(restore_affinity: None) -> None:
    cpu = max(os.sched_getaffinity(0))
    p = argparse.ArgumentParser()
    ttft.add_arguments(p)
    argv = ["--tiers", "dram", "--lengths", "64", "--small-blocks", "--reps", "1", "--layers", "1", "--cpus", str(cpu),
            "--no-progress"]
    result = ttft.run(p.parse_args(argv))
    json.dumps(result)
    assert result["suite"] == "ttft"
    for way in ("recompute", "reload"):
        fig = result["figures"][f"ttft_{way}_dram_64_p50"]
        assert fig["unit"] == "ms" and fig["value"] > 0
    assert result["ratios"]["reload_dram_64"] > 0
    assert 0 <= result["ratios"]["decision_accuracy"] <= 1
    cpus = result["notes"]["cpus"]
    assert cpus["set"] == [cpu] and cpus["torch_threads"] == 1
    assert cpus["this_process"] == [cpu]  # the model's process, every thread of it
    assert cpus["sidecars"] == {"dram": [cpu]}  # the reload's sidecar: the same CPU, read back from its threads
    assert str(cpu) in cpus["recompute"] and str(cpu) in cpus["reload"]
