"""The reload-or-recompute model makes the exact choices its formula implies."""

from __future__ import annotations

import json

import pytest

from connector.cost import (
    CostModel,
    ModelShape,
    TierRate,
    calibrate_flop_rate,
    calibrate_memcpy_bandwidth,
    tier_name,
)

MB = 1e6
SHAPE = ModelShape(params=1_000_000_000, layers=32, q_heads=32, head_dim=128)
BLOCK = 16
BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * BLOCK  # K+V, 32 layers, 8 kv heads, d=128, bf16: 2 MiB


def model(**tiers: tuple[float, float]) -> CostModel:
    return CostModel(SHAPE, flop_rate=1e12, tiers={n: TierRate.of(bw, lat) for n, (bw, lat) in tiers.items()})


def test_prefill_flops_formula() -> None:
    s = ModelShape(params=10, layers=2, q_heads=3, head_dim=4)
    assert s.prefill_flops(0, 5) == 2 * 10 * 5 + 2 * 2 * 3 * 4 * (5 * 6)
    assert s.prefill_flops(7, 5) == 2 * 10 * 5 + 2 * 2 * 3 * 4 * (12 * 13 - 7 * 8)
    assert s.prefill_flops(7, 0) == 0


def test_slow_tier_short_prefix_recomputes() -> None:
    m = model(s3=(100 * MB, 0.030))
    d = m.choose_blocks(["s3", "s3"], BLOCK_BYTES, BLOCK, prompt_tokens=100)
    # loading 2 blocks: 4.19 MB / 100 MB/s + 30 ms = 72 ms > 32 tokens of prefill (~65 ms)
    assert (d.blocks, d.load_blocks, d.kind) == (0, 0, "recompute")
    assert d.predicted_load_s == 0.0
    assert d.predicted_ttft_s == pytest.approx(d.recompute_ttft_s)


def test_fast_tier_long_prefix_loads_all() -> None:
    m = model(dram=(10_000 * MB, 0.0005))
    d = m.choose_blocks(["dram"] * 60, BLOCK_BYTES, BLOCK, prompt_tokens=1000)
    assert (d.blocks, d.load_tokens, d.kind) == (60, 960, "load_all")
    assert d.predicted_load_s == pytest.approx(60 * BLOCK_BYTES / 10e9 + 0.0005)
    assert d.predicted_ttft_s < d.recompute_ttft_s


def test_fast_head_slow_tail_loads_the_head_only() -> None:
    m = model(dram=(10_000 * MB, 0.0005), s3=(50 * MB, 0.030))
    d = m.choose_blocks(["dram"] * 4 + ["s3"] * 10, BLOCK_BYTES, BLOCK, prompt_tokens=400)
    assert (d.blocks, d.kind) == (4, "partial")


def test_a_block_aligned_prompt_leaves_its_last_block_to_compute() -> None:
    m = model(dram=(10_000 * MB, 0.0005))
    d = m.choose_blocks(["dram"] * 4, BLOCK_BYTES, BLOCK, prompt_tokens=64)
    assert (d.blocks, d.kind) == (3, "load_all")


def test_engine_local_blocks_are_not_loaded_again() -> None:
    m = model(dram=(10_000 * MB, 0.0005))
    d = m.choose_blocks(["dram"] * 10, BLOCK_BYTES, BLOCK, prompt_tokens=500, computed_tokens=64)
    assert (d.computed, d.blocks, d.load_blocks, d.load_tokens) == (4, 10, 6, 96)
    assert d.predicted_load_s == pytest.approx(6 * BLOCK_BYTES / 10e9 + 0.0005)


def test_unknown_tier_stops_the_run() -> None:
    m = model(dram=(10_000 * MB, 0.0005))
    d = m.choose_blocks(["dram", "dram", "tape", "dram"], BLOCK_BYTES, BLOCK, prompt_tokens=500)
    assert d.blocks == 2
    assert m.load_time(["dram", "tape"], BLOCK_BYTES) == float("inf")


def test_tier_names_are_normalised() -> None:
    assert tier_name("TIER_DRAM") == tier_name("DRAM") == tier_name("dram") == "dram"
    m = model(dram=(10_000 * MB, 0.0005))
    assert m.choose_blocks(["TIER_DRAM"] * 8, BLOCK_BYTES, BLOCK, prompt_tokens=500).blocks == 8


