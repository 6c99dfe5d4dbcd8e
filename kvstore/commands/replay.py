"""`kvstore replay TRACE`: prefix hit rates of eviction policies on a trace, beside Belady's bound.

    kvstore replay data/traces/conversation_trace.jsonl.gz --capacity 5% --policy lru --policy credit
    kvstore replay TRACE --capacity 1% --capacity 5% --capacity 25% --plot hit.png --json
    kvstore replay TRACE --tier dram=5% --tier ssd=20%
    kvstore replay TRACE --nodes 8 --capacity 1% --routing round-robin --routing prefix --json
    kvstore replay TRACE --capacity 1% --hints continuation:60 --json

TRACE is Mooncake-format JSONL, plain or gzip-compressed; the Mooncake traces ship in
``data/traces/`` of the repository. The last line of ``--json`` output is one JSON object per
capacity (one line each). With ``--nodes N`` the capacity is each node's (default 1%; with
``--capacity-total`` the cluster's, split evenly over the nodes), and each object holds, per
policy, the global cache of N x the capacity and, per routing, the isolated nodes, the cluster,
``cluster_vs_isolated``, ``cluster_vs_global`` and the load imbalance
(:mod:`kvstore.sim.cluster`, docs/cluster.md). With ``--hints``, every policy (and with ``--nodes``
every mode) is replayed without and with the retention hints the trace implies
(:mod:`kvstore.sim.hints`): the hinted run's result is under ``hints`` and the ratio of prefix hit
rates under ``hints_vs_none`` (docs/eviction.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.commands import Subparsers
    from kvstore.sim.hints import Hints
    from kvstore.sim.replay import TierSpec
    from kvstore.sim.traces import Trace


def _capacity(text: str) -> tuple[str, float]:
    t = text.strip()
    try:
        if t.endswith("%"):
            return ("frac", float(t[:-1]) / 100.0)
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capacity {text!r}: want a fraction (0.05), a percentage (5%) or a block count"
        ) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"capacity {text!r} must be positive")
    return ("frac", v) if v < 1 else ("blocks", v)


def _tier(text: str) -> tuple[str, tuple[str, float]]:
    name, sep, cap = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"tier {text!r}: want NAME=CAPACITY, e.g. dram=5%")
    return name.strip().upper(), _capacity(cap)


def register(subparsers: Subparsers) -> None:
    from kvstore.policy import DEFAULT_POLICY, policy_names
    from kvstore.routing import ROUTINGS

    p = subparsers.add_parser("replay", help="replay a prefix-cache trace through the index and eviction policies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="Mooncake-format JSONL, plain or .jsonl.gz (timestamp, input_length, output_length, "
                                 "hash_ids)")
    p.add_argument("--capacity", action="append", type=_capacity, metavar="CAP",
                   help="cache size: a fraction (0.05) or percentage (5%%) of the trace's unique blocks, or a block "
                        "count; repeatable (default 5%%)")
    p.add_argument("--tier", action="append", type=_tier, metavar="NAME=CAP",
                   help="per-tier capacities, top tier first (dram=5%%, ssd=20%%); replaces --capacity")
    p.add_argument("--policy", action="append", metavar="NAME",
                   help=f"policy to replay, repeatable; one of {policy_names()} or 'all' "
                        f"(default: lru and {DEFAULT_POLICY})")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per block in the trace (default 512)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per capacity (last line: the last capacity)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot prefix hit rate against capacity for every policy, with the bound")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--nodes", type=_nodes, metavar="N",
                   help="cluster replay over N nodes, --capacity each (default 1%%): isolated nodes, the cluster "
                        "(directory + peer fetch) and one global cache of N x the capacity")
    p.add_argument("--capacity-total", action="store_true",
                   help="with --nodes: each --capacity is the cluster's total, split evenly over the nodes (each "
                        "node gets CAP / N, rounded down) instead of each node's")
    p.add_argument("--routing", action="append", choices=ROUTINGS,
                   help="with --nodes: how requests reach nodes, repeatable (default: round-robin and prefix)")
    p.add_argument("--seed", type=int, default=0, help="with --routing random: the seed (default 0)")
    p.add_argument("--tie-seed", type=int, metavar="N",
                   help="with --routing prefix: break each tie of score and load by a seeded random draw "
                        "instead of by node index (another, equally valid draw of the same routing)")
    p.add_argument("--ghost-ttl", type=float, default=None, metavar="S",
                   help="with --nodes: how long the cluster's ghost (use counts the directory keeps for the next "
                        "node to store a block) keeps each, in the trace's seconds; 0: none (default: the "
                        "sidecar's cluster.ghost_ttl_s)")
    p.add_argument("--hints", metavar="KIND[:SECONDS]",
                   help="also replay with retention hints: 'continuation' retains a request's blocks for SECONDS "
                        "(default 60) when a later request continues it; 'until-continued' also ends the retention "
                        "once that request is served, where it is served (the connectors' hint of 0), "
                        "'until-returned' when it arrives, where the earlier one was served (docs/eviction.md)")
    p.add_argument("--retained-fraction", type=float, metavar="F",
                   help="with --hints: the replayed sidecar's tenants.retained_fraction, the share of each cache that "
                        "hints may hold together (default: the sidecar's default; 1: hints may hold it all)")
    p.add_argument("--adaptive-share", action=argparse.BooleanOptionalAction, default=None,
                   help="with --hints: the replayed sidecar's tenants.retained_adaptive (the share for hints scaled "
                        "per node by what its hints were worth; default: the sidecar's default, on)")
    p.set_defaults(func=run)


def _blocks(cap: tuple[str, float], unique: int) -> int:
    kind, v = cap
    return max(0, int(v * unique)) if kind == "frac" else int(v)


def run(args: argparse.Namespace) -> int:
    from kvstore.sim.hints import parse_hints
    from kvstore.sim.traces import load_trace

    hints = parse_hints(args.hints) if args.hints else None
    if args.retained_fraction is not None:
        from dataclasses import replace

        from kvstore.errors import InvalidArgument

        if hints is None or not 0.0 <= args.retained_fraction <= 1.0:
            raise InvalidArgument(f"--retained-fraction: a share in 0..1 with --hints, got {args.retained_fraction}")
        hints = replace(hints, retained_fraction=args.retained_fraction)
    if args.adaptive_share is not None:
        from dataclasses import replace

        from kvstore.errors import InvalidArgument

        if hints is None:
            raise InvalidArgument("--adaptive-share: with --hints")
        hints = replace(hints, adaptive=args.adaptive_share)
    trace = load_trace(args.trace, args.block_tokens)
    unique = trace.unique_blocks()
    names = _policy_names(args.policy)
    progress = not args.no_progress and sys.stderr.isatty() and trace.references > 200_000
    if args.nodes is not None:
        return _run_cluster(args, trace, unique, names, progress, hints)
    if args.capacity_total:
        from kvstore.errors import InvalidArgument

        raise InvalidArgument("--capacity-total: for the cluster replay (--nodes N)")
    key_lists = [r.keys for r in trace.requests]
    plot_rows: list[tuple[int, dict[str, float], float]] = []
    for specs in _tier_specs(args, unique):
        out, bound = _replay_size(trace, unique, key_lists, specs, names, progress, hints)
        plot_rows.append((out["capacity_blocks"], {n: out["policies"][n]["prefix_hit_rate"] for n in names}, bound))
        if args.json:
            print(json.dumps(out), flush=True)
        else:
            _print_table(out)
    if args.plot:
        _plot(args.plot, trace.name, unique, names, plot_rows)
    return 0


def _policy_names(asked: list[str] | None) -> list[str]:
    """The policies to replay, each once: those asked (every one for 'all'), by default lru and the
    default policy; an unknown name is an error."""
    from kvstore.errors import InvalidArgument
    from kvstore.policy import DEFAULT_POLICY, policy_names

    names = asked or ["lru", DEFAULT_POLICY]
    if "all" in names:
        names = policy_names()
    names = list(dict.fromkeys(names))
    for n in names:
        if n not in policy_names():
            raise InvalidArgument(f"--policy: unknown policy {n!r}; allowed: {policy_names()}")
    return names


def _tier_specs(args: argparse.Namespace, unique: int) -> list[list[TierSpec]]:
    """The caches to replay: the tiers of ``--tier`` as one cache, else one DRAM cache per
    ``--capacity`` (default 5%)."""
    from kvstore.errors import InvalidArgument
    from kvstore.sim.replay import TierSpec
    from kvstore.store.books.index import TierId

    if not args.tier:
        return [[TierSpec(TierId.DRAM, _blocks(cap, unique))] for cap in args.capacity or [("frac", 0.05)]]
    specs = []
    for name, cap in args.tier:
        try:
            tier = TierId[name]
        except KeyError:
            allowed = [t.label for t in TierId]
            raise InvalidArgument(f"--tier: unknown tier {name!r}; allowed: {allowed}") from None
        specs.append(TierSpec(tier, _blocks(cap, unique)))
    return [specs]


def _replay_size(trace: Trace, unique: int, key_lists: list[tuple[int, ...]], specs: list[TierSpec],
                 names: list[str], progress: bool, hints: Hints | None) -> tuple[dict[str, Any], float]:
    """One cache (``specs``) replayed under every policy, beside Belady's bound at its total
    capacity: the JSON object printed for it, and the bound's prefix hit rate (unrounded)."""
    from kvstore.policy import DEFAULT_POLICY
    from kvstore.sim.belady import belady
    from kvstore.sim.replay import replay

    total = sum(s.capacity for s in specs)
    bound = belady(key_lists, total)
    out: dict[str, Any] = {
        "trace": trace.name,
        "unique_blocks": unique,
        "references": trace.references,
        "capacity_blocks": total,
        "default_policy": DEFAULT_POLICY,
        "policies": {},
        "belady": {"prefix_hit_rate": round(bound.prefix_hit_rate, 6),
                   "block_hit_rate": round(bound.block_hit_rate, 6)},
    }
    if len(specs) > 1:
        out["tiers"] = {s.tier.label: s.capacity for s in specs}
    for n in names:
        res = replay(trace, specs, n, progress=progress)
        out["policies"][n] = res.to_json()
        if hints is not None:
            out["retained_fraction"], out["retained_adaptive"] = hints.retained_fraction, hints.adaptive
            hinted = replay(trace, specs, n, progress=progress, hints=hints)
            out["policies"][n]["hints"] = hinted.to_json()
            out["policies"][n]["hints_vs_none"] = _ratio(hinted.prefix_hit_rate, res.prefix_hit_rate)
    return out, bound.prefix_hit_rate


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _nodes(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"nodes {text!r}: want a whole number of nodes") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"nodes {text!r} must be at least 1")
    return n


