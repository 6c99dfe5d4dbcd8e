"""Scheduler side: decides, per request, how many leading tokens to load and which blocks to save.

``get_num_new_matched_tokens`` asks the sidecar (one batched Lookup, or Acquire: see
:mod:`connector.roles.finders`) how many leading blocks it has and where, and lets the cost
model choose how many are worth loading. After the engine has allocated blocks,
``update_state_after_alloc`` turns that into a :class:`LoadSpec`;
``schedule_save`` after prefill turns computed full blocks into a :class:`SaveSpec`. Each step,
``build_connector_meta`` hands everything queued to the worker side, once.

A sidecar that cannot be reached means "nothing cached": the request is recomputed, counted in
``stats`` and logged.

The lookup takes a lease (``lease_ttl_ms``) so the blocks stay put until the load acquires them;
it is released as soon as it is not needed: at once when nothing is loaded, when the worker
reports the load (``update_connector_output``), and at the latest on ``request_finished``. A lease
that says where the blocks lie (:class:`~connector.roles.finders.LeaseFinder`) moves into the
load's :class:`LoadSpec` instead: the worker reads the blocks under it and releases it.

Each request has a namespace: the connector's, or one the engine passes for it (``ns``: the
connector's with the request's ``cache_salt``, its tenant). Its keys, lookup, loads and saves all
use that one, so a request only ever finds blocks stored under its own namespace. A sharded
engine's further shards (``shards``) are the request's too: the engine's shard namespaces with the
request's salt, so a salted request finds, loads and saves every shard under its own tenant.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from connector.cost import CostModel, Decision
from connector.roles.block_ids import BlockIds
from connector.roles.client import ConnectorClient
from connector.roles.finders import Finder, Found, HeldLease, LookupFinder, Pending, ShardKeys
from connector.roles.metadata import (
    ConnectorMetadata,
    LoadResult,
    LoadSpec,
    Role,
    SaveSpec,
    ShardPart,
)
from connector.roles.ops import classify
from connector.roles.stats import ConnectorStats
from connector.transfer.layout import KVSpec
from kvstore.keys import BlockKey, Namespace, NamespaceRoot, PrefixKeys, prefix_keys

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    keys: list[BlockKey]
    tiers: list[str]
    decision: Decision | None
    computed_blocks: int
    load_blocks: int
    ns: Namespace
    lease: HeldLease | None = None
    others: tuple[HeldLease, ...] = ()  # the further shards' leases on the same blocks
    asked: tuple[ShardKeys, ...] = ()  # the further shards' keys


class SchedulerConnector:
    role = Role.SCHEDULER

    def __init__(
        self,
        client: ConnectorClient,
        ns: Namespace,
        spec: KVSpec,
        cost: CostModel | None = None,
        *,
        lease_ttl_ms: int = 30_000,
        finder: Finder | None = None,
        shards: Sequence[Namespace] = (),
        shard_groups: Sequence[int] = (),
    ) -> None:
        """Without a cost model every available block (bar the last token's) is loaded. The
        finder defaults to one Lookup per request (:class:`~connector.roles.finders.LookupFinder`).
        ``shards``: the namespaces of the engine's further shards (its other tensor-parallel ranks
        and pipeline stages; ``ns`` is shard 0's): a block is found only where every shard has it,
        in one round trip, and each load and save carries every shard's keys
        (:meth:`ConnectorMetadata.shard <connector.roles.metadata.ConnectorMetadata.shard>`).
        ``shard_groups``: for each further shard, the engine block table it moves (the index into
        the ``groups`` given to :meth:`update_state_after_alloc` and :meth:`schedule_save`: a hybrid
        model's KV-cache group, each with its own blocks); empty: every shard moves ``block_ids``."""
        if shard_groups and len(shard_groups) != len(shards):
            raise ValueError(f"shard_groups: one per further shard ({len(shards)}), got {len(shard_groups)}")
        for other in (ns, *shards):
            if other.block_size != spec.block_size or other.kv_layout != spec.layout:
                raise ValueError("namespace and KV spec disagree on block_size or kv_layout")
        self.client, self.ns, self.spec, self.cost = client, ns, spec, cost
        self.shards = tuple(shards)
        self.shard_groups = tuple(shard_groups)
        self.lease_ttl_ms = lease_ttl_ms
        self.finder: Finder = finder or LookupFinder(client)
        self.stats = ConnectorStats()
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._saving: dict[str, int] = {}  # req -> saves handed to the worker, not yet finished
        self._keys: dict[str, PrefixKeys] = {}  # req -> its keys so far (lookup, then each save)
        # req -> the further shards' keys, as _keys (under the root of the request's namespace)
        self._shard_keys: dict[str, tuple[NamespaceRoot, list[tuple[Namespace, PrefixKeys]]]] = {}
        self._extras: dict[str, Mapping[int, bytes]] = {}  # req -> block index -> extra key bytes (media)
        self._early: dict[str, Pending] = {}  # req -> its lookup, sent when the engine added it

    def keys(self, token_ids: Sequence[int] | np.ndarray) -> list[BlockKey]:
        return prefix_keys(self.ns, token_ids)

    def _request_keys(self, req_id: str, token_ids: Sequence[int] | np.ndarray, ns: Namespace) -> list[BlockKey]:
        """``prefix_keys(ns, token_ids)``, each block hashed once per request (its token ids only grow)."""
        keys = self._keys.get(req_id)
        if keys is None or keys.root != ns.root:
            keys = self._keys[req_id] = PrefixKeys(ns, self._extras.get(req_id))
        return keys.of(token_ids)

    def _shards(self, ns: Namespace) -> tuple[Namespace, ...]:
        """The further shards' namespaces of a request in ``ns`` (shard 0's): ``ns`` naming each of
        the engine's shards (:attr:`shards`: their ``rank``, ``world_size`` and ``revision``, a
        pipeline stage's layer range), so the request's own fields (its ``cache_salt``: its tenant)
        hold on every shard."""
        if not self.shards or ns == self.ns:
            return self.shards
        if (ns.rank, ns.world_size, ns.revision) != (self.ns.rank, self.ns.world_size, self.ns.revision):
            raise ValueError("a request's namespace names shard 0: rank, world_size and revision as the connector's")
        return tuple(replace(ns, rank=s.rank, world_size=s.world_size, revision=s.revision) for s in self.shards)

    def _others(self, req_id: str, token_ids: Sequence[int] | np.ndarray, ns: Namespace) -> list[ShardKeys]:
        """The further shards' keys of the request's full blocks (in ``ns``'s shards), as
        :meth:`_request_keys`."""
        if not self.shards:
            return []
        entry = self._shard_keys.get(req_id)
        if entry is None or entry[0] != ns.root:  # (keyed by the request's own namespace, shard 0's)
            extras = self._extras.get(req_id)  # a block's media are in every shard's key of it
            entry = self._shard_keys[req_id] = (ns.root, [(s, PrefixKeys(s, extras)) for s in self._shards(ns)])
        return [ShardKeys(shard, keys.of(token_ids)) for shard, keys in entry[1]]

    def set_extras(self, req_id: str, extras: Mapping[int, bytes]) -> None:
        """The extra bytes that go into the keys of the request's blocks (block index -> bytes:
        the multimodal items each overlaps), before its first lookup; kept until it finishes."""
        self._extras[req_id] = extras
        self._keys.pop(req_id, None)
        self._shard_keys.pop(req_id, None)

    def on_new_request(
        self, req_id: str, token_ids: Sequence[int] | np.ndarray, ns: Namespace | None = None
    ) -> None:
        """The engine has a new request and holds none of its blocks: its lookup is sent now (when
        the finder can send it ahead, :meth:`~connector.roles.finders.LeaseFinder.begin`), answered
        while the engine works on, and read by :meth:`get_num_new_matched_tokens`. Never raises:
        a lookup that cannot be sent is made then, as without this call. ``ns``: the request's
        namespace (None: the connector's)."""
        ns = ns or self.ns
        keys = self._request_keys(req_id, token_ids, ns)
        if not keys or req_id in self._early:
            return
        try:
            pending = self.finder.begin(ns, keys, 0, self.lease_ttl_ms, self._others(req_id, token_ids, ns))
        except Exception as exc:  # noqa: BLE001 - looked up again when the engine asks
            log.debug("early lookup %s: %s", req_id, exc)
            return
        if pending is not None:
            self._early[req_id] = pending

    def _found(self, req_id: str, keys: list[BlockKey], have: int, ns: Namespace, others: list[ShardKeys]) -> Found:
        """The request's blocks: from its early lookup (sent for all of them) when the engine
        holds none or the answer reaches past the engine's own ``have`` blocks, else looked up now
        from ``have`` on."""
        early = self._early.pop(req_id, None)
        if early is not None:
            try:
                found = early.result()
            except Exception as exc:  # noqa: BLE001 - ask again below
                log.info("early lookup %s: %s; looking up again", req_id, exc)
            else:
                if have == 0 or len(found.tiers) > have:
                    self.stats.add(early_lookups=1)
                    return found
                self._release(req_id, found.lease, *found.others)
        return self.finder.find(ns, keys, have, self.lease_ttl_ms, others)

    def _drop_early(self, req_id: str) -> None:
        early = self._early.pop(req_id, None)
        if early is not None:
            early.cancel()

    def get_num_new_matched_tokens(
        self, req_id: str, token_ids: Sequence[int] | np.ndarray, num_computed_tokens: int,
        ns: Namespace | None = None,
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` (the engine's own hits) to load from the sidecar,
        found in ``ns`` (the request's namespace; None: the connector's)."""
        bs = self.spec.block_size
        ns = ns or self.ns
        keys = self._request_keys(req_id, token_ids, ns)
        computed_blocks = num_computed_tokens // bs
        n_tokens = len(token_ids)
        self.stats.add(lookups=1, lookup_blocks=len(keys))
        tiers: list[str] = []
        sizes: list[int] = []
        lease: HeldLease | None = None
        others: tuple[HeldLease, ...] = ()
        asked = self._others(req_id, token_ids, ns)
        if len(keys) <= computed_blocks:
            self._drop_early(req_id)
        else:
            try:
                found = self._found(req_id, keys, computed_blocks, ns, asked)
                tiers, sizes, lease, others = list(found.tiers), list(found.sizes), found.lease, found.others
            except Exception as exc:  # noqa: BLE001 - unreachable sidecar: recompute
                reason = classify(exc)
                self.stats.failure("lookup", reason.value)
                log.warning("lookup %s: %s (%s); recomputing", req_id, reason.value, exc)
        self.stats.add(matched_blocks=len(tiers))
        decision = None
        if len(tiers) > computed_blocks:
            if self.cost is not None:
                decision = self.cost.choose_blocks(tiers, sizes, bs, n_tokens, num_computed_tokens)
                target = decision.blocks
            else:
                target = min(len(tiers), (n_tokens - 1) // bs)
        else:
            target = computed_blocks
        load_blocks = max(0, target - computed_blocks)
        self.stats.add(decided_load_blocks=load_blocks,
                       decided_recompute_blocks=max(0, len(tiers) - computed_blocks - load_blocks))
        if load_blocks == 0:  # declined: nothing to keep
            self._release(req_id, lease, *others)
            lease, others = None, ()
        with self._lock:
            old = self._requests.get(req_id)
            self._requests[req_id] = _Request(keys, tiers, decision, computed_blocks, load_blocks, ns, lease, others,
                                              tuple(asked))
        if old is not None:  # asked again (vLLM may re-ask a request that waited): the old lease goes
            self._release(req_id, old.lease, *old.others)
        return load_blocks * bs

    def _release(self, req_id: str, *leases: HeldLease | None) -> None:
        """End lookup leases (expiry is the fallback: a failure here is logged, never raised)."""
        release = getattr(self.client, "release", None)
        for lease in leases:
            if lease is None or not lease.id or release is None:  # (no id: places, not a lease)
                continue
            try:
                release(lease.id)
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own
                self.stats.failure("release", classify(exc).value)
                log.info("release lease of %s: %s", req_id, exc)

    def _take_leases(self, req_id: str) -> tuple[HeldLease | None, ...]:
        with self._lock:
            req = self._requests.get(req_id)
            if req is None:
                return ()
            leases, req.lease, req.others = (req.lease, *req.others), None, ()
        return leases

    def _group_ids(
        self, groups: Sequence[Sequence[int]], first: int, n: int
    ) -> tuple[BlockIds | None, ...]:
        """Each further shard's engine blocks ``[first, first + n)`` of its group's block table
        (None: the spec's own, without ``shard_groups``)."""
        if not self.shard_groups:
            return (None,) * len(self.shards)
        if len(groups) <= max(self.shard_groups):
            raise ValueError(f"{len(groups)} block tables given, shard_groups name {max(self.shard_groups) + 1}")
        return tuple(BlockIds(groups[g][first : first + n]) for g in self.shard_groups)

    def update_state_after_alloc(
        self, req_id: str, block_ids: Sequence[int], num_external_tokens: int, groups: Sequence[Sequence[int]] = (),
    ) -> None:
        """The engine allocated ``block_ids`` (the request's whole block table) for the request;
        ``groups``: every block table of a hybrid engine (``shard_groups``), ``block_ids`` the first."""
        if num_external_tokens <= 0:
            return
        with self._lock:
            req = self._requests[req_id]
            n = num_external_tokens // self.spec.block_size
            first = req.computed_blocks
            if n > req.load_blocks or len(block_ids) < first + n:
                raise ValueError(f"{req_id}: {n} blocks to load, {req.load_blocks} were offered")
            lease = None
            ids = self._group_ids(groups, first, n)
            parts = tuple(ShardPart(tuple(o.keys[first : first + n]), ns=o.ns, block_ids=b)
                          for o, b in zip(req.asked, ids))
            if req.lease is not None and req.lease.slots:  # the workers read under them, then end them
                lease, req.lease = req.lease.part(first, n), None
                parts = tuple(ShardPart(p.keys, o.part(first, n), p.ns, p.block_ids)
                              for p, o in zip(parts, req.others))
                req.others = ()
            self._loads.append(
                LoadSpec(
                    req_id=req_id,
                    keys=tuple(req.keys[first : first + n]),
                    block_ids=BlockIds(block_ids[first : first + n]),  # one array, handed to the engine as is
                    first_block=first,
                    block_size=self.spec.block_size,
                    tiers=tuple(req.tiers[first : first + n]),
                    decision_id=req.decision.id if req.decision else None,
                    lease=lease,
                    ns=req.ns,
                    others=parts,
                )
            )

    def schedule_save(
        self, req_id: str, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int],
        retain_ms: int | None = None, ns: Namespace | None = None, groups: Sequence[Sequence[int]] = (),
    ) -> int:
        """Store the full blocks of ``token_ids`` (computed KV in ``block_ids``; ``groups``: every
        block table of a hybrid engine, as :meth:`update_state_after_alloc`); returns their count.

        All full blocks are offered: the sidecar skips those it already has without a copy.
        ``retain_ms``: the request's retention hint, for all of them (connector/roles/hints.py).
        ``ns``: the request's namespace (None: the connector's).
        """
        ns = ns or self.ns
        keys = self._request_keys(req_id, token_ids, ns)[: len(block_ids)]
        if not keys:
            return 0
        ids = self._group_ids(groups, 0, len(keys))
        others = tuple(ShardPart(tuple(o.keys[: len(keys)]), ns=o.ns, block_ids=b)
                       for o, b in zip(self._others(req_id, token_ids, ns), ids))
        with self._lock:
            self._saves.append(SaveSpec(req_id, tuple(keys), BlockIds(block_ids[: len(keys)]), retain_ms, ns, others))
        return len(keys)

    def build_connector_meta(self) -> ConnectorMetadata:
        """Everything queued since the last step, exactly once."""
        with self._lock:
            meta = ConnectorMetadata(tuple(self._loads), tuple(self._saves))
            for s in self._saves:
                self._saving[s.req_id] = self._saving.get(s.req_id, 0) + 1
            self._loads, self._saves = [], []
        return meta

    def update_connector_output(
        self, finished_saving: Collection[str] = (), load_results: Sequence[LoadResult] = ()
    ) -> None:
        """What the worker side reported back (via the engine) after a step."""
        with self._lock:
            for r in finished_saving:
                self._saving.pop(r, None)
        for res in load_results:
            if res.failed_block_ids:
                self.stats.add(recomputed_after_failed_load_blocks=len(res.failed_block_ids))
            self._release(res.req_id, *self._take_leases(res.req_id))  # the load holds its own leases

    def request_finished(self, req_id: str) -> bool:
        """Forget the request. True: saves of its blocks are in flight, keep them until finished."""
        leases = self._take_leases(req_id)
        with self._lock:
            self._requests.pop(req_id, None)
            saving = req_id in self._saving
        self._keys.pop(req_id, None)
        self._shard_keys.pop(req_id, None)
        self._extras.pop(req_id, None)
        self._drop_early(req_id)
        self._release(req_id, *leases)
        return saving

    def matched_blocks(self, req_id: str) -> int:
        """Leading blocks the sidecar had for the request at lookup."""
        with self._lock:
            req = self._requests.get(req_id)
        return len(req.tiers) if req else 0

    def decision(self, req_id: str) -> Decision | None:
        with self._lock:
            req = self._requests.get(req_id)
        return req.decision if req else None
