"""Smoke test: ``benchmarks.lookup`` runs end to end with tiny sizes and returns its JSON shape
(including the blocking client over both transports). No timed assertions."""

from __future__ import annotations

import argparse
import json

from benchmarks import lookup


def test_lookup_bench_shape() -> None:
    p = argparse.ArgumentParser()
    lookup.add_arguments(p)
    result = lookup.run(p.parse_args(["--keys", "64", "--calls", "40", "--idle-calls", "2", "--idle-ms", "5"]))
    json.dumps(result)
    assert result["suite"] == "lookup"
    for name in ("lookup", "echo", "sync_grpc_lookup", "sync_local_lookup", "sync_grpc_lookup_idle", "sync_local_lookup_idle"):
        assert result["figures"][f"{name}_p50"]["unit"] == "ms" and result["figures"][f"{name}_p50"]["value"] > 0
    for ratio in ("lookup_p50_vs_echo", "lookup_local_p50_vs_echo", "local_vs_grpc_p50", "local_vs_grpc_idle_p50"):
        assert result["ratios"][ratio] > 0
