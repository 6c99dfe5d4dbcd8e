"""`kvstore bench SUITE [--json]`: benchmarks that report ratios against a raw baseline.

Every suite prints, as its last line, one JSON object: ``{"suite", "figures": {name: {"value",
"unit"}}, "ratios": {name: ours / baseline}}`` (higher is better; 1.0 = as good as the baseline).
Suites live in benchmarks/ (one module each, with ``add_arguments(parser)`` and ``run(args)``).
"""

from __future__ import annotations

import argparse
import importlib
import json

SUITES = {
    "lookup": "benchmarks.lookup",
    "dram": "benchmarks.dram",
    "tiers": "benchmarks.tiers",
    "ttft": "benchmarks.ttft",
    "vllm": "benchmarks.vllm",
}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run a benchmark suite: " + ", ".join(SUITES))
    suites = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, module in SUITES.items():
        sp = suites.add_parser(name, help=f"{module} (see benchmarks/)")
        sp.add_argument("--json", action="store_true", help="print only the JSON result line")
        sp.set_defaults(func=run, module=module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name not in (module, "benchmarks"):
                raise
            sp.set_defaults(missing=True)
            continue
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    from kvstore.tuning import tune_malloc

    tune_malloc()
    if getattr(args, "missing", False):
        print(f"kvstore bench: suite {args.suite!r} is not available in this installation")
        return 2
    result = importlib.import_module(args.module).run(args)
    if not args.json:
        print(format_table(result))
    print(json.dumps(result))
    return 0


def format_table(result: dict) -> str:
    lines = [f"suite: {result['suite']}"]
    for name, fig in result["figures"].items():
        lines.append(f"  {name:<40} {fig['value']:>14.4g} {fig['unit']}")
    lines.append("ratios (ours / raw baseline, higher is better):")
    for name, r in result["ratios"].items():
        lines.append(f"  {name:<40} {r:>14.3f}")
    return "\n".join(lines)
