"""The soft pin at the cost of a heap (kvstore/store/books/retention.py): retained blocks kept in bands of
the policies (kvstore/policy/leaves.py) give exactly the victims of the rule they replaced, which
asked the policy once per priority with a filter that rejected every retained block above it
(walking all of them on every eviction). The old rule is kept here as the reference, over a twin
policy, and both are driven in lockstep on random prefix trees with random retentions (ends,
priorities, extensions, early ends, a clock that runs them out), eligibility, holds, removals and
hits. Then the work: a victim among 20,000 retained blocks judges a handful of candidates."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvstore.keys import NamespaceRoot
from kvstore.policy.base import Eligible, EvictionPolicy
from kvstore.policy.credit import CreditLRUPolicy
from kvstore.policy.lru import LRUPolicy
from kvstore.store.books.index import DRAM, Block, Index, State
from kvstore.store.books.retention import PRIORITIES, Retention


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def old_rule(policy: EvictionPolicy, ok: Eligible | None, now: float, retained: Callable[[], bool]) -> object:
    """The soft pin as 66d9839 chose (Retention.pop_victim then): the policy asked with a filter
    per priority level, -1 (unretained only) first."""
    if not retained():
        return policy.pop_victim(ok)
    for p in range(-1, PRIORITIES):
        def may(b: object, p: int = p) -> bool:
            blk = b if isinstance(b, Block) else None
            assert blk is not None
            return (blk.retain_until <= now or blk.retain_priority <= p) and (ok is None or ok(b))

        v = policy.pop_victim(may)
        if v is not None:
            return v
    return None


def drive(make: Callable[[], EvictionPolicy], rng: random.Random, steps: int, width: int) -> int:
    """Random requests over a prefix tree with retentions; every victim compared; how many."""
    index = Index()
    entry = index.namespace(NamespaceRoot(b"r" * 16), "label")
    clock = Clock()
    retention = Retention(clock)
    index.retained = retention.recount
    new, ref = make(), make()
    blocks: dict[tuple[int, ...], Block] = {}
    resident: set[tuple[int, ...]] = set()
    held: set[tuple[int, ...]] = set()
    victims = 0

    def block(k: tuple[int, ...]) -> Block:
        if k not in blocks:
            b = index.add(entry, bytes(k).rjust(32, b"\0"), b"", 512, State.COMMITTED)
            b.tiers = DRAM
            blocks[k] = b
        return blocks[k]

    def both(name: str, *args: object) -> None:
        getattr(new, name)(*args)
        getattr(ref, name)(*args)

    def pop(eligible: Eligible | None) -> bool:
        nonlocal victims
        live = any(b.retain_until > clock.now for k, b in blocks.items() if k in resident)
        want = old_rule(ref, eligible, clock.now, lambda: live)
        got = retention.pop_victim(new, eligible)
        assert got is want, (got, want)
        if got is None:
            return False
        k = next(k for k, b in blocks.items() if b is got)
        resident.discard(k)
        victims += 1
        return True

    for _ in range(steps):
        op = rng.random()
        if op < 0.35:
            depth = rng.randint(1, 10)
            path = tuple(rng.randrange(width) for _ in range(depth))
            keys = [path[: i + 1] for i in range(depth)]
            n = 0
            while n < depth and keys[n] in resident:
                n += 1
            if n:
                both("access_many", [block(k) for k in keys[:n][::-1]])
            fresh = [k for k in keys[n:] if k not in resident]
            for k in fresh:
                parent = block(k[:-1]) if k[:-1] in resident else None
                both("insert", block(k), parent, len(k), 256 if k is keys[-1] and rng.random() < 0.3 else 512)
                resident.add(k)
            both("access_many", [block(k) for k in fresh[::-1]])
        elif op < 0.55 and resident:  # a hint on some resident blocks (or its end: 0)
            ks = rng.sample(sorted(resident), min(len(resident), rng.randint(1, 8)))
            ms = rng.choice([0, 1_000, 5_000, 60_000])
            retention.retain([block(k) for k in ks], ms, rng.randrange(PRIORITIES))
        elif op < 0.62:
            clock.now += rng.choice([0.5, 2.0, 10.0])  # some retentions run out
        elif op < 0.67 and resident:
            k = rng.choice(sorted(resident))
            both("remove", block(k))
            resident.discard(k)
        elif op < 0.74:
            k = rng.choice(sorted(resident)) if resident else (rng.randrange(width),)
            both("hold", block(k))
            held.add(k)
        elif op < 0.79 and held:
            k = rng.choice(sorted(held))
            both("release", block(k))
            held.discard(k)
        else:
            salt, chance = rng.random(), rng.choice([0.0, 0.3, 0.9])
            eligible = None
            if chance:
                eligible = lambda x, s=salt, c=chance: random.Random(hash((id(x), s))).random() >= c  # noqa: E731
            for _ in range(rng.randint(1, 6)):
                if not pop(eligible):
                    break
    for k in sorted(held):
        both("release", block(k))
    while pop(None):
        pass
    assert not len(new) and not len(ref)
    return victims


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["credit", "lru"])
def test_retained_victims_are_the_old_rules(kind: str, seed: int) -> None:
    rng = random.Random(seed)

    def make() -> EvictionPolicy:
        return LRUPolicy() if kind == "lru" else CreditLRUPolicy()

    assert drive(make, rng, steps=1500, width=rng.choice([2, 3, 5])) > 100


@pytest.mark.parametrize("cls", [CreditLRUPolicy, LRUPolicy])
def test_a_victim_among_many_retained_judges_a_handful(cls: type[CreditLRUPolicy] | type[LRUPolicy]) -> None:
    """20,000 retained blocks (the oldest), 50 unretained: each of 60 victims (50 unretained, then
    10 retained of the lowest priority) judges a few candidates, not the retained ones. (66d9839
    judged every retained block on every pop: about 1.2 million.)"""
    index = Index()
    entry = index.namespace(NamespaceRoot(b"r" * 16), "label")
    clock = Clock()
    retention = Retention(clock)
    index.retained = retention.recount
    p = cls()
    retained, plain = [], []
    for i in range(20_050):
        b = index.add(entry, i.to_bytes(32, "big"), b"", 4096, State.COMMITTED)
        b.tiers = DRAM
        p.insert(b, None, 1, 4096)
        (retained if i < 20_000 else plain).append(b)
    retention.retain(retained[:10], 60_000, 0)
    retention.retain(retained[10:], 60_000, 2)
    got = [retention.pop_victim(p, lambda b: True) for _ in range(60)]
    assert got == plain + retained[:10]
    assert retention.work["examined"] <= 60 * 8
