"""`kvstore stats`: hit rates and tier occupancy of a running sidecar."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.commands import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("stats", help="print hit rates of a running sidecar")
    p.add_argument("--url", default="grpc://127.0.0.1:50051", help="sidecar gRPC address")
    p.add_argument("--token", default="", help="bearer token, if the sidecar requires one")
    p.add_argument("--json", action="store_true", help="print the raw /stats document")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    p.set_defaults(func=run)


async def fetch(url: str, token: str) -> dict[str, Any]:
    from kvstore.client import KVStoreClient

    async with KVStoreClient.from_url(url, token=token) as c:
        return await c.stats()


def _pct(x: float) -> str:
    return f"{100 * x:6.2f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def seconds(s: float) -> str:
    """A latency as `kvstore stats` and the dashboard page show it: in µs, ms or s, with 2
    decimals under 10, 1 under 100, none above."""
    v, unit = (s, "s") if s >= 1 else (s * 1e3, "ms") if s >= 1e-3 else (s * 1e6, "µs")
    return f"{_fixed(v, 2 if v < 10 else 1 if v < 100 else 0)} {unit}"


def _fixed(v: float, places: int) -> str:
    """``v`` with ``places`` decimals as the page's JavaScript ``toFixed`` writes it: the exact
    binary value, a tie rounded up (Python's format rounds a tie to even: 162.5 -> "162", the
    page "163")."""
    return f"{Decimal(v).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP):.{places}f}"


def latency_rows(doc: dict[str, Any]) -> list[tuple[str, str, int, float, float]]:
    """(family, labels, calls, p50 s, p99 s) of every latency series observed at least once."""
    out = []
    for family, series in doc.get("latency", {}).items():
        if family == "bounds_s":
            continue
        for r in series:
            if r["count"]:
                labels = " ".join(str(v) for k, v in r.items() if k not in LATENCY_FIELDS)
                out.append((family, labels, r["count"], r["p50_s"], r["p99_s"]))
    return out


LATENCY_FIELDS = ("count", "sum_s", "p50_s", "p99_s", "buckets")


def render(doc: dict[str, Any]) -> str:
    lk = doc["lookups"]
    lines = [
        f"lookups {lk['calls']}   blocks requested {lk['blocks_requested']}   hit {lk['blocks_hit']}   "
        f"hit rate {_pct(lk['hit_rate'])}",
        "",
        f"{'tier':<6} {'hit rate':>9} {'hits':>9} {'used':>11} {'capacity':>11} {'evict':>7} {'demote':>7} "
        f"{'promote':>7} {'errors':>7} {'bad sum':>7}",
    ]
    for name, t in doc["tiers"].items():
        if not t.get("enabled"):
            continue
        lines.append(
            f"{name:<6} {_pct(doc['hit_rate_by_tier'][name]):>9} {t['hits']:>9} {_bytes(t.get('used_bytes', 0)):>11} "
            f"{_bytes(t.get('capacity_bytes', 0)):>11} {t['evictions']:>7} {t['demotions']:>7} {t['promotions']:>7} "
            f"{t['errors']:>7} {t['checksum_failures']:>7}"
        )
    if doc["namespaces"]:
        lines += ["", f"{'namespace':<40} {'lookups':>8} {'requested':>10} {'hit':>8} {'hit rate':>9}"]
        for label, c in doc["namespaces"].items():
            lines.append(f"{label[:40]:<40} {c['calls']:>8} {c['blocks_requested']:>10} {c['blocks_hit']:>8} "
                         f"{_pct(c['hit_rate']):>9}")
    latencies = latency_rows(doc)
    if latencies:
        lines += ["", f"{'latency':<14} {'labels':<34} {'calls':>8} {'p50':>9} {'p99':>9}"]
        for family, labels, n, p50, p99 in latencies:
            lines.append(f"{family:<14} {labels[:34]:<34} {n:>8} {seconds(p50):>9} {seconds(p99):>9}")
    d = doc["decisions"]["counts"]
    if d:
        lines += ["", "reload-vs-recompute decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(d.items()))]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    while True:
        doc = asyncio.run(fetch(args.url, args.token))
        if args.json:
            print(json.dumps(doc, indent=None if args.watch else 2), flush=True)
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print(render(doc), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)
