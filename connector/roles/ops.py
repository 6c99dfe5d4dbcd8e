"""One request's block transfers: load (acquire -> scatter -> release), save (allocate -> gather ->
commit). Synchronous building blocks used by the worker side and by the transformers adapter.

Failures never raise: a load that cannot complete reports the engine blocks to recompute, a save
that cannot complete is dropped. Both are logged and carry a :class:`Failure` reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import grpc

from connector.roles.block_directory import BlockDirectory, epoch_of
from connector.roles.block_ids import ids_array
from connector.roles.client import AllocationLike, ConnectorClient, PlacedAllocationLike
from connector.roles.finders import HeldLease
from connector.roles.guard import LoadGuard, must_hash
from connector.roles.metadata import Failure, LoadResult, LoadSpec, SaveResult, SaveSpec
from connector.roles.verified import scatter_verified
from connector.transfer.engines import BlockIdsLike, PagedKV, Transfer
from kvstore.client.calls import mapped_views
from kvstore.errors import (
    ChecksumMismatch,
    KVStoreError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvstore.keys import Namespace

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 1.0  # a held lease this close to its end is not trusted: the blocks are acquired anew


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, ChecksumMismatch):
        return Failure.CHECKSUM
    if isinstance(exc, NotFound):
        return Failure.MISSING
    if isinstance(exc, ResourceExhausted):
        return Failure.FULL
    if isinstance(exc, (Unavailable, ConnectionError, TimeoutError, grpc.RpcError)):
        return Failure.UNAVAILABLE
    if isinstance(exc, KVStoreError) and exc.retryable:
        return Failure.UNAVAILABLE
    return Failure.ERROR


@dataclass(slots=True)
class _Held:
    views: list[Any]
    checksums: list[int]
    slots: list[Any]


@contextmanager
def _read_held(lease: HeldLease) -> Iterator[_Held]:
    """The blocks of a lease the scheduler took, mapped from the sidecar's shared memory."""
    yield _Held(mapped_views(lease.slots), list(lease.checksums), list(lease.slots))


def _segments(lease: Any, n: int) -> list[str] | None:
    """The segments the first ``n`` slots of ``lease`` lie in; None when it does not say."""
    slots = getattr(lease, "slots", None)
    return None if slots is None else [s.segment for s in slots[:n]]


def _blocks(client: ConnectorClient, ns: Namespace, spec: LoadSpec) -> tuple[AbstractContextManager[Any], int | None]:
    """Where the load reads: under the lease the scheduler handed over while it holds, or at the
    places the engine's directory gave while the slab's free epoch has not moved (then the epoch
    is returned too: it must not move during the copy either), else under a new lease (one round
    trip)."""
    lease = spec.lease
    if lease is not None and len(lease.slots) == len(spec.keys):
        if lease.epoch is not None:
            if epoch_of(lease.slots[0].segment) == lease.epoch:
                return _read_held(lease), lease.epoch
        elif time.monotonic() < lease.deadline - LEASE_MARGIN_S:
            return _read_held(lease), None
    return client.acquire(ns, list(spec.keys)), None


def load_blocks(
    client: ConnectorClient,
    ns: Namespace,
    kv: PagedKV,
    transfer: Transfer,
    spec: LoadSpec,
    *,
    verify: bool = True,
    guard: LoadGuard = "read_only",
) -> LoadResult:
    """Fill ``spec.block_ids`` from the sidecar; the leading run that arrives intact is kept.

    With ``verify``, no corrupted block is copied, under ``guard`` (:mod:`connector.roles.guard`:
    a slab this process maps read-only is trusted under ``"read_only"``). Blocks it hashes are
    checked against the lease's checksums (0, not sealed yet, passes) each before its copy
    (:mod:`connector.roles.verified`): the first mismatch and everything after it is never copied
    and is reported for recompute. A lease handed over in ``spec.lease`` is read under, not ended.
    """
    t0 = time.perf_counter()
    loaded, failure = 0, None
    try:
        source, epoch = _blocks(client, ns, spec)
        with source as lease:
            views = lease.views[: len(spec.keys)]  # a slice: SlotViews stay SlotViews (addresses known)
            n = len(views)
            if n < len(spec.keys):
                failure = Failure.MISSING
                log.info(
                    "load %s: %d of %d blocks gone since lookup; recomputing them",
                    spec.req_id,
                    len(spec.keys) - n,
                    len(spec.keys),
                )
            sums = getattr(lease, "checksums", None) if verify and must_hash(guard, _segments(lease, n)) else None
            bad = _copy_in(transfer, kv, ids_array(spec.block_ids)[:n], views, sums)  # the spec's array, no copy
            if bad is not None:
                n, failure = bad, Failure.CHECKSUM
                log.warning(
                    "load %s: block %d failed its checksum; recomputing from it", spec.req_id, spec.first_block + bad
                )
            loaded = n
            # (an epoch comes only with a read at the places of spec.lease)
            if epoch is not None and spec.lease is not None and epoch_of(spec.lease.slots[0].segment) != epoch:
                # a slot was freed while it was copied, so it may have been rewritten: trust none
                loaded, failure = 0, Failure.MISSING
                log.info(
                    "load %s: the sidecar freed slots during an unleased copy; recomputing %d blocks", spec.req_id, n
                )
    except Exception as exc:  # any failure means recompute, never wrong output (logged below)
        loaded, failure = 0, classify(exc)
        log.warning("load %s: %s (%s); recomputing %d blocks", spec.req_id, failure.value, exc, len(spec.keys),
                    exc_info=failure is Failure.ERROR)
    return LoadResult(
        req_id=spec.req_id,
        loaded=loaded,
        failed_block_ids=tuple(spec.block_ids[loaded:]),
        failure=failure,
        seconds=time.perf_counter() - t0,
        nbytes=loaded * kv.spec.block_bytes,
    )


