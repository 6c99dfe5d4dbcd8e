"""The policies' victim search (a heap of each queue's leaves, kvstore/policy/leaves.py) chooses
exactly the victims of the scan it replaced: each queue walked from its front past blocks with
children and blocks ``eligible`` rejects. The scan is kept here as the reference, over the same
queues, and both are driven in lockstep on random prefix trees with random eligibility, holds,
removals, hits and partial tails."""

from __future__ import annotations

import random

import pytest

from kvstore.policy.base import Eligible, Item
from kvstore.policy.credit import TAILS, CreditLRUPolicy
from kvstore.policy.lru import LRUPolicy


class ScanCredit(CreditLRUPolicy):
    """The credit policy with the victim search it had before: each queue scanned from its front."""

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        n = len(self._queue)
        self._cap = max(self._cap, n)
        kids, held = self._links.kids, self._held
        unit = self.boost * self._cap
        victim, best = None, 0.0
        for q, queue in enumerate(self._queues):
            for item in sorted(queue, key=queue.__getitem__):  # (oldest first: by the last use's tick)
                if item in kids or item in held or (eligible is not None and not eligible(item)):
                    continue
                pri = queue[item] + ((q - 1) * unit if q != TAILS else -self._cap)  # (its last use)
                if victim is None or pri < best:
                    victim, best = item, pri
                break
        if victim is None:
            return None
        ghost = self._ghost
        ghost[victim] = self.uses(victim)
        if len(ghost) > self.ghost_share * self._cap:
            ghost.popitem(last=False)
        self.remove(victim)
        return victim


class ScanLRU(LRUPolicy):
    """LRU with the victim search it had before: the order scanned from its front."""

    def pop_victim(self, eligible: Eligible | None = None) -> Item | None:
        kids, held = self._links.kids, self._held
        for item in sorted(self._order, key=self._order.__getitem__):  # (oldest first)
            if item in kids or item in held or (eligible is not None and not eligible(item)):
                continue
            self.remove(item)
            return item
        return None


class Twins:
    """A policy and its reference, driven with the same calls; every answer must agree."""

    def __init__(self, fast: CreditLRUPolicy | LRUPolicy, slow: CreditLRUPolicy | LRUPolicy) -> None:
        self.fast, self.slow = fast, slow

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def both(*args: object) -> object:
            a = getattr(self.fast, name)(*args)
            b = getattr(self.slow, name)(*args)
            assert a == b, (name, args, a, b)
            return a

        return both


def drive(p: Twins, rng: random.Random, steps: int, width: int) -> list[Item]:
    """Random prompts over a prefix tree of ``width`` branches per block, committed as the store
    commits them, with hits, removals, holds and pops under random eligibility; the victims."""
    # A block is the tuple of its branch choices: its parent is the tuple without the last one.
    victims: list[Item] = []
    resident: set[Item] = set()
    held: set[Item] = set()
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:  # a request: the leading run is hit, the rest allocated and committed
            depth = rng.randint(1, 12)
            path = tuple(rng.randrange(width) for _ in range(depth))
            keys = [path[: i + 1] for i in range(depth)]
            n = 0
            while n < depth and keys[n] in resident:
                n += 1
            if n:
                if rng.random() < 0.5:
                    p.access_many(keys[:n][::-1])
                else:
                    for k in reversed(keys[:n]):
                        p.access(k)
            new = [k for k in keys[n:] if k not in resident]
            for k in new:  # root first, the parent when the policy holds it
                parent = k[:-1] if k[:-1] in resident else None
                size = 256 if k is keys[-1] and rng.random() < 0.3 else 512
                p.insert(k, parent, len(k), size)
                resident.add(k)
            p.access_many(new[::-1])
        elif op < 0.55 and resident:
            k = rng.choice(sorted(resident))
            p.remove(k)
            resident.discard(k)
        elif op < 0.65:
            k = rng.choice(sorted(resident)) if resident and rng.random() < 0.8 else (rng.randrange(width),)
            p.hold(k)
            held.add(k)
        elif op < 0.72 and held:
            k = rng.choice(sorted(held))
            p.release(k)
            held.discard(k)
        else:
            salt = rng.random()
            chance = rng.choice([0.0, 0.3, 0.9])
            eligible = None
            if chance:
                eligible = lambda x, s=salt, c=chance: random.Random(hash((x, s))).random() >= c  # noqa: E731
            for _ in range(rng.randint(1, 6)):
                v = p.pop_victim(eligible)
                if v is None:
                    break
                assert v not in held
                resident.discard(v)
                victims.append(v)
    for k in sorted(held):
        p.release(k)
    while (v := p.pop_victim()) is not None:
        victims.append(v)
    assert not p.__len__()
    return victims


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", ["credit", "credit-boost0", "lru"])
def test_same_victims_as_the_scan(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    if kind == "lru":
        p = Twins(LRUPolicy(), ScanLRU())
    else:
        kw = {"boost": 0.0} if kind == "credit-boost0" else {}
        p = Twins(CreditLRUPolicy(**kw), ScanCredit(**kw))  # type: ignore[arg-type]
    victims = drive(p, rng, steps=1500, width=rng.choice([2, 3, 5]))
    assert len(victims) > 100  # the comparison covered many pops


@pytest.mark.parametrize("cls", [CreditLRUPolicy, LRUPolicy])
def test_held_and_interior_blocks_are_not_walked(cls: type[CreditLRUPolicy] | type[LRUPolicy]) -> None:
    """A chain's interior blocks and held blocks are not offered to ``eligible``: the first pop
    of 1,000 held chain ends behind 1,000 chains' interiors asks about one block."""
    p = cls()
    for c in range(2000):  # chains of 3 blocks: two interior blocks and a leaf each
        keys = [(c, 0), (c, 1), (c, 2)]
        for i, k in enumerate(keys):
            p.insert(k, keys[i - 1] if i else None, i + 1, 512)
        p.access_many(keys[::-1])
        if c < 1000:
            p.hold(keys[-1])
    asked: list[Item] = []

    def eligible(x: Item) -> bool:
        asked.append(x)
        return True

    assert p.pop_victim(eligible) == (1000, 2)
    assert asked == [(1000, 2)] or (cls is CreditLRUPolicy and len(asked) <= p.classes + 1)
    p.release((0, 2))
    assert p.pop_victim() == (0, 2)