def _run_cluster(args: argparse.Namespace, trace: Trace, unique: int, names: list[str], progress: bool,
                 hints: Hints | None = None) -> int:
    """``--nodes N``: one JSON object per capacity (per node), every policy and routing in it."""
    from kvstore.errors import InvalidArgument
    from kvstore.sim.cluster import GHOST_TTL_S, compare

    if args.tier or args.plot:
        raise InvalidArgument("--nodes: --tier and --plot are for the single-cache replay; use --capacity")
    routings = list(dict.fromkeys(args.routing or ["round-robin", "prefix"]))
    ghost = GHOST_TTL_S if args.ghost_ttl is None else args.ghost_ttl
    if ghost < 0 or not math.isfinite(ghost):
        raise InvalidArgument(f"--ghost-ttl: a finite number of seconds >= 0, got {ghost}")
    for cap in args.capacity or [("frac", 0.01)]:
        per_node = _node_blocks(cap, unique, args.nodes, args.capacity_total)
        policies: dict[str, Any] = {}
        out = {"trace": trace.name, "unique_blocks": unique, "references": trace.references, "nodes": args.nodes,
               "capacity_blocks": per_node, "capacity_total_blocks": per_node * args.nodes,
               "capacity_of": "cluster" if args.capacity_total else "node", "tie_seed": args.tie_seed,
               "ghost_ttl_s": ghost, "policies": policies}
        for n in names:
            policies[n] = compare(trace, args.nodes, per_node, routings, n, args.seed, progress=progress,
                                  tie_seed=args.tie_seed, ghost_ttl_s=ghost)
            if hints is not None:
                out["retained_fraction"], out["retained_adaptive"] = hints.retained_fraction, hints.adaptive
                hinted = compare(trace, args.nodes, per_node, routings, n, args.seed, progress=progress,
                                 tie_seed=args.tie_seed, ghost_ttl_s=ghost, hints=hints)
                policies[n]["hints"] = hinted
                policies[n]["hints_vs_none"] = _cluster_ratios(policies[n], hinted)
        if args.json:
            print(json.dumps(out), flush=True)
        else:
            _print_cluster(out)
    return 0