def _copy_in(
    transfer: Transfer, kv: PagedKV, block_ids: BlockIdsLike, views: Sequence[Any], sums: Sequence[int] | None
) -> int | None:
    """Copy ``views`` into ``block_ids`` before the lease ends. With ``sums`` (verifying), each chunk
    is checked before its copy, hashed during the last one's: the index of the first block that
    failed (nothing from it on copied), else None."""
    if sums is not None:
        return scatter_verified(transfer, kv, block_ids, views, sums[: len(views)])
    transfer.scatter(kv, block_ids, views).wait()
    return None


def _placed(alloc: AllocationLike) -> PlacedAllocationLike | None:
    """``alloc`` when it says where its slots lie (the real client's; test doubles need not)."""
    return cast(PlacedAllocationLike, alloc) if hasattr(alloc, "slot_refs") else None


def _free_epoch_before_commit(alloc: PlacedAllocationLike, pairs: list[tuple[int, Any]]) -> int | None:
    """The slab's free epoch before the Commit: until then the slots are the allocation's, so any
    free after it (even of these blocks, right after their commit) moves the epoch."""
    refs = alloc.slot_refs()
    return epoch_of(refs[pairs[0][0]].segment) if pairs and pairs[0][0] in refs else None


def save_blocks(
    client: ConnectorClient, ns: Namespace, kv: PagedKV, transfer: Transfer, spec: SaveSpec,
    directory: BlockDirectory | None = None, *, wait_published: bool = False, wait_write_through: bool = False,
) -> SaveResult:
    """Store ``spec.block_ids`` under ``spec.keys``; blocks the sidecar already has are skipped.
    With a ``directory``, the written blocks' places and checksums are remembered in it.
    ``wait_published``: the Commit returns once the cluster directory lists the blocks (every node
    of the cluster finds them; at once on a sidecar without a cluster); ``wait_write_through``:
    once the write-through tiers (Redis, S3) hold them."""
    flags = {k: True for k, on in (("wait_published", wait_published), ("wait_write_through", wait_write_through))
             if on}
    t0 = time.perf_counter()
    size = kv.spec.block_bytes
    written = present = 0
    failure = None
    try:
        if len(spec.block_ids) != len(spec.keys):  # before any state changes: nothing allocated
            raise ValueError(f"save {spec.req_id}: {len(spec.block_ids)} block_ids for {len(spec.keys)} keys")
        with client.allocate(ns, list(spec.keys), [size] * len(spec.keys)) as alloc:
            pairs = list(alloc.writable(cpu=not transfer.pins_host))  # (a device's DMA: no CPU write)
            ids = ids_array(spec.block_ids)  # the spec's array, no copy
            if len(pairs) < len(ids):  # (the indices increase: all of them is every position in order)
                ids = ids[[i for i, _ in pairs]]
            transfer.gather(kv, ids, [v for _, v in pairs]).wait()
            placed = _placed(alloc) if directory is not None else None
            epoch = _free_epoch_before_commit(placed, pairs) if placed is not None else None
            if directory is None or placed is None or epoch is None:
                alloc.commit(**flags)
            else:  # the checksums go with the Commit (the sidecar verifies them) and into the directory
                placed.commit(checksums=True, **flags)
                refs = placed.slot_refs()
                directory.learn(
                    [spec.keys[i] for i, _ in pairs],
                    [refs[i] for i, _ in pairs],
                    [placed.checksums[i] for i, _ in pairs],
                    epoch,
                )
            written, present = len(pairs), len(spec.keys) - len(pairs)
    except Exception as exc:  # a lost save costs a future recompute, nothing more (logged below)
        failure = classify(exc)
        log.warning("save %s: %s (%s); %d blocks not stored", spec.req_id, failure.value, exc, len(spec.keys),
                    exc_info=failure is Failure.ERROR)
    # A hint to retain follows a save that stood; an end (0) is sent however the save went: the
    # turn it ends does not depend on this one's blocks.
    end = spec.retain_ms == 0
    retained = _retain(client, ns, spec) if end or (spec.retain_ms and failure is None) else 0
    return SaveResult(
        req_id=spec.req_id,
        written=written,
        present=present,
        failure=failure,
        seconds=time.perf_counter() - t0,
        nbytes=written * size,
        retained=retained,
    )


def _retain(client: ConnectorClient, ns: Namespace, spec: SaveSpec) -> int:
    """Retain every block of a saved spec (written now or there already) for its hint, or end
    their retention (a hint of 0); how many the sidecar retains. A refused hint (the tenant's
    bound) is logged and costs the save nothing."""
    assert spec.retain_ms is not None
    try:
        found = client.retain(ns, list(spec.keys), spec.retain_ms)
        return found if spec.retain_ms else 0
    except Exception as exc:
        what = f"retention hint of {spec.retain_ms} ms not taken" if spec.retain_ms else "retention not ended"
        log.warning("save %s: %s: %s", spec.req_id, what, exc, exc_info=classify(exc) is Failure.ERROR)
        return 0
