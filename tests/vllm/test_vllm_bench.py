"""``kvstore bench vllm`` in small: the prefill -> decode configurations run as two processes each,
the decode instance's vLLM cache never holds the prompts (every repeat token it does not compute
comes from the connector), its outputs equal the no-connector run's, and the headline ratios are
in the JSON."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import vllm as bench

pytestmark = pytest.mark.vllm


def test_prefill_decode_configurations_report_their_ratios() -> None:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--configs", "kvstore_pd,example_pd", "--docs", "2", "--prefix-tokens", "96",
                         "--batch-rounds", "1", "--gap", "0"])
    r = bench.run(args)
    notes, ratios = r["notes"], r["ratios"]
    assert notes["configs_run"] == ["none", "kvstore_pd", "example_pd"]
    assert ratios["outputs_match"] == 1.0
    assert {"ttft_pd_vs_best_peer", "throughput_pd_vs_best_peer"} <= set(ratios)
    for name in ("kvstore_pd", "example_pd"):
        # 2 prompts of 96 + 40 tokens: 4 full blocks each, all loaded, none from vLLM's own cache
        assert notes[f"{name}_repeat_tokens"] == {"external": 2 * 4 * 32, "local_hits": 0}
        assert notes[f"{name}_outputs_match"] is True
    decode, prefill = notes["kvstore_pd_connector_stats"], notes["kvstore_pd_prefill_connector_stats"]
    assert prefill["worker"]["saved_blocks"] > 0 and prefill["worker"].get("loads", 0) == 0
    assert decode["worker"].get("saves", 0) == 0 and decode["worker"]["loaded_blocks"] > 0
    assert decode["worker"]["failures"] == {}
    assert decode["scheduler"]["early_lookups"] > 0  # sent when vLLM added the request
