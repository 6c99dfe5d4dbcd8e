"""Tenant quotas, per tier: each tenant's share, its own blocks evicted first when it is over.

A tenant is a namespace's ``cache_salt`` (vLLM's per-tenant salt), named by its tag
(:func:`~kvstore.keys.salt_tag`: the salt's SHA-256, 16 hex digits; "" for no salt). The tag is a
field of the namespace's entry (``NsEntry.tenant``, set from the request's ``cache_salt``, or from
a tier's block header after a restart, which carries it as a field too), never parsed out of the
label that the namespace's free text builds: a namespace without salt whose model reads
``"m#<tag>"`` is the unsalted tenant's, however its label looks. ``[tenants]`` gives each tier a quota for
every tenant and per-salt ones (``TenantsConfig.quota``), as LMCache's ``IsolatedLRU`` does per
salt; :class:`Tenants` holds one :class:`Quotas` per tier that has any.

DRAM (:class:`~kvstore.store.books.dram_space.DramSpace`), counting committed blocks' bytes (``Block.size``)
while they are in DRAM (slots of open allocations count from their commit):

* a tenant that would pass its quota with a new write (or promotion, or peer fetch) makes room by
  evicting **its own** blocks first, in the policy's order; when its own unpinned blocks cannot
  make that room the request is refused (RESOURCE_EXHAUSTED naming the quota) before anything is
  evicted;
* a tenant at or under its quota is never evicted for another tenant's request: only blocks of
  tenants without a quota, or over theirs, are (the set is fixed when the request starts, so the
  DRAM space's plan and its evictions agree).

The tiers below (:mod:`kvstore.movers.eviction`), counting what each tier counts against its capacity
(the SSD: block files; Redis, S3: block bytes), blocks on their way in included: before a
demotion batch, a write-through or a demotion from the tier above is written, a tenant past its
quota there loses its own oldest blocks in that tier (demoted further down, or dropped, as any
eviction from it); what its own blocks cannot make room for is not written there (a demotion goes
on down the chain). A bounded tier (SSD) making room for capacity evicts no block of a tenant
within its quota.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvstore.config import QUOTA_TIERS
from kvstore.keys import salt_tag
from kvstore.stats.counters import busiest

if TYPE_CHECKING:
    from kvstore.config import TenantsConfig
    from kvstore.store.books.index import Block


__all__ = ["Quotas", "Tenants", "salt_tag"]

PRUNE_FLOOR = 1024  # tenants' counters kept past those with bytes in the tier before they are let go


class Quotas:
    def __init__(self, default_bytes: int, per_salt: Mapping[str, int]) -> None:
        self.default = default_bytes
        self.quotas = {salt_tag(s): n for s, n in per_salt.items()}
        self.used: Counter[str] = Counter()  # tenant -> bytes in the tier
        self.evictions: Counter[str] = Counter()  # tenant -> its blocks evicted from the tier (evicted())
        self.refused: Counter[str] = Counter()  # tenant -> its blocks kept out of the tier by its quota (refuse())
        self.coming: Counter[str] = Counter()  # tenant -> bytes of its blocks holding slots their bytes are on
        self._coming: dict[Block, str] = {}  # their way into (a promotion, a peer fetch): see reserve
        self._prune_at = PRUNE_FLOOR  # counters past this many: those of tenants gone are let go

    @classmethod
    def from_config(cls, default_bytes: int, per_salt: Mapping[str, int]) -> Quotas | None:
        return cls(default_bytes, per_salt) if default_bytes or per_salt else None

    @staticmethod
    def tenant(b: Block) -> str:
        """The tenant ``b`` counts against: its namespace entry's field."""
        return b.ns.tenant

    def quota(self, tenant: str) -> int:
        """Its quota in bytes; 0 when it has none."""
        return self.quotas.get(tenant, self.default)

    def placed(self, b: Block, nbytes: int | None = None) -> None:
        """``b`` takes ``nbytes`` of the tier now (by default its size)."""
        self.used[self.tenant(b)] += b.size if nbytes is None else nbytes

    def freed(self, b: Block, nbytes: int | None = None) -> None:
        t = self.tenant(b)
        self.used[t] -= b.size if nbytes is None else nbytes
        if self.used[t] <= 0:
            del self.used[t]

    def evicted(self, b: Block) -> None:
        """``b`` was evicted from the tier: one more of its tenant's evictions."""
        self.evictions[self.tenant(b)] += 1
        self._prune()

    def refuse(self, tenant: str, blocks: int) -> None:
        """``tenant``'s quota kept ``blocks`` of its blocks out of the tier."""
        self.refused[tenant] += blocks
        self._prune()

    def _prune(self) -> None:
        """A salt is free: the counters of tenants with no bytes in the tier (nor any on their way)
        and no quota of their own, which /stats does not show (:meth:`Tenants.snapshot`), are let go
        once they are many (amortised: the next pass when the kept ones have doubled), so that
        counters kept per salt ever seen do not grow without bound. A tenant that comes back
        counts from 0 (a counter reset, as a restart's)."""
        if len(self.evictions) + len(self.refused) <= self._prune_at:
            return
        for counts in (self.evictions, self.refused):
            for t in [t for t in counts if t not in self.used and t not in self.coming and t not in self.quotas]:
                del counts[t]
        self._prune_at = 2 * (len(self.evictions) + len(self.refused)) + PRUNE_FLOOR

    def reserve(self, b: Block) -> None:
        """``b`` holds a slot its bytes are on their way into (a promotion, a peer fetch): its size
        counts against its tenant's quota (:meth:`excess`) until it is placed or let go
        (:meth:`settle`), so that a run of such blocks taken one by one never passes the quota."""
        t = self._coming[b] = self.tenant(b)
        self.coming[t] += b.size

    def settle(self, b: Block) -> None:
        """``b``'s reservation (if it has one) ends: placed (then counted as used) or let go."""
        t = self._coming.pop(b, None)
        if t is not None:
            self.coming[t] -= b.size
            if self.coming[t] <= 0:
                del self.coming[t]

    def excess(self, tenant: str, nbytes: int) -> int:
        """Bytes ``tenant`` must free of its own before ``nbytes`` more fit its quota (with the
        bytes of its blocks on their way in, :meth:`reserve`)."""
        q = self.quota(tenant)
        return max(0, self.used[tenant] + self.coming[tenant] + nbytes - q) if q else 0

    def over(self) -> list[str]:
        """The tenants past their quota now."""
        return [t for t in self.used if self.used[t] > self.quota(t) > 0]

    def evictable_for(self, tenant: str | None) -> Callable[[Block], bool]:
        """Whose blocks a request of ``tenant`` may evict: its own, and those of tenants without a
        quota or over theirs (fixed now, for the whole request); ``None``: a request of no tenant
        (a tier making room for its capacity)."""
        open_ = {t for t in self.used if t != tenant and self.used[t] > self.quota(t) > 0}
        quotas, default, tenant_of = self.quotas, self.default, self.tenant

        def ok(b: Block) -> bool:
            t = tenant_of(b)
            return t == tenant or t in open_ or not quotas.get(t, default)

        return ok

    def entry(self, tenant: str) -> dict[str, int]:
        """``tenant``'s line of this tier in /stats."""
        return {"bytes": self.used.get(tenant, 0), "quota_bytes": self.quota(tenant),
                "evictions": self.evictions.get(tenant, 0), "refused": self.refused.get(tenant, 0)}


