"""How a load keeps its promise that a corrupted block never reaches a model (``verify_checksums``).

Two guards, one setting (``load_guard``) choosing between them:

- ``"read_only"`` (the default): a block is read from a slab this process maps read-only
  (:mod:`kvstore.dram.protect`): no thread of this process can write a sealed slot (a stray write
  faults), and every other way into a sealed slot is the sidecar's, which verifies what it did
  not write itself (a Commit's checksums, a promotion from SSD, Redis, S3 or a peer). The load
  copies without hashing. A slab this process cannot keep read-only (its sidecar runs in this
  process, or its slots are not whole OS pages) falls back to ``"hash"`` for the loads from it,
  and so does a slab whose sidecar has reclaimed an allocation unfinished
  (:func:`kvstore.dram.slab.reclaimed_in`): that writer, stalled past its ``ttl_ms``, may still
  hold its slots' pages writable and write them after they were handed out again and sealed;
  and so does a slab whose read-only mapping here lost track of its writable pages (an
  ``mprotect`` that failed: :attr:`kvstore.dram.protect.ReadOnlyMapping.intact`).
- ``"hash"``: every slot is hashed and checked against the checksum its lease carries before it
  is copied (:mod:`connector.roles.verified`).

With ``verify_checksums`` off, neither: the load copies what the slots hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from kvstore.dram.slab import read_only, reclaimed_in
from kvstore.errors import InvalidArgument

LoadGuard = Literal["read_only", "hash"]
GUARDS: tuple[LoadGuard, ...] = ("read_only", "hash")


def checked(guard: str) -> LoadGuard:
    """``guard`` when it is one of :data:`GUARDS`; else InvalidArgument naming the setting."""
    if guard not in GUARDS:
        raise InvalidArgument(f"load_guard: {guard!r} is not one of {list(GUARDS)}")
    return guard


def must_hash(guard: LoadGuard, segments: Iterable[str] | None) -> bool:
    """Whether a verified load of slots in ``segments`` (None: not known) hashes them: always
    under ``"hash"``; under ``"read_only"`` unless this process maps every one of them read-only
    (every mprotect of the mapping went through) and no allocation of theirs was reclaimed unfinished."""
    if guard == "hash" or segments is None:
        return True
    return not all((m := read_only(s)) is not None and m.intact and not reclaimed_in(s) for s in set(segments))


def in_force(guard: LoadGuard, segment: str | None) -> LoadGuard:
    """The guard a verified load from ``segment`` (the sidecar's slab; None: none on this host)
    actually runs under: what a worker reports at its start."""
    return "hash" if must_hash(guard, None if segment is None else [segment]) else guard
