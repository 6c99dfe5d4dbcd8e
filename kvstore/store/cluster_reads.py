"""The reads that reach past this node: a Lookup continued through the blocks the rest of the
cluster holds, a run completed from it before an Acquire or a Prefetch, and the per-node prefixes
a router ranks nodes by.

They go through :attr:`ClusterReads.remote` (the :class:`~kvstore.store.remote.Remote` the
sidecar wires in; :class:`~kvstore.store.remote.NoRemote` on a node on its own, where each is the
local read alone). Why apart from the block store: what this node holds is the store's question;
what to ask the cluster, when a round trip is worth it and how its answer joins the local run is
this room's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.stats.counters import Stats
from kvstore.store.books.index import Block, Index, Lease, NsEntry, top_label
from kvstore.store.checks import Checks
from kvstore.store.remote import NoRemote, PeerBlock, Remote

# the store's own lookup: (namespace, keys, lease_ttl_ms) -> (run, placement masks, lease)
LocalLookup = Callable[[NsEntry, Sequence[bytes], int], tuple[list[Block], set[int], Lease | None]]


class ClusterReads:
    """One store's reads through the rest of the cluster."""

    def __init__(self, index: Index, checks: Checks, stats: Stats, lookup: LocalLookup) -> None:
        self.index = index
        self.checks = checks
        self.stats = stats
        self.local_lookup = lookup
        self.remote: Remote = NoRemote()  # the rest of the cluster, once the sidecar wires it

    async def lookup(
        self, ns: NsEntry, keys: Sequence[bytes], lease_ttl_ms: int = 0
    ) -> tuple[list[Block], set[int], Lease | None, list[PeerBlock]]:
        """The local lookup, the run continued through the blocks the rest of the cluster holds:
        those in a shared tier this node has join the local run, the others come back as
        :class:`PeerBlock` s after it. A full local hit asks nobody; a miss costs one directory
        round trip."""
        remote = self.remote
        peers: list[PeerBlock] = []
        if remote.active:
            self.checks.batch(len(keys), "keys")
            have = len(self.index.leading_run(ns, keys))
            if have < len(keys):
                self.checks.keys(keys, "keys")
                if lease_ttl_ms:
                    self.checks.lease_deadline(lease_ttl_ms)  # rejected before anything is asked
                adopted, peers = await remote.find(ns, keys[have:], keys[have - 1] if have else b"", have + 1)
                if adopted:
                    ns = self.index.live(ns)
                run, masks, lease = self.local_lookup(ns, keys, lease_ttl_ms)
                if len(run) != have + adopted:  # cut short (a tier went down): the peers' run does not join
                    peers = []
                self.stats.cluster["peer_blocks_found"] += len(peers)
                return run, masks, lease, peers
        run, masks, lease = self.local_lookup(ns, keys, lease_ttl_ms)
        return run, masks, lease, peers

    async def prefixes(self, ns: NsEntry, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """Per node of the cluster, the leading run of ``keys`` it can serve by where it lies
        (:meth:`Remote.prefixes`); a node on its own answers for itself as ``""``."""
        self.checks.batch(len(keys), "keys")
        self.checks.keys(keys, "keys")
        if self.remote.active:
            return await self.remote.prefixes(ns, keys)
        return {"": dict(Counter(top_label(b.tiers) for b in self.index.leading_run(ns, keys)))}

    async def complete(self, ns: NsEntry, keys: Sequence[bytes]) -> tuple[NsEntry, list[Block]]:
        """The leading run of ``keys`` here, first completed from the rest of the cluster."""
        run = self.index.leading_run(ns, keys)
        if len(run) < len(keys) and self.remote.active:
            parent = keys[len(run) - 1] if run else b""
            # pinned while the rest is fetched: room for it (the tenant's quota) is not made of them
            with self.index.pinned(run):
                fetched = await self.remote.fetch(ns, keys[len(run) :], parent, len(run) + 1)
            if fetched:
                ns = self.index.live(ns)
                run = self.index.leading_run(ns, keys)
        return ns, run