def test_per_block_sizes() -> None:
    m = model(ssd=(1000 * MB, 0.001))
    assert m.load_time(["ssd", "ssd"], [1000, 3000]) == pytest.approx(4000 / 1e9 + 0.001)


def test_observed_transfers_flip_the_decision() -> None:
    m = model(s3=(100 * MB, 0.030))
    assert m.choose_blocks(["s3"] * 2, BLOCK_BYTES, BLOCK, 100).blocks == 0
    # a measured load: 10 MB in 40 ms with 30 ms latency -> 1 GB/s
    m.observe_transfer({"s3": 10_000_000}, 0.040)
    assert m.tiers["s3"].bandwidth.value == pytest.approx(1e9)
    m.observe_latency("s3", 0.002)
    assert m.tiers["s3"].latency.value == pytest.approx(0.002)  # the first sample replaces the prior
    assert m.choose_blocks(["s3"] * 2, BLOCK_BYTES, BLOCK, 100).blocks == 2


def test_ewma_after_the_first_sample() -> None:
    m = model(dram=(10_000 * MB, 0.0))
    m.observe_transfer({"dram": 1_000_000}, 0.001)  # 1 GB/s replaces the prior
    m.observe_transfer({"dram": 2_000_000}, 0.001)  # 2 GB/s, alpha 0.2
    assert m.tiers["dram"].bandwidth.value == pytest.approx(1.2e9)


def test_mixed_transfer_is_split_by_predicted_share() -> None:
    m = model(dram=(1000 * MB, 0.0), ssd=(1000 * MB, 0.0))
    m.observe_transfer({"dram": 1_000_000, "ssd": 3_000_000}, 0.008)  # both at 0.5 GB/s
    assert m.tiers["dram"].bandwidth.value == pytest.approx(5e8)
    assert m.tiers["ssd"].bandwidth.value == pytest.approx(5e8)


def test_observed_prefill_updates_the_flop_rate() -> None:
    m = model(dram=(10_000 * MB, 0.0005))
    flops = SHAPE.prefill_flops(16, 84)
    m.observe_prefill(16, 84, flops / 2e11)
    assert m.current_flop_rate == pytest.approx(2e11)
    assert m.prefill_time(16, 84) == pytest.approx(flops / 2e11)


def test_snapshot_reports_decisions_and_actuals() -> None:
    m = model(dram=(10_000 * MB, 0.0005), s3=(100 * MB, 0.030))
    d1 = m.choose_blocks(["dram"] * 60, BLOCK_BYTES, BLOCK, 1000)
    m.choose_blocks(["s3"] * 2, BLOCK_BYTES, BLOCK, 100)
    m.observe_ttft(d1.id, d1.predicted_ttft_s * 2)
    snap = m.snapshot()
    json.dumps(snap)  # serialisable for /stats
    assert snap["decisions"] == {"recompute": 1, "partial": 0, "load_all": 1}
    assert [r["kind"] for r in snap["recent"]] == ["load_all", "recompute"]
    assert snap["recent"][0]["actual_ttft_s"] == pytest.approx(d1.predicted_ttft_s * 2)
    assert snap["recent"][1]["actual_ttft_s"] is None
    assert snap["mean_abs_rel_error"] == pytest.approx(0.5)
    assert set(snap["tiers"]) == {"dram", "s3"}


def test_history_is_bounded() -> None:
    m = CostModel(SHAPE, flop_rate=1e12, history=3)
    ids = [m.choose_blocks(["dram"], BLOCK_BYTES, BLOCK, 100).id for _ in range(5)]
    assert [r["id"] for r in m.snapshot()["recent"]] == ids[-3:]
    m.observe_ttft(ids[0], 1.0)  # forgotten: ignored
    assert m.snapshot()["mean_abs_rel_error"] is None


def test_calibration_measures_positive_rates() -> None:
    assert calibrate_flop_rate(n=64, repeats=1) > 0
    assert calibrate_memcpy_bandwidth(nbytes=1 << 20, repeats=1) > 0
    assert set(CostModel(SHAPE, flop_rate=1e12).tiers) == {"dram", "ssd", "redis", "s3"}
