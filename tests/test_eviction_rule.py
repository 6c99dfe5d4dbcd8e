"""One eviction decision for the store and ``kvstore replay`` (issue 40, item 3): which block leaves a
space next is :meth:`Space.victim`, where its bytes go is :func:`next_home`, and the loop of the two
that brings a space within its capacity is :func:`evictions` (``kvstore/store/books/placement.py``); the
store's movers and the replay call them.

Before, the victim pick was written in DRAM's two picks (``store/books/dram_space.py``), a level's
(``movers/eviction.py``) and the replay's own loops (``sim/replay.py``, ``sim/cluster.py``); the
pass-down rule in ``movers/demotion.py``, ``movers/eviction.py`` and the replay's ``_evicted``; the
capacity loop in the level's ``_within_capacity`` and, again, in the replay's ``_allocate``, its
one-space Allocate and the cluster node's. These tests change the rules and see the store (a real
in-process sidecar over gRPC, DRAM evicting to a real SSD tier that evicts too) and every replay
change with them; no module but the rule's asks a policy for a victim itself, and no replay module
picks a victim or loops to a capacity but through :func:`evictions`.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, cast

import numpy as np
import pytest

import kvstore.movers.demotion
import kvstore.movers.eviction
import kvstore.sim.cluster
import kvstore.sim.replay
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.sim.cluster import replay_cluster
from kvstore.sim.replay import TierSpec, replay
from kvstore.sim.traces import multi_turn
from kvstore.store.books import placement
from kvstore.store.books.index import TierId
from kvstore.store.books.placement import Space
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1] / "kvstore"
# Where a policy is asked for a victim directly: the policies themselves, the soft pin's rule, the
# one victim rule, and the cluster policy's own spare-first pick (a policy wrapping a policy).
ASKS = {"pop_victim", "least"}
MAY_ASK = {"store/books/retention.py", "store/books/placement.py"}
MAY_ASK_IN = {("sim/replay.py", "plain_pop")}
# next_home, for a block that leaves outside a capacity loop
PASSERS = (kvstore.movers.demotion, kvstore.movers.eviction)
BOUNDERS = (kvstore.movers.eviction, kvstore.sim.replay, kvstore.sim.cluster)  # evictions: a space within its capacity
SIM = ROOT / "sim"
NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
BLOCK = 8192


def _asks(path: Path) -> list[str]:
    """The lines of ``path`` that ask a policy (or the soft pin) for a victim outside the rule."""
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("policy/") or rel in MAY_ASK:
        return []
    tree = ast.parse(path.read_text())
    exempt: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and (rel, fn.name) in MAY_ASK_IN:
            exempt.update(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
    return [
        f"kvstore/{rel}:{n.lineno}: .{n.func.attr}(...)"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ASKS
        and n.lineno not in exempt
    ]


def test_no_module_picks_a_victim_but_the_rule() -> None:
    """Every victim, the store's and the replay's, is :meth:`Space.victim`'s pick."""
    found = [line for p in sorted(ROOT.rglob("*.py")) for line in _asks(p)]
    assert not found, "victims picked outside Space.victim (kvstore/store/books/placement.py):\n" + "\n".join(found)


def test_store_and_replay_pass_down_by_one_rule() -> None:
    """The demotion and the level's quota eviction ask ``next_home``; the level's capacity
    eviction and every replay's Allocate run ``evictions`` (which asks ``next_home``)."""
    assert {m.__name__: getattr(m, "next_home", None) for m in PASSERS} == {
        m.__name__: placement.next_home for m in PASSERS
    }
    assert {m.__name__: getattr(m, "evictions", None) for m in BOUNDERS} == {
        m.__name__: placement.evictions for m in BOUNDERS
    }