def _node_blocks(cap: tuple[str, float], unique: int, nodes: int, total: bool) -> int:
    """Each node's blocks for ``--capacity CAP``: CAP itself, or with ``--capacity-total`` CAP split
    over ``nodes`` (rounded down, so the cluster holds at most CAP)."""
    if not total:
        return _blocks(cap, unique)
    kind, v = cap
    return max(0, int(v * unique / nodes)) if kind == "frac" else int(v) // nodes


def _cluster_ratios(plain: dict[str, Any], hinted: dict[str, Any]) -> dict[str, Any]:
    """``hints_vs_none`` of a cluster replay: per mode (and routing), hinted over plain prefix hit rate."""
    def rate(d: dict[str, Any]) -> float:
        return float(d["prefix_hit_rate"])

    out: dict[str, Any] = {"global": _ratio(rate(hinted["global"]), rate(plain["global"]))}
    for routing, r in plain["routing"].items():
        h = hinted["routing"][routing]
        out[routing] = {m: _ratio(rate(h[m]), rate(r[m])) for m in ("isolated", "cluster")}
    return out


def _print_cluster(out: dict[str, Any]) -> None:
    cap, unique = out["capacity_blocks"], out["unique_blocks"]
    print(f"{out['trace']}: {out['references']:,} references, {unique:,} unique blocks; {out['nodes']} nodes x "
          f"{cap:,} blocks ({cap / max(unique, 1):.3%} each, {out['capacity_total_blocks'] / max(unique, 1):.2%} "
          f"in all)")
    print(f"  {'policy':<8} {'routing':<12} {'isolated':>9} {'cluster':>9} {'(peer)':>8} {'global':>8} "
          f"{'x isol.':>8} {'x global':>8} {'busiest/mean':>12}")
    for name, pol in out["policies"].items():
        glob = pol["global"]["prefix_hit_rate"]
        for routing, r in pol["routing"].items():
            ratios = [f"{r[k]:>8.2f}" if r[k] is not None else f"{'-':>8}" for k in ("cluster_vs_isolated",
                                                                                     "cluster_vs_global")]
            print(f"  {name:<8} {routing:<12} {r['isolated']['prefix_hit_rate']:>9.4f} "
                  f"{r['cluster']['prefix_hit_rate']:>9.4f} {r['cluster']['peer_hit_rate']:>8.4f} {glob:>8.4f} "
                  f"{' '.join(ratios)} {r['imbalance']:>12.3f}")


