"""Smoke test: ``benchmarks.directory_scale`` runs end to end with tiny sizes (two redis-servers
and two 3-master Redis Clusters, started by the benchmark itself) and returns its JSON shape,
the ghost phase's figures and ratios included. No timed assertions."""

from __future__ import annotations

import argparse
import json
import math

from benchmarks import directory_scale

TINY = ["--blocks", "2000", "--batch", "256", "--batch-sizes", "64,256", "--update-blocks", "512", "--repeat", "1",
        "--find-keys", "8", "--find-calls", "10", "--big-find-keys", "32", "--big-find-calls", "2",
        "--cluster-blocks", "1000", "--ghost-blocks", "600", "--ghost-share", "0.5", "--no-redis-benchmark"]
TAGS = ("redis", "cluster3")
GHOST_STEPS = ("ghost_publish", "ghost_remove")


def positive(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_directory_scale_bench_shape() -> None:
    p = argparse.ArgumentParser()
    directory_scale.add_arguments(p)
    result = json.loads(json.dumps(directory_scale.run(p.parse_args(TINY))))
    assert result["suite"] == "directory_scale"
    figures, ratios = result["figures"], result["ratios"]
    for tag in TAGS:
        assert positive(figures[f"{tag}_publish_records_per_s"]["value"])
        assert positive(ratios[f"{tag}_publish_vs_raw_redis"])
        for step in GHOST_STEPS:
            for side in ("", "_raw", "_plain"):
                assert figures[f"{tag}_{step}{side}_records_per_s"]["unit"] == "records/s"
                for figure in ("records_per_s", "server_us_per_record", "client_cpu_us_per_record"):
                    assert positive(figures[f"{tag}_{step}{side}_{figure}"]["value"]), (tag, step, side, figure)
            assert positive(ratios[f"{tag}_{step}_vs_raw_redis"]) and positive(ratios[f"{tag}_{step}_vs_plain"])
        # a g: key (58 B name, a small count, a TTL): more than its name, far less than a record's hash
        assert 58 < figures[f"{tag}_memory_usage_sampled_ghost_key"]["value"] < 400
        assert 58 < figures[f"{tag}_bytes_per_ghost_key"]["value"] < 1000
    assert "ghost phase 600 blocks, 0.5 with a ghost" in result["notes"]["workload"]
