"""One line of `scripts/gpu-check`'s results: the tests' outcome, each key ratio's worst shape, the demo.

    python3 scripts/gpu_summary.py OUT_DIR

reads OUT_DIR/gpu-tests.log, bench-transfer.json and demo-cuda.json (what a step did not write
reads "n/a") and prints, e.g.::

    gpu-check: tests 14 passed | gather/DMA 0.97 (qwen25_05b) | scatter/DMA ... | reload/recompute@4096 14.1 | demo ok

A ratio's figure is its lowest over the shapes, with that shape named (1 is the raw DMA's rate;
one block >= 1 means within 30 µs of its bytes at the raw rate).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

KEYS = (("gather_vs_pcie", "gather/DMA"), ("scatter_vs_pcie", "scatter/DMA"), ("both_ways_vs_pcie", "both ways/DMA"),
        ("one_block_vs_raw_plus_30us", "one block/(raw+30us)"))


def _json(path: Path) -> dict[str, Any]:
    try:
        out: dict[str, Any] = json.loads(path.read_text().strip().splitlines()[-1])
        return out
    except (OSError, ValueError, IndexError):
        return {}


def summary(out: Path) -> str:
    parts = []
    try:
        tail = [ln for ln in (out / "gpu-tests.log").read_text().splitlines() if ln.strip()][-1]
        parts.append("tests " + tail.strip("= ").split(" in ")[0])
    except (OSError, IndexError):
        parts.append("tests n/a")
    ratios: dict[str, float] = _json(out / "bench-transfer.json").get("ratios", {})
    for key, label in KEYS:
        found = {name[: -len(key) - 1]: v for name, v in ratios.items() if name.endswith("_" + key)}
        if found:
            shape = min(found, key=lambda s: found[s])
            parts.append(f"{label} {found[shape]:.2f} ({shape})")
        else:
            parts.append(f"{label} n/a")
    reload = ratios.get("reload_vs_recompute_4096")
    parts.append(f"reload/recompute@4096 {reload:.1f}" if reload is not None else "reload/recompute@4096 n/a")
    demo = _json(out / "demo-cuda.json")
    parts.append("demo n/a" if not demo else f"demo {'ok' if demo.get('ok') else 'FAILED'}")
    return "gpu-check: " + " | ".join(parts)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
