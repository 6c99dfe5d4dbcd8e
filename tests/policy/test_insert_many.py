"""A policy's bulk insert (``insert_many``, a restart's batch: kvstore/movers/recovery.py) leaves
exactly the state of one ``insert`` after the other: the same ticks and their order, queues, uses,
prefix links, held and banded items, and the same leaf entries (heap, parked, rebuild floor), so
the same victims in the same order. Driven on random prefix forests loaded in batches of random
sizes: parents earlier in the batch, in an earlier batch, later in the batch (not linked), absent;
partial tails (credit's tail queue); batches large enough for the leaves to be rebuilt in them;
and the cases the bulk path leaves to the inserts (an item held, banded, already in the space, a
ghost to resume)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore.policy import make_policy, policy_names
from kvstore.policy.base import EvictionPolicy
from kvstore.policy.leaves import Leaves
from kvstore.policy.tree import PrefixLinks


def state(p: EvictionPolicy) -> dict[str, Any]:
    """Every attribute of ``p``, dicts and sets as their items in order, leaves as their entries."""

    def plain(v: Any) -> Any:
        if isinstance(v, Leaves):
            return ("leaves", list(v.heap), list(v.parked), v.floor)
        if isinstance(v, PrefixLinks):
            return ("links", list(v.parent.items()), list(v.kids.items()))
        if isinstance(v, dict):
            return [(k, plain(x)) for k, x in v.items()]
        if isinstance(v, (set, frozenset)):
            return ("set", list(v))
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return {k: plain(v) for k, v in vars(p).items() if k != "band"}


def forest(rng: random.Random, n: int, first: int) -> tuple[list[int], list[int | None], list[int], list[int]]:
    """``n`` new items from ``first`` on, as prompts (chains) of 1-24 blocks: each item's parent
    (the block before; sometimes an item of an earlier batch, one later in this batch, or one
    never inserted), depth and size (4,096, a prompt's last block sometimes smaller)."""
    items, parents, depths, sizes = [], [], [], []
    i = first
    while len(items) < n:
        run = min(rng.randint(1, 24), n - len(items))
        prev: int | None = rng.choice([None, None, rng.randrange(max(first, 1)) if first else None])
        for d in range(run):
            items.append(i)
            parents.append(prev)
            depths.append(d + 1)
            sizes.append(4096 if d < run - 1 or rng.random() < 0.7 else rng.choice([1024, 2048, 4095]))
            prev = i
            i += 1
    for _ in range(max(1, n // 50)):  # parents later in the batch, or never inserted
        k = rng.randrange(n)
        parents[k] = first + rng.randrange(k + 1, n) if k + 1 < n and rng.random() < 0.5 else 10**9 + k
    return items, parents, depths, sizes


def twins(name: str, banded: bool) -> tuple[EvictionPolicy, EvictionPolicy]:
    a, b = make_policy(name), make_policy(name)
    if banded:
        def band(x: object) -> int:
            return 1 if isinstance(x, int) and x < 400 and x % 7 == 5 else -1  # (early batches: inserts)
        a.band = b.band = band  # type: ignore[attr-defined]
    return a, b


def load(bulk: EvictionPolicy, one: EvictionPolicy, items: list[int], parents: list[int | None],
         depths: list[int], sizes: list[int]) -> None:
    bulk.insert_many(items, parents, depths, sizes)
    for x, p, d, s in zip(items, parents, depths, sizes, strict=True):
        one.insert(x, p, d, s)


@pytest.mark.parametrize("name", policy_names())
@pytest.mark.parametrize("banded", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_insert_many_leaves_the_state_of_one_insert_after_the_other(
    name: str, banded: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []  # what the bulk path's Leaves.full_at answered (it runs only there)
    full_at = Leaves.full_at

    def spied(self: Leaves, size: int, adds: int) -> int:
        asked.append(full_at(self, size, adds))
        return asked[-1]

    monkeypatch.setattr(Leaves, "full_at", spied)
    rng = random.Random(seed)
    bulk, one = twins(name, banded)
    first = 0
    for n in rng.sample([1, 2, 7, 300, 2500, 6000], 6):
        items, parents, depths, sizes = forest(rng, n, first)
        first += n
        if rng.random() < 0.3 and first > n:  # something between two batches: hits, a removal, holds
            olds = rng.sample(range(first - n), 5)
            for x in olds[:3]:
                bulk.access(x)
                one.access(x)
            bulk.remove(olds[3])
            one.remove(olds[3])
            bulk.hold(olds[4])
            one.hold(olds[4])
        if rng.random() < 0.2:  # an item of the batch held before it enters (the inserts' path)
            bulk.hold(items[-1])
            one.hold(items[-1])
        load(bulk, one, items, parents, depths, sizes)
        assert state(bulk) == state(one)
    items, parents, depths, sizes = forest(rng, 2 * first + 500, first)  # (the leaves rebuilt in it)
    first += len(items)
    load(bulk, one, items, parents, depths, sizes)
    assert state(bulk) == state(one)
    victims = []
    while (v := one.pop_victim()) is not None:
        assert bulk.pop_victim() == v
        victims.append(v)
    assert bulk.pop_victim() is None
    assert len(victims) > first // 2
    assert any(asked), "the bulk path rebuilt no leaves within a batch"


@pytest.mark.parametrize("name", policy_names())
def test_insert_many_of_items_already_there_twice_or_their_own_parent_is_the_inserts(name: str) -> None:
    bulk, one = twins(name, False)
    items, parents, depths, sizes = forest(random.Random(9), 500, 0)
    load(bulk, one, items, parents, depths, sizes)
    again = [*items[100:140], 10**6, 10**6 + 1, 10**6]  # some there already, one new twice
    load(bulk, one, again, [None] * len(again), [1] * len(again), [4096] * len(again))
    mine = [10**7, 10**7 + 1, 10**7 + 2]  # new, one its own parent
    load(bulk, one, mine, [None, 10**7 + 1, 10**7 + 1], [1, 2, 3], [4096] * 3)
    assert state(bulk) == state(one)
    assert [bulk.pop_victim() for _ in range(600)] == [one.pop_victim() for _ in range(600)]


def test_credit_insert_many_with_a_ghost_resumes_counts_as_the_inserts_do() -> None:
    bulk, one = twins("credit", False)
    items, parents, depths, sizes = forest(random.Random(3), 400, 0)
    load(bulk, one, items, parents, depths, sizes)
    gone = [bulk.pop_victim() for _ in range(50)]
    assert gone == [one.pop_victim() for _ in range(50)]
    back = [x for x in gone if x is not None][:20]
    load(bulk, one, back, [None] * len(back), [1] * len(back), [4096] * len(back))
    assert state(bulk) == state(one)
    assert max(bulk.uses(x) for x in back) == 2  # (resumed from the ghost: the bulk path did not run)