def _own_loops(path: Path) -> list[str]:
    """The lines of ``path`` where the replay picks a victim itself (``.victim``: the rule's step
    outside the rule's loop) or loops until a space fits its capacity."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT).as_posix()
    found = [
        f"kvstore/{rel}:{n.lineno}: .victim"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "victim"
    ]
    found += [
        f"kvstore/{rel}:{n.lineno}: while ... capacity"
        for n in ast.walk(tree)
        if isinstance(n, ast.While) and "capacity" in ast.unparse(n.test)
    ]
    return found


def test_the_replay_has_no_capacity_loop_of_its_own() -> None:
    """Every space of ``kvstore replay`` (one space, tiers, a cluster's nodes) is brought within
    its capacity by :func:`evictions`, the store's loop: no module under ``kvstore/sim/`` picks a
    victim or loops to a capacity itself."""
    found = [line for p in sorted(SIM.rglob("*.py")) for line in _own_loops(p)]
    assert not found, "kvstore/sim/ brings a space within capacity by its own loop:\n" + "\n".join(found)


def _caller() -> str:
    """The module that asked, past the rules' own frames (``evictions`` asks the victim rule and
    the pass-down rule for its caller)."""
    f = sys._getframe(2)
    while f.f_globals["__name__"] == placement.__name__:
        f = cast(FrameType, f.f_back)
    return cast(str, f.f_globals["__name__"])


def _counting(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Count, by calling module, every call of the victim rule, of the pass-down rule and of the
    capacity rule."""
    victims: Counter[str] = Counter()
    homes: Counter[str] = Counter()
    bounds: Counter[str] = Counter()
    rule, home, bound = Space.victim, placement.next_home, placement.evictions

    def victim(self: Space, *args: Any, **kwargs: Any) -> Any:
        victims[_caller()] += 1
        return rule(self, *args, **kwargs)

    def next_home(*args: Any) -> Any:
        homes[_caller()] += 1
        return home(*args)

    def counted(module: str) -> Callable[..., Any]:
        def evictions(*args: Any) -> Any:
            bounds[module] += 1
            return bound(*args)

        return evictions

    monkeypatch.setattr(Space, "victim", victim)
    for m in (placement, *PASSERS):
        monkeypatch.setattr(m, "next_home", next_home)
    for m in BOUNDERS:
        monkeypatch.setattr(m, "evictions", counted(m.__name__))
    return victims, homes, bounds


def test_the_replay_runs_the_store_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """One space, tiers, a cluster: each space is brought within its capacity by the capacity
    rule, each pick and each pass-down through it."""
    victims, homes, bounds = _counting(monkeypatch)
    t = multi_turn(sessions=40, seed=3)
    cap = 24
    replay(t, cap, "lru")
    assert bounds["kvstore.sim.replay"] > 0
    assert victims["kvstore.sim.replay"] > 0
    one = bounds["kvstore.sim.replay"], victims["kvstore.sim.replay"]
    replay(t, [TierSpec(TierId.DRAM, cap), TierSpec(TierId.SSD, 2 * cap)], "lru")
    assert bounds["kvstore.sim.replay"] > one[0]
    assert victims["kvstore.sim.replay"] > one[1]
    assert homes["kvstore.sim.replay"] > 0
    replay_cluster(t, 2, cap, "cluster", "round-robin", "lru")
    assert bounds["kvstore.sim.cluster"] > 0
    assert victims["kvstore.sim.cluster"] > 0
    assert set(bounds) | set(victims) | set(homes) == {"kvstore.sim.replay", "kvstore.sim.cluster"}


async def test_the_store_runs_the_same_rules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A sidecar with 32 slots of 8 KiB over an SSD of 64 KiB: DRAM's evictions pick through the
    rule and pass down by it, and the SSD is brought within its capacity by the capacity rule, its
    victims picked and passed down through it."""
    victims, homes, bounds = _counting(monkeypatch)
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.capacity_bytes": 8 * BLOCK})
    rng = np.random.default_rng(5)
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        for r in range(3):
            keys = prefix_keys(NS, list(range(r * 100_000, r * 100_000 + 16 * 32)))
            await c.put_blocks(NS, keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys])
            await sc.store.tiering.flush()
    assert victims["kvstore.store.books.dram_space"] > 0
    assert homes["kvstore.movers.demotion"] > 0
    assert bounds["kvstore.movers.eviction"] > 0
    assert victims["kvstore.movers.eviction"] > 0
    assert homes["kvstore.movers.eviction"] > 0
