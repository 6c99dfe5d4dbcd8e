"""The reload-or-recompute model makes the exact choices its formula implies, and its fits recover
known prefill and transfer costs from (synthetic) observations without being thrown by short or
slow samples."""

from __future__ import annotations

import json

import pytest

from connector.cost import (
    CostModel,
    ModelShape,
    TierRate,
    calibrate_flop_rate,
    calibrate_memcpy_bandwidth,
    calibrate_prefill,
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


def test_transfer_fit_latency_and_bandwidth_from_two_sizes() -> None:
    m = model(dram=(10_000 * MB, 0.0))
    m.observe_transfer({"dram": 1_000_000}, 0.002 + 1e6 / 500e6)  # one size: keeps the prior latency
    assert m.tiers["dram"].latency.value == 0.0
    m.observe_transfer({"dram": 16_000_000}, 0.002 + 16e6 / 500e6)
    assert m.tiers["dram"].latency.value == pytest.approx(0.002)
    assert m.tiers["dram"].bandwidth.value == pytest.approx(500e6)
    assert m.tiers["dram"].bandwidth.samples == 2


def test_many_small_loads_do_not_erase_the_large_ones() -> None:
    m = model(ssd=(1000 * MB, 0.001))
    for nb in (BLOCK_BYTES, 8 * BLOCK_BYTES, 64 * BLOCK_BYTES):
        m.observe_transfer({"ssd": nb}, 0.005 + nb / 200e6)
    for i in range(200):  # latency-dominated single-block loads, a little noisy
        m.observe_transfer({"ssd": BLOCK_BYTES}, (0.005 + BLOCK_BYTES / 200e6) * (1.1 if i % 2 else 0.9))
    big = 256 * BLOCK_BYTES
    assert m.tiers["ssd"].time(big) == pytest.approx(0.005 + big / 200e6, rel=0.05)


def test_mixed_transfer_is_split_by_predicted_share() -> None:
    m = model(dram=(1000 * MB, 0.0), ssd=(1000 * MB, 0.0))
    m.observe_transfer({"dram": 1_000_000, "ssd": 3_000_000}, 0.008)  # both at 0.5 GB/s
    assert m.tiers["dram"].bandwidth.value == pytest.approx(5e8)
    assert m.tiers["ssd"].bandwidth.value == pytest.approx(5e8)


def test_one_observed_prefill_scales_the_prior() -> None:
    m = model(dram=(10_000 * MB, 0.0005))
    flops = SHAPE.prefill_flops(16, 84)
    m.observe_prefill(16, 84, flops / 2e11)
    assert m.current_flop_rate == pytest.approx(2e11)
    assert m.prefill_time(16, 84) == pytest.approx(flops / 2e11)


SMALL = ModelShape(params=3_300_000, layers=4, q_heads=4, head_dim=64)  # the TTFT benchmark's model


def true_prefill(c: int, s: int) -> float:
    """A CPU-like prefill: 4 ms per forward, matmuls at 60 GFLOP/s, attention at 10 GFLOP/s."""
    return 0.004 + SMALL.matmul_flops(s) / 60e9 + SMALL.attention_flops(c, s) / 10e9


def fitted(lengths=(16, 128, 512, 2048), **kw) -> CostModel:
    m = CostModel(SMALL, flop_rate=1e10, tiers={n: TierRate.of(bw, lat) for n, (bw, lat) in kw.items()})
    calibrate_prefill(m, lambda n: true_prefill(0, n), lengths, repeats=1)
    return m


def test_prefill_fit_recovers_overhead_and_both_rates() -> None:
    m = fitted()
    p = m.snapshot()["prefill"]
    assert p["fit"] == "full" and p["samples"] == 4
    assert p["overhead_s"] == pytest.approx(0.004, rel=1e-3)
    assert p["matmul_flop_rate"] == pytest.approx(60e9, rel=1e-3)
    assert p["attention_flop_rate"] == pytest.approx(10e9, rel=1e-3)
    for c, s in ((0, 8192), (32, 8), (8176, 16)):  # extrapolated, and behind a cached prefix
        assert m.prefill_time(c, s) == pytest.approx(true_prefill(c, s), rel=1e-3)


def test_two_block_prompt_recomputes_when_a_forward_is_mostly_overhead() -> None:
    # the TTFT benchmark's 40-token prompt from DRAM: a load costs ~5 ms end to end, and the
    # forward over the 8 leftover tokens costs about as much as the one over all 40
    m = fitted(dram=(800 * MB, 0.005))
    d = m.choose_blocks(["dram"] * 2, 32 << 10, BLOCK, prompt_tokens=40)
    assert d.kind == "recompute"
    # ... while a pure FLOP-rate model, with no per-forward cost, loads them
    flat = CostModel(SMALL, flop_rate=SMALL.prefill_flops(0, 1024) / true_prefill(0, 1024),
                     tiers={"dram": TierRate.of(800 * MB, 0.005)})
    assert flat.choose_blocks(["dram"] * 2, 32 << 10, BLOCK, prompt_tokens=40).kind == "load_all"
    # and a long prompt still loads everything
    assert m.choose_blocks(["dram"] * 511, 32 << 10, BLOCK, prompt_tokens=8192).kind == "load_all"


def test_short_leftover_prefills_do_not_drag_the_long_prompt_estimate_down() -> None:
    m = fitted()
    before = m.prefill_time(0, 8192)
    for i in range(500):  # a decode-heavy stream: tiny forwards behind long prefixes, noisy
        m.observe_prefill(1000 + i, 1 + i % 8, true_prefill(1000 + i, 1 + i % 8) * (1.3 if i % 3 else 0.8))
    assert m.prefill_time(0, 8192) == pytest.approx(before, rel=0.1)
    assert m.prefill_time(0, 8192) == pytest.approx(true_prefill(0, 8192), rel=0.1)


def test_one_slow_outlier_barely_moves_the_fit() -> None:
    m = fitted(lengths=(16, 64, 128, 256, 512, 1024, 2048))
    m.observe_prefill(0, 4096, true_prefill(0, 4096) * 5)  # a neighbour took the core
    assert m.prefill_time(0, 4096) == pytest.approx(true_prefill(0, 4096), rel=0.1)


def test_two_sizes_fit_overhead_and_a_scaled_prior() -> None:
    m = CostModel(SMALL, flop_rate=1e10)
    for s in (16, 1024):
        m.observe_prefill(0, s, 0.002 + SMALL.prefill_flops(0, s) / 2e10)
    p = m.snapshot()["prefill"]
    assert p["fit"] == "overhead+scale"
    assert p["overhead_s"] == pytest.approx(0.002, rel=1e-3)
    assert p["matmul_flop_rate"] == pytest.approx(2e10, rel=1e-3)


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
    assert set(CostModel(SHAPE, flop_rate=1e12).tiers) == {"dram", "ssd", "redis", "s3", "peer"}


def test_small_loads_alone_fit_the_latency_not_a_bandwidth() -> None:
    m = model(dram=(1000 * MB, 0.001))
    for nb in (BLOCK_BYTES // 16, BLOCK_BYTES // 4):  # both ~5 ms: latency, bandwidth unidentifiable
        m.observe_transfer({"dram": nb}, 0.005)
    assert m.tiers["dram"].bandwidth.value == pytest.approx(1e9)  # the prior
    assert m.tiers["dram"].latency.value == pytest.approx(0.005, rel=0.1)
