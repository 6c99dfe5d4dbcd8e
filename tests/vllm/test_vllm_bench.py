"""``kvstore bench vllm`` in small: the prefill -> decode configurations run as two processes each
(``kvstore_xhost``: on two test hosts, one sidecar each),
the decode instance's vLLM cache never holds the prompts (every repeat token it does not compute
comes from the connector), its outputs equal the no-connector run's, and the headline ratios are
in the JSON."""

from __future__ import annotations

import argparse

import pytest
from vllm_cases import stop_tqdm_monitors

from benchmarks import vllm as bench

pytestmark = pytest.mark.vllm


def test_prefill_decode_configurations_report_their_ratios() -> None:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--configs", "kvstore_pd,example_pd,kvstore_xhost", "--docs", "2", "--prefix-tokens", "96",
                         "--batch-rounds", "1", "--gap", "0"])
    try:
        r = bench.run(args)
    finally:
        stop_tqdm_monitors()  # the benchmark builds its model in this process
    notes, ratios = r["notes"], r["ratios"]
    assert sorted(notes["configs_run"]) == ["example_pd", "kvstore_pd", "kvstore_xhost", "none"]  # in finishing order
    assert ratios["outputs_match"] == 1.0
    assert {"ttft_pd_vs_best_peer", "throughput_pd_vs_best_peer", "ttft_xhost_vs_recompute"} <= set(ratios)
    for name in ("kvstore_pd", "example_pd", "kvstore_xhost"):
        # 2 prompts of 96 + 40 tokens: 4 full blocks each, all loaded, none from vLLM's own cache
        assert notes[f"{name}_repeat_tokens"] == {"external": 2 * 4 * 32, "local_hits": 0}
        assert notes[f"{name}_outputs_match"] is True
    decode, prefill = notes["kvstore_pd_connector_stats"], notes["kvstore_pd_prefill_connector_stats"]
    assert prefill["worker"]["saved_blocks"] > 0 and prefill["worker"].get("loads", 0) == 0
    assert decode["worker"].get("saves", 0) == 0 and decode["worker"]["loaded_blocks"] > 0
    assert decode["worker"]["failures"] == {}
    assert decode["scheduler"]["early_lookups"] > 0  # sent when vLLM added the request
    # across hosts: the decode host's repeat phase ran first, its blocks fetched from the prefill host
    cluster = notes["kvstore_xhost_cluster"]
    assert cluster["decode_host"]["blocks_fetched"] >= 2 * 4 and cluster["prefill_host"]["blocks_lent"] >= 2 * 4
    assert notes["kvstore_xhost_connector_stats"]["worker"]["failures"] == {}
