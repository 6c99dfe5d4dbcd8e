"""One eviction decision for the store and ``kvstore replay`` (issue 40, item 3): which block leaves a
space next is :meth:`Space.victim` and where its bytes go is :func:`next_home`
(``kvstore/store/placement.py``), and both the store's movers and the replay call them.

Before, the victim pick was written in DRAM's two picks (``store/space.py``), a level's
(``tiers/eviction.py``) and the replay's own loops (``sim/replay.py``, ``sim/cluster.py``); the
pass-down rule in ``tiers/demotion.py``, ``tiers/eviction.py`` and the replay's ``_evicted``. These
tests change the one rule and see the store (a real in-process sidecar over gRPC, DRAM evicting to
a real SSD tier that evicts too) and every replay change with it; and no module but the rule's
asks a policy for a victim itself.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvstore.sim.replay
import kvstore.tiers.demotion
import kvstore.tiers.eviction
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, prefix_keys
from kvstore.server.sidecar import Sidecar
from kvstore.sim.cluster import replay_cluster
from kvstore.sim.replay import TierSpec, replay
from kvstore.sim.traces import multi_turn
from kvstore.store import placement
from kvstore.store.index import TierId
from kvstore.store.placement import Space
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1] / "kvstore"
# Where a policy is asked for a victim directly: the policies themselves, the soft pin's rule, the
# one victim rule, and the cluster policy's own spare-first pick (a policy wrapping a policy).
ASKS = {"pop_victim", "least"}
MAY_ASK = {"store/retention.py", "store/placement.py"}
MAY_ASK_IN = {("sim/replay.py", "plain_pop")}
PASSERS = (kvstore.tiers.demotion, kvstore.tiers.eviction, kvstore.sim.replay)
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
    assert not found, "victims picked outside Space.victim (kvstore/store/placement.py):\n" + "\n".join(found)


def test_store_and_replay_pass_down_by_one_rule() -> None:
    """The demotion, the level's eviction and the replay's ``_evicted`` all ask ``next_home``."""
    assert {m.__name__: getattr(m, "next_home", None) for m in PASSERS} == {
        m.__name__: placement.next_home for m in PASSERS
    }


def _counting(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter[str], Counter[str]]:
    """Count, by calling module, every call of the victim rule and of the pass-down rule."""
    victims: Counter[str] = Counter()
    homes: Counter[str] = Counter()
    rule = Space.victim

    def victim(self: Space, *args: Any, **kwargs: Any) -> Any:
        victims[sys._getframe(1).f_globals["__name__"]] += 1
        return rule(self, *args, **kwargs)

    def counted(module: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def next_home(*args: Any) -> Any:
            homes[module] += 1
            return f(*args)

        return next_home

    monkeypatch.setattr(Space, "victim", victim)
    for m in PASSERS:
        monkeypatch.setattr(m, "next_home", counted(m.__name__, placement.next_home))
    return victims, homes


def test_the_replay_runs_the_store_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """One space, tiers, a cluster: each pick and each pass-down goes through the rule."""
    victims, homes = _counting(monkeypatch)
    t = multi_turn(sessions=40, seed=3)
    cap = 24
    replay(t, cap, "lru")
    assert victims["kvstore.sim.replay"] > 0
    one = victims["kvstore.sim.replay"]
    replay(t, [TierSpec(TierId.DRAM, cap), TierSpec(TierId.SSD, 2 * cap)], "lru")
    assert victims["kvstore.sim.replay"] > one
    assert homes["kvstore.sim.replay"] > 0
    replay_cluster(t, 2, cap, "cluster", "round-robin", "lru")
    assert victims["kvstore.sim.cluster"] > 0


async def test_the_store_runs_the_same_rules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A sidecar with 32 slots of 8 KiB over an SSD of 64 KiB: DRAM's evictions pick through the
    rule and pass down by it, and so do the SSD's."""
    victims, homes = _counting(monkeypatch)
    cfg = small_config(tmp_path, **{"ssd.enabled": True, "ssd.capacity_bytes": 8 * BLOCK})
    rng = np.random.default_rng(5)
    async with Sidecar(cfg) as sc, KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}") as c:
        for r in range(3):
            keys = prefix_keys(NS, list(range(r * 100_000, r * 100_000 + 16 * 32)))
            await c.put_blocks(NS, keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys])
            await sc.store.tiering.flush()
    assert victims["kvstore.store.space"] > 0
    assert homes["kvstore.tiers.demotion"] > 0
    assert victims["kvstore.tiers.eviction"] > 0