def _print_table(out: dict[str, Any]) -> None:
    cap = out["capacity_blocks"]
    print(f"{out['trace']}: {out['references']:,} references, {out['unique_blocks']:,} unique blocks, "
          f"capacity {cap:,} blocks ({cap / max(out['unique_blocks'], 1):.1%})")
    lru = out["policies"].get("lru", {}).get("prefix_hit_rate")
    bound = out["belady"]["prefix_hit_rate"]
    print(f"  {'policy':<10} {'prefix hit':>10} {'block hit':>10} {'x LRU':>7} {'x bound':>8} {'refs/s':>9}")
    for n, r in out["policies"].items():
        ph = r["prefix_hit_rate"]
        xl = f"{ph / lru:.2f}" if lru else "-"
        xb = f"{ph / bound:.2f}" if bound else "-"
        tag = " (default)" if n == out["default_policy"] else ""
        print(f"  {n:<10} {ph:>10.4f} {r['block_hit_rate']:>10.4f} {xl:>7} {xb:>8} {r['refs_per_s']:>9,}{tag}")
        for t, tr in r.get("tiers", {}).items():
            print(f"    {t:<8} {tr['prefix_hit_rate']:>10.4f}")
        if "hints" in r:
            h = r["hints"]
            print(f"    hints {h['hints']:<14} {h['prefix_hit_rate']:.4f} ({r['hints_vs_none']}x), "
                  f"{h['retained_peak_blocks']:,} blocks retained at peak")
    print(f"  {'belady':<10} {bound:>10.4f} {out['belady']['block_hit_rate']:>10.4f}   (offline bound)")


def _plot(path: str, trace: str, unique: int, names: list[str],
          rows: list[tuple[int, dict[str, float], float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows)
    xs = [100.0 * c / max(unique, 1) for c, _, _ in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(xs, [b for _, _, b in rows], "k--", marker="o", label="Belady (bound)")
    for n in names:
        style: dict[str, Any] = {"color": "tab:gray"} if n == "lru" else {}
        ax.plot(xs, [r[n] for _, r, _ in rows], marker="o", label=n, **style)
    ax.set_xlabel("capacity (% of unique blocks)")
    ax.set_ylabel("prefix hit rate")
    ax.set_title(f"{trace}: prefix hit rate vs capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
