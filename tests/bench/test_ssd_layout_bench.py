"""Smoke test: ``benchmarks.ssd_layout`` runs end to end with few blocks and returns its JSON shape.
No timed assertions: the disk bytes it reports are checked against the layout instead (a 4 KiB
header page per block file, and what the filesystem allocates is never less than the file; the
segment layout's payload plus at least its 128-byte record a block, and less than the file layout)."""

from __future__ import annotations

import argparse
import json

from benchmarks import ssd_layout
from kvstore.tiers.ssd import file_bytes


def test_ssd_layout_bench_shape(tmp_path) -> None:
    p = argparse.ArgumentParser()
    ssd_layout.add_arguments(p)
    result = ssd_layout.run(p.parse_args(["--blocks", "200", "--sizes", "4096,16384", "--dir", str(tmp_path)]))
    json.dumps(result)
    assert result["suite"] == "ssd_layout" and result["notes"]["blocks"] == 200
    figures, ratios = result["figures"], result["ratios"]
    for size in (4096, 16384):
        per_block = figures[f"disk_bytes_per_block_{size}"]["value"]
        assert per_block >= file_bytes(size, ssd_layout.NS.label) == size + 4096
        assert ratios[f"payload_vs_disk_{size}"] == round(size / per_block, 4)
        assert figures[f"scan_us_per_block_{size}"]["value"] > 0 and figures[f"log_us_per_block_{size}"]["value"] > 0
        assert f"serve_restart_us_per_block_{size}" in figures
        segments = figures[f"disk_bytes_per_block_segments_{size}"]["value"]
        assert size + 128 <= segments < per_block
        assert ratios[f"payload_vs_disk_segments_{size}"] == round(size / segments, 4)
        assert figures[f"scan_us_per_block_segments_{size}"]["value"] > 0
        assert f"serve_restart_us_per_block_segments_{size}" in figures
