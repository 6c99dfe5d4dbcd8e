"""Tenant quotas in DRAM: each tenant's share, its own blocks evicted first when it is over.

A tenant is a namespace's ``cache_salt`` (vLLM's per-tenant salt), named by the tag its
namespace label carries (``#`` + the salt's SHA-256, 6 hex digits; "" for no salt), so blocks
recovered from a tier's headers know their tenant too. ``tenants.dram_quota_bytes`` (every tenant)
and ``tenants.dram_quotas`` (per salt) give each tenant a quota of committed DRAM bytes, as
LMCache's ``IsolatedLRU`` does per salt:

* a tenant that would pass its quota with a new write (or promotion, or peer fetch) makes room by
  evicting **its own** blocks first, in the policy's order; when its own unpinned blocks cannot
  make that room the request is refused (RESOURCE_EXHAUSTED naming the quota) before anything is
  evicted;
* a tenant at or under its quota is never evicted for another tenant's request: only blocks of
  tenants without a quota, or over theirs, are (the set is fixed when the request starts, so the
  DRAM space's plan and its evictions agree).

Quotas count committed blocks' bytes (``Block.size``) while they are in DRAM; slots of open
allocations are not counted until their commit.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.store.index import Block


def salt_tag(salt: str) -> str:
    """The tenant tag of a ``cache_salt`` (as :attr:`kvstore.keys.Namespace.label` shows it)."""
    return hashlib.sha256(salt.encode()).hexdigest()[:6] if salt else ""


def tenant_of_label(label: str) -> str:
    head, sep, tag = label.rpartition("#")
    return tag if sep and len(tag) == 6 and head else ""


class Quotas:
    def __init__(self, default_bytes: int, per_salt: Mapping[str, int]) -> None:
        self.default = default_bytes
        self.quotas = {salt_tag(s): n for s, n in per_salt.items()}
        self.used: Counter[str] = Counter()  # tenant -> committed bytes in DRAM
        self.evictions: Counter[str] = Counter()
        self._labels: dict[str, str] = {}  # namespace label -> tenant

    @classmethod
    def from_config(cls, default_bytes: int, per_salt: Mapping[str, int]) -> Quotas | None:
        return cls(default_bytes, per_salt) if default_bytes or per_salt else None

    def tenant(self, b: Block) -> str:
        return self.of_label(b.ns.label)

    def of_label(self, label: str) -> str:
        """The tenant of the namespace labelled ``label``."""
        t = self._labels.get(label)
        if t is None:
            if len(self._labels) > 65536:
                self._labels.clear()
            t = self._labels[label] = tenant_of_label(label)
        return t

    def quota(self, tenant: str) -> int:
        """Its quota in bytes; 0 when it has none."""
        return self.quotas.get(tenant, self.default)

    def placed(self, b: Block) -> None:
        self.used[self.tenant(b)] += b.size

    def freed(self, b: Block) -> None:
        t = self.tenant(b)
        self.used[t] -= b.size
        if self.used[t] <= 0:
            del self.used[t]

    def excess(self, tenant: str, nbytes: int) -> int:
        """Bytes ``tenant`` must free of its own before ``nbytes`` more fit its quota."""
        q = self.quota(tenant)
        return max(0, self.used[tenant] + nbytes - q) if q else 0

    def evictable_for(self, tenant: str) -> Callable[[Block], bool]:
        """Whose blocks a request of ``tenant`` may evict: its own, and those of tenants without a
        quota or over theirs (fixed now, for the whole request)."""
        open_ = {t for t in self.used if t != tenant and self.used[t] > self.quota(t) > 0}
        quotas, default, tenant_of = self.quotas, self.default, self.tenant

        def ok(b: Block) -> bool:
            t = tenant_of(b)
            return t == tenant or t in open_ or not quotas.get(t, default)

        return ok

    def snapshot(self, shown: int) -> dict[str, Any]:
        """The ``tenants`` entry of /stats: the tenants with a quota, and the busiest others."""
        tenants = set(self.quotas) | {t for t, _ in self.used.most_common(shown)}
        return {
            (t or "-"): {"dram_bytes": self.used.get(t, 0), "dram_quota_bytes": self.quota(t),
                         "evictions": self.evictions.get(t, 0)}
            for t in sorted(tenants)
        }
