"""Smoke test: ``benchmarks.acquire`` runs end to end with tiny sizes and returns its JSON shape
(the connector's Acquire + Release beside two Echoes over the same pipeline, and the in-process
handler figures). No timed assertions."""

from __future__ import annotations

import argparse
import json

from benchmarks import acquire


def test_acquire_bench_shape() -> None:
    p = argparse.ArgumentParser()
    acquire.add_arguments(p)
    argv = ["--blocks", "4", "--block-bytes", "4096", "--requests", "2", "--calls", "8", "--rounds", "2",
            "--inproc-calls", "8"]
    result = acquire.run(p.parse_args(argv))
    json.dumps(result)
    assert result["suite"] == "acquire"
    figures = result["figures"]
    for name in ("echo", "acquire"):
        assert figures[f"{name}_p50"]["unit"] == "ms" and figures[f"{name}_p50"]["value"] > 0
        assert figures[f"{name}_client_cpu"]["value"] > 0
        assert figures[f"{name}_sidecar_cpu"]["unit"] == "ms/hit"
    for name in ("acquire", "acquire_blocks", "release", "echo"):
        assert figures[f"inproc_{name}"]["value"] > 0
    assert figures["hits_per_series"]["value"] == 16
    for ratio in ("acquire_p50_vs_echo", "acquire_client_cpu_vs_echo", "inproc_acquire_packed_vs_blocks"):
        assert result["ratios"][ratio] > 0


def test_prompts_differ() -> None:
    keys = acquire.prompts(3, 4)
    assert len({tuple(k) for k in keys}) == 4 and all(len(k) == 3 for k in keys)
