"""Smoke test: ``kvstore bench index`` runs end to end on few blocks and returns its JSON shape.
No timed assertions: the disk bytes are checked against each layout instead (segments: the
payload, one 128-byte record and a share of a frame header; files: a header page a block more)."""

from __future__ import annotations

import argparse
import json

from benchmarks import index


def test_index_bench_shape(tmp_path) -> None:
    p = argparse.ArgumentParser()
    index.add_arguments(p)
    args = ["--counts", "640", "--files-counts", "640", "--block-bytes", "16384", "--dir", str(tmp_path)]
    result = index.run(p.parse_args(args))
    json.dumps(result)
    assert result["suite"] == "index" and result["notes"]["block_bytes"] == 16384
    figures, ratios = result["figures"], result["ratios"]
    segments = figures["disk_bytes_per_block_segments_640"]["value"]
    assert 16384 <= segments <= 16384 * 1.02  # (640 blocks also carry the directories and small files: ~20 KiB)
    assert figures["disk_bytes_per_block_files_640"]["value"] >= 16384 + 4096
    for layout in ("segments", "files"):
        for name in ("puts_per_s", "lookup_p50_us", "lookup_p99_us", "restart_s", "serve_restart_s"):
            assert f"{name}_{layout}_640" in figures
        for name in ("puts_vs_raw", "lookup_p50_vs_raw", "restart_vs_raw", "payload_vs_disk"):
            assert ratios[f"{name}_{layout}_640"] > 0
    assert figures["tier_index_bytes_per_block_segments_640"]["value"] > 128
    for name in ("load_s", "load_cpu_us_per_block", "load_rss_per_block_B", "serve_recovered_cpu_us_per_block",
                 "lookup_cpu_p50_us", "lookup_cpu_p99_us", "books_lookup_p50_us", "books_lookup_p99_us",
                 "books_lookup_cpu_p50_us", "books_lookup_touch_cpu_p50_us"):
        assert f"{name}_segments_640" in figures
    assert figures["books_lookup_cpu_p50_us_segments_640"]["value"] > 0
    assert figures["books_lookup_touch_cpu_p99_us_segments_640"]["value"] > 0
    assert figures["load_cpu_us_per_block_segments_640"]["value"] > 0


def test_index_bench_log_only_shape(tmp_path) -> None:
    """``--log-only``: the log written alone, a restart and a full load find every block on it
    (the bench asserts the counts), no puts or serve figures."""
    p = argparse.ArgumentParser()
    index.add_arguments(p)
    result = index.run(p.parse_args(["--counts", "3000", "--log-only", "--dir", str(tmp_path)]))
    json.dumps(result)
    figures = result["figures"]
    for name in ("restart_s", "restart_open_cpu_s", "load_cpu_us_per_block", "load_rss_per_block_B",
                 "lookup_p50_us", "lookup_p99_us", "lookup_cpu_p50_us", "lookup_cpu_p99_us",
                 "tier_index_bytes_per_block", "books_lookup_p50_us", "books_lookup_p99_us",
                 "books_lookup_cpu_p50_us", "books_lookup_cpu_p99_us", "books_lookup_touch_cpu_p50_us",
                 "books_lookup_touch_cpu_p99_us"):
        assert f"{name}_segments_3000" in figures
    assert figures["books_lookup_cpu_p99_us_segments_3000"]["value"] > 0
    assert not any(k.startswith(("puts_per_s", "serve_", "disk_bytes")) for k in figures)
    assert "log_only" in result["notes"]
