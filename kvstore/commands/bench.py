"""`kvstore bench SUITE [--json]`: benchmarks that report ratios against a raw baseline.

Every suite prints, as its last line, one JSON object: ``{"suite", "figures": {name: {"value",
"unit"}}, "ratios": {name: ours / baseline}}`` (higher is better; 1.0 = as good as the baseline).
Suites live in benchmarks/ (one module each, with ``add_arguments(parser)`` and ``run(args)``).
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.commands import Subparsers

SUITES = {
    "lookup": "benchmarks.lookup",
    "acquire": "benchmarks.acquire",
    "dram": "benchmarks.dram",
    "tiers": "benchmarks.tiers",
    "ttft": "benchmarks.ttft",
    "vllm": "benchmarks.vllm",
    "cluster": "benchmarks.cluster",
    "soak": "benchmarks.soak",
    "transfer": "benchmarks.transfer",
    "retention": "benchmarks.retention",
    "reload": "benchmarks.reload",
    "ssd_layout": "benchmarks.ssd_layout",
    "index": "benchmarks.index",
}


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark suite: " + ", ".join(SUITES),
        description="Run a benchmark suite. Suite options: `kvstore bench SUITE --help`.",
    )
    p.add_argument("suite", choices=sorted(SUITES), metavar="SUITE", help=", ".join(SUITES))
    p.add_argument("options", nargs=argparse.REMAINDER, help="options of the suite")
    p.set_defaults(func=run)


def suite_parser(name: str, module: object) -> argparse.ArgumentParser:
    """The suite's own parser, built only when that suite runs (suites import torch, vllm, ...)."""
    sp = argparse.ArgumentParser(prog=f"kvstore bench {name}", description=(module.__doc__ or "").strip())
    sp.add_argument("--json", action="store_true", help="print only the JSON result line")
    if hasattr(module, "add_arguments"):
        module.add_arguments(sp)
    return sp


def run(args: argparse.Namespace) -> int:
    from kvstore.util.tuning import tune_malloc

    tune_malloc()
    module = importlib.import_module(SUITES[args.suite])
    suite_args = suite_parser(args.suite, module).parse_args(args.options)
    result = module.run(suite_args)
    if not suite_args.json:
        print(format_table(result))
    print(json.dumps(result))
    return 0


def format_table(result: dict[str, Any]) -> str:
    lines = [f"suite: {result['suite']}"]
    for name, fig in result["figures"].items():
        lines.append(f"  {name:<40} {fig['value']:>14.4g} {fig['unit']}")
    lines.append("ratios (ours / raw baseline, higher is better):")
    for name, r in result["ratios"].items():
        lines.append(f"  {name:<40} {'n/a' if r is None else format(r, '.3f'):>14}")  # None: not measured here
    return "\n".join(lines)