class Tenants:
    """Every tier's quotas: one :class:`Quotas` per tier that has a quota configured; a tier
    reports on /stats once its space or level has taken them (:meth:`attach`)."""

    def __init__(self, by_tier: Mapping[str, Quotas]) -> None:
        self.by_tier = dict(by_tier)
        self.attached: dict[str, Quotas] = {}

    @classmethod
    def from_config(cls, cfg: TenantsConfig) -> Tenants:
        made = {tier: Quotas.from_config(*cfg.quota(tier)) for tier in QUOTA_TIERS}
        return cls({tier: q for tier, q in made.items() if q is not None})

    def attach(self, tier: str) -> Quotas | None:
        """The quotas of ``tier``, which a space or level of it enforces from now on; None: none."""
        q = self.by_tier.get(tier)
        if q is not None:
            self.attached[tier] = q
        return q

    def snapshot(self, shown: int) -> dict[str, Any]:
        """The ``tenants`` entry of /stats: per tenant tag ("-" for no salt), per tier with quotas,
        its bytes, quota, evictions and refused blocks; the tenants with a quota in any tier, and
        the ``shown`` busiest others."""
        tiers = self.attached
        total: Counter[str] = Counter()
        for q in tiers.values():
            total.update(q.used)
        named = {t for q in tiers.values() for t in q.quotas}
        tenants = named | busiest(total, shown)
        return {(t or "-"): {tier: q.entry(t) for tier, q in tiers.items()} for t in sorted(tenants)}
