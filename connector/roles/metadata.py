"""What flows from the scheduler side to the worker side each step, and what comes back.

Mirrors vLLM's ``KVConnectorBase_V1`` split: the scheduler side decides (which blocks of which
request to load or save, into which engine blocks) and packs that into one
:class:`ConnectorMetadata` per step; the worker side executes it and reports
:class:`LoadResult` / :class:`SaveResult` per request. Nothing flows the other way inside a step.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from connector.roles.block_ids import BlockIds
from connector.roles.finders import HeldLease
from kvstore.keys import BlockKey, Namespace


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True, frozen=True)
class ShardPart:
    """A further shard's part of a load or save (another tensor-parallel rank or pipeline stage of
    the engine, or another KV-cache group of a hybrid model, each with its own keys): its keys, for
    a load the lease on them, the request's namespace for that shard (the shard's, with the
    request's ``cache_salt``; None: the worker's), and the engine blocks it moves when they are not
    the spec's own (another KV-cache group's block table; None: the spec's ``block_ids``)."""

    keys: tuple[BlockKey, ...]
    lease: HeldLease | None = None
    ns: Namespace | None = None
    block_ids: Sequence[int] | None = None


@dataclass(slots=True, frozen=True)
class LoadSpec:
    """Load ``keys`` (consecutive prompt blocks from ``first_block``) into engine ``block_ids``
    (from the scheduler side a :class:`~connector.roles.block_ids.BlockIds`: one int64 array the
    worker hands to the transfer engine as it is; any sequence of ints is taken)."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: Sequence[int]
    first_block: int
    block_size: int
    tiers: tuple[str, ...] = ()  # where the sidecar said each block was, for the cost model
    decision_id: int | None = None
    lease: HeldLease | None = None  # where the blocks lie, leased: read them there, then release it
    ns: Namespace | None = None  # the request's namespace (its cache_salt's); None: the connector's
    others: tuple[ShardPart, ...] = ()  # shards 1.. of a sharded engine (keys and lease above: shard 0's)

    @property
    def first_token(self) -> int:
        return self.first_block * self.block_size

    def shard(self, i: int) -> LoadSpec:
        """What shard ``i`` loads: its keys, lease and namespace in ``keys``, ``lease`` and ``ns``."""
        if i == 0 or not self.others:
            return dataclasses.replace(self, others=()) if self.others else self
        part = self.others[i - 1]
        return dataclasses.replace(self, keys=part.keys, lease=part.lease, ns=part.ns, others=(),
                                   block_ids=self.block_ids if part.block_ids is None else part.block_ids)

    def tail(self, skip: int) -> LoadSpec:
        """The load without its first ``skip`` blocks (keys, engine blocks, tiers and lease from
        block ``first_block + skip`` on): what a sliding-window group loads of a longer prefix."""
        if skip <= 0:
            return self
        lease = self.lease
        if lease is not None and lease.slots:
            lease = lease.part(self.first_block + skip, len(self.keys) - skip)
        return dataclasses.replace(self, keys=self.keys[skip:], block_ids=self.block_ids[skip:],
                                   first_block=self.first_block + skip, tiers=self.tiers[skip:], lease=lease)


@dataclass(slots=True, frozen=True)
class SaveSpec:
    """Store engine ``block_ids`` under ``keys`` (a prompt's full blocks from its first block;
    ``block_ids`` as :class:`LoadSpec`'s)."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: Sequence[int]
    retain_ms: int | None = None  # the request's retention hint (connector/roles/hints.py): None, none; 0, end it
    ns: Namespace | None = None  # the request's namespace (its cache_salt's); None: the connector's
    others: tuple[ShardPart, ...] = ()  # shards 1.. of a sharded engine (keys above: shard 0's)

    def shard(self, i: int) -> SaveSpec:
        """What shard ``i`` saves: its keys and namespace in ``keys`` and ``ns``."""
        if i == 0 or not self.others:
            return dataclasses.replace(self, others=()) if self.others else self
        part = self.others[i - 1]
        return dataclasses.replace(self, keys=part.keys, ns=part.ns, others=(),
                                   block_ids=self.block_ids if part.block_ids is None else part.block_ids)

    def without(self, skip: frozenset[int]) -> SaveSpec:
        """The save without the blocks at positions ``skip`` (engine blocks a sliding-window group
        no longer holds)."""
        if not skip:
            return self
        keep = [i for i in range(len(self.keys)) if i not in skip]
        return dataclasses.replace(self, keys=tuple(self.keys[i] for i in keep),
                                   block_ids=BlockIds(self.block_ids).take(keep))


@dataclass(slots=True, frozen=True)
class ConnectorMetadata:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)

    def shard(self, i: int) -> ConnectorMetadata:
        """The step as shard ``i`` of a sharded engine executes it (its own keys and leases)."""
        return ConnectorMetadata(tuple(x.shard(i) for x in self.loads), tuple(x.shard(i) for x in self.saves))


class Failure(enum.Enum):
    """Why blocks were not loaded or saved. Every load failure means: recompute those tokens."""

    MISSING = "missing"  # evicted or never stored since the lookup
    CHECKSUM = "checksum"  # bytes did not match their checksum
    UNAVAILABLE = "unavailable"  # sidecar or tier unreachable
    FULL = "full"  # no room in the sidecar (saves)
    ERROR = "error"  # anything else (logged with a traceback)


@dataclass(slots=True, frozen=True)
class LoadResult:
    req_id: str
    loaded: int  # leading blocks of the spec now in the engine's cache
    failed_block_ids: tuple[int, ...]  # engine blocks whose tokens must be recomputed
    failure: Failure | None
    seconds: float
    nbytes: int

    @property
    def ok(self) -> bool:
        return not self.failed_block_ids


@dataclass(slots=True, frozen=True)
class SaveResult:
    req_id: str
    written: int  # blocks copied into the sidecar
    present: int  # blocks the sidecar already had
    failure: Failure | None
    seconds: float
    nbytes: int
    retained: int = 0  # with a retention hint: blocks the sidecar retains now
