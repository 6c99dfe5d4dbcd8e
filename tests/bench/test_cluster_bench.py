"""Smoke test: ``benchmarks.cluster`` runs end to end with tiny sizes (three test hosts, the
directory on their bridge, three sidecars, one fetching encrypted, every baseline) and returns its
JSON shape; whatever it started is gone afterwards, on error too. No timed assertions. Needs
root, as CI has (test hosts)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess

import pytest

from benchmarks import cluster

TINY = ["--blocks", "4", "--block-bytes", "65536", "--rounds", "1", "--records", "64", "--lookups", "4",
        "--lookup-keys", "4"]
FETCHES = ("peer_fetch", "peer_fetch_encrypted", "raw_tcp", "grpc_stream")
FIGURES = (
    *(f"{side}_{tag}" for side in FETCHES for tag in ("GBps", "GBps_best", "round_ms_p50", "round_ms_best")),
    "publish_records_per_s", "publish_records_per_s_best", "raw_redis_records_per_s", "raw_redis_records_per_s_best",
    "local_lookup_p50", "local_lookup_p99", "remote_lookup_p50", "remote_lookup_p99",
)
RATIOS = (
    "peer_fetch_vs_raw_tcp", "peer_fetch_vs_raw_tcp_best", "grpc_stream_vs_raw_tcp", "grpc_stream_vs_raw_tcp_best",
    "publish_vs_raw_redis", "publish_vs_raw_redis_best", "remote_lookup_p50_vs_local",
    "peer_fetch_encrypted_vs_clear", "peer_fetch_encrypted_vs_clear_best", "peer_fetch_encrypted_vs_raw_tcp",
)


def args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cluster.add_arguments(p)
    return p.parse_args(argv)


def positive(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith(f"kvs{os.getpid()}")]


def test_cluster_bench_shape() -> None:
    result = cluster.run(args(TINY))
    result = json.loads(json.dumps(result))
    assert result["suite"] == "cluster"
    figures, ratios = result["figures"], result["ratios"]
    for name in FIGURES:
        assert positive(figures[name]["value"]), name
    assert figures["peer_fetch_GBps"]["unit"] == "GB/s" and figures["remote_lookup_p50"]["unit"] == "ms"
    assert all(positive(f["value"]) for f in figures.values())
    for name in RATIOS:
        assert positive(ratios[name]), name
    assert "peer_fetch_vs_mooncake" in ratios
    if ratios["peer_fetch_vs_mooncake"] is None:  # not importable here: the note says why
        assert result["notes"]["mooncake"] and "mooncake_GBps" not in figures
    else:
        assert positive(ratios["peer_fetch_vs_mooncake"]) and positive(figures["mooncake_GBps"]["value"])
    assert result["notes"]["remote_lookup_tiers"] == ["peer"]  # B's answers came from the directory
    assert result["notes"]["b_cluster_counters"]["blocks_fetched"] == 2 * 4  # warm-up + 1 round, 4 blocks each
    assert figures["blocks_per_fetch"]["value"] == 4 and figures["lookups_per_sidecar"]["value"] == 4
    assert our_namespaces() == []


def test_a_failure_mid_run_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[cluster.Bench] = []

    def fail(self: cluster.Bench) -> None:
        started.append(self)
        raise RuntimeError("failed on purpose")

    monkeypatch.setattr(cluster.Bench, "lookup_rounds", fail)
    with pytest.raises(RuntimeError, match="on purpose"):
        cluster.run(args(TINY))
    (bench,) = started
    procs = [bench.a.proc, bench.b.proc, bench.holder.proc, bench.fetcher.proc, bench.redis.proc]
    assert all(p is None or p.poll() is not None for p in procs)
    assert our_namespaces() == []


def test_without_root_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root"):
        cluster.run(args(TINY))
