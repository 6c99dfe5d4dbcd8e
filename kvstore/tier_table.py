"""The one table of tier facts: a tier is its backend module plus one row here.

Each row says what the rest of kvstore knows of a tier: its name (the config's chain, the stats'
labels, a tenant quota's key), its placement bit (:attr:`kvstore.store.books.index.Block.tiers`), its
value in a Lookup's ``tiers`` bytes (the proto's ``Tier`` enum for the tiers the proto names),
its backend (``(module, class)``, imported only when the tier is selected: :mod:`kvstore.tiers`),
whether every node of a cluster reaches it (a shared tier's copy is adopted, not fetched), whether
it may be a write-through level, and the priors of routing (:mod:`kvstore.routing`) and of the
connector's cost model (``connector/cost.py``). Everything that branches on tiers iterates the
table instead: the index's fastest-tier lookups, the movers' levels, the config's chain,
write-through and per-tier tenant quotas, the stats, the audit, the wire and the cluster's
shared mask.

The rows are fastest first; :func:`register` appends one (slowest) and rebuilds the derived
lookups in place, so a module that imported them sees the new row. Register a tier before its
configuration is loaded and its store started (a test module does, for a throwaway tier).
Imports nothing: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 1e6
PEER = "peer"  # not a tier: another node's copy (DRAM or SSD) over the peer data path
PEER_PROTO = 5  # the proto's TIER_PEER (a Lookup's peer_tiers say where the other node holds it)
PEER_ROUTE_WEIGHT = 0.5  # another node's DRAM or SSD, over the network (assumption)
PEER_LOAD_COST = (1000 * MB, 0.002)  # another node's DRAM or SSD over the peer data path (kvstore/cluster/)


@dataclass(frozen=True, slots=True)
class TierRow:
    name: str  # lowercase: the config's chain, the stats' label, the tenants' quota key
    bit: int  # placement bit (a power of two); the order of the rows is the order of the tiers
    proto: int  # its value in a Lookup's tiers bytes (the proto's Tier enum where it names one)
    backend: tuple[str, str] | None = None  # (module, class) of its kvstore.tiers.base.Tier; None: DRAM
    shared: bool = False  # every node of a cluster reaches it (a copy there is adopted, not fetched)
    write_through: bool = False  # may be a write-through level (tiering.write_through)
    route_weight: float = 0.25  # a block's worth in a node's routing score (kvstore.routing)
    load_cost: tuple[float, float] = (100 * MB, 0.03)  # the cost model's prior: bytes/s, seconds per transfer

    @property
    def label(self) -> str:
        return self.name

    def __int__(self) -> int:
        return self.bit


DRAM_ROW = TierRow("dram", 1, 1, route_weight=1.0, load_cost=(4000 * MB, 0.0005))
ROWS: list[TierRow] = [
    DRAM_ROW,  # kvstore's top tier (host memory): routing's unit
    TierRow("ssd", 2, 2, ("kvstore.tiers.ssd", "SsdTier"),
            route_weight=0.25 / 0.75, load_cost=(1000 * MB, 0.002)),  # Dynamo: disk 0.25 vs host memory 0.75
    TierRow("redis", 4, 3, ("kvstore.tiers.redis", "RedisTier"), shared=True, write_through=True,
            route_weight=0.5, load_cost=(500 * MB, 0.002)),  # shared: equal for every node (assumption)
    TierRow("s3", 8, 4, ("kvstore.tiers.s3", "S3Tier"), shared=True, write_through=True,
            route_weight=0.25, load_cost=(100 * MB, 0.03)),
]

BUILT_IN = len(ROWS)  # the rows above; register() adds after them

# Derived from ROWS, rebuilt in place by register() (the same objects stay imported everywhere).
BY_NAME: dict[str, TierRow] = {}
NAMES: list[str] = []  # every tier, fastest first
BIT_NAMES: list[tuple[int, str]] = []  # (bit, name) of every tier, fastest first (plain ints for hot loops)
LOWER: list[str] = []  # the tiers below DRAM (a backend each): the default chain
TOP_TIER: list[int] = []  # placement mask -> the bit of its fastest tier (0: none)
TOP_LABEL: list[str] = []  # placement mask -> the name of its fastest tier ("none")
TOP_PROTO: list[int] = []  # placement mask -> its fastest tier's proto value (0: unspecified)
PROTO_NAMES: dict[int, str] = {}  # proto value -> name, the peer's included
ROUTE_WEIGHTS: dict[str, float] = {}  # name -> route_weight, the peer's included
LOAD_COSTS: dict[str, tuple[float, float]] = {}  # name -> load_cost, the peer's included


def _rebuild() -> None:
    BY_NAME.clear()
    BY_NAME.update((r.name, r) for r in ROWS)
    NAMES[:] = [r.name for r in ROWS]
    BIT_NAMES[:] = [(r.bit, r.name) for r in ROWS]
    LOWER[:] = [r.name for r in ROWS if r.backend is not None]
    masks = range(1 << max(r.bit for r in ROWS).bit_length())
    top = [next((r for r in ROWS if m & r.bit), None) for m in masks]
    TOP_TIER[:] = [r.bit if r else 0 for r in top]
    TOP_LABEL[:] = [r.name if r else "none" for r in top]
    TOP_PROTO[:] = [r.proto if r else 0 for r in top]
    PROTO_NAMES.clear()
    PROTO_NAMES.update({r.proto: r.name for r in ROWS} | {PEER_PROTO: PEER})
    ROUTE_WEIGHTS.clear()
    ROUTE_WEIGHTS.update({r.name: r.route_weight for r in ROWS} | {PEER: PEER_ROUTE_WEIGHT})
    LOAD_COSTS.clear()
    LOAD_COSTS.update({r.name: r.load_cost for r in ROWS} | {PEER: PEER_LOAD_COST})


def all_bits() -> int:
    """Every tier's bit together."""
    return sum(r.bit for r in ROWS)


def shared_bits() -> int:
    """The bits of the tiers every node of a cluster reaches (a node's SSD is its own)."""
    return sum(r.bit for r in ROWS if r.shared)


def row(name: str) -> TierRow:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r} (known: {', '.join(NAMES)})") from None


def register(new: TierRow) -> None:
    """Add a tier below the others. Its name, bit and proto value must be new, the bit the next
    power of two, and it must have a backend."""
    if new.name in BY_NAME or new.name == PEER or new.name != new.name.lower():
        raise ValueError(f"tier name {new.name!r}: taken or not lowercase (taken: {', '.join(NAMES)}, {PEER})")
    if new.bit != 1 << len(ROWS):
        raise ValueError(f"tier {new.name!r}: bit {new.bit} is not the next one ({1 << len(ROWS)})")
    if new.proto in PROTO_NAMES or new.proto <= 0 or new.proto > 255:
        raise ValueError(f"tier {new.name!r}: proto value {new.proto} is taken or not a byte > 0")
    if new.backend is None:
        raise ValueError(f"tier {new.name!r}: a tier below DRAM needs a backend (module, class)")
    ROWS.append(new)
    _rebuild()


def unregister(name: str) -> None:
    """Take the last registered tier out again (a test's throwaway tier)."""
    if not ROWS or ROWS[-1].name != name or len(ROWS) <= BUILT_IN:
        raise ValueError(f"tier {name!r}: only the last registered tier may be taken out")
    ROWS.pop()
    _rebuild()


_rebuild()
