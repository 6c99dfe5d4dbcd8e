"""What flows from the scheduler side to the worker side each step, and what comes back.

Mirrors vLLM's ``KVConnectorBase_V1`` split: the scheduler side decides (which blocks of which
request to load or save, into which engine blocks) and packs that into one
:class:`ConnectorMetadata` per step; the worker side executes it and reports
:class:`LoadResult` / :class:`SaveResult` per request. Nothing flows the other way inside a step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from connector.core.finders import HeldLease
from kvstore.keys import BlockKey, Namespace


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True, frozen=True)
class LoadSpec:
    """Load ``keys`` (consecutive prompt blocks from ``first_block``) into engine ``block_ids``."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    first_block: int
    block_size: int
    tiers: tuple[str, ...] = ()  # where the sidecar said each block was, for the cost model
    decision_id: int | None = None
    lease: HeldLease | None = None  # where the blocks lie, leased: read them there, then release it
    ns: Namespace | None = None  # the request's namespace (its cache_salt's); None: the connector's

    @property
    def first_token(self) -> int:
        return self.first_block * self.block_size


@dataclass(slots=True, frozen=True)
class SaveSpec:
    """Store engine ``block_ids`` under ``keys`` (a prompt's full blocks from its first block)."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    retain_ms: int | None = None  # the request's retention hint (connector/core/hints.py): None, none; 0, end it
    ns: Namespace | None = None  # the request's namespace (its cache_salt's); None: the connector's


@dataclass(slots=True, frozen=True)
class ConnectorMetadata:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


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
