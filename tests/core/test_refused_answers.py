"""An answer the client refuses (:meth:`kvstore.client.calls.Opened._fill`: INTERNAL naming the
field) still opened something on the sidecar: an Allocate's answer an allocation, its blocks' slots
reserved; an Acquire's answer a lease, its blocks pinned in DRAM. The client ends it at once (an
Abort, a Release), the blocking and the async one alike, rather than leave it to the sidecar's TTL
(30 s by default for either, far longer than the test): right after the refusal the sidecar holds no
open allocation and no lease, nothing expired or was reclaimed, and an Allocate's refusal counts one
more abort. The undo is best effort: where it fails (the test ended it already), the refusal is
still what is raised.

A ``kvstore serve`` process and the clients in this process. Each Allocate or Acquire goes to the
sidecar, which opens the allocation or lease; its answer is spoilt on the way back to the client, as
a faulty sidecar would have sent it."""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message

from kvstore.client import KVStoreClient, SyncClient
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, prefix_keys
from kvstore.v1 import kvstore_pb2 as pb

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="uint8", block_size=16)
KEYS = prefix_keys(NS, list(range(16 * 2)))
ARGS = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--dram-bytes", str(8 << 20)]
ENV = {"KVSTORE_SSD__ENABLED": "false"}

Spoil = Callable[[Any], None]


def _short(r: pb.AllocateResponse) -> None:
    del r.blocks[1]


def _long_slot(r: pb.AllocateResponse) -> None:
    r.blocks[1].slot.length = 8192


def _swapped(r: pb.AllocateResponse) -> None:
    r.blocks[0].key, r.blocks[1].key = r.blocks[1].key, r.blocks[0].key


def _short_lengths(r: pb.AcquireResponse) -> None:
    del r.lengths[1]


def _more_than_asked(r: pb.AcquireResponse) -> None:
    r.offsets.append(r.offsets[1])
    r.lengths.append(r.lengths[1])
    r.checksums.append(r.checksums[1])


def _no_segment(r: pb.AcquireResponse) -> None:
    r.segment = ""


def _past_the_end(r: pb.AcquireResponse) -> None:
    r.offsets[1] = 1 << 40


class Answer(NamedTuple):
    """An RPC whose answer opens something on the sidecar, and how this test spoils it."""

    rpc: str
    malformed: list[tuple[Spoil, str]]  # how the answer is spoilt, and the field its refusal names
    opened: Callable[[Any], str]  # the id of what the answer opened
    undo: Callable[[str], tuple[str, Message]]  # the call that ends it (the client's; the test's own first)
    enter: Callable[[Any], Any]  # client -> the allocation or lease whose entering sends rpc
    stored: int  # blocks put first, for it to answer with
    aborts: int  # aborts the sidecar counts for one refusal


ALLOCATE = Answer(
    "Allocate",
    [
        (_short, r"blocks has 1 entries for 2 blocks asked"),
        (_long_slot, r"blocks\[1\]\.slot\.length 8192 is not the size asked \(4096\)"),
        (_swapped, r"blocks\[0\]\.key is not the key asked"),
    ],
    operator.attrgetter("allocation_id"),
    lambda id_: ("Abort", pb.AbortRequest(allocation_id=id_)),
    lambda c: c.allocate(NS, KEYS[:2], 4096),
    stored=0,
    aborts=1,
)
ACQUIRE = Answer(
    "Acquire",
    [
        (_short_lengths, r"lengths has 1 entries for 2 offsets"),
        (_more_than_asked, r"offsets has 3 entries for 2 keys asked"),
        (_no_segment, r"segment: empty with blocks in the run"),
        (_past_the_end, r"offsets\[1\] 1099511627776 \+ lengths\[1\] 4096 is not within segment"),
    ],
    operator.attrgetter("lease_id"),
    lambda id_: ("Release", pb.ReleaseRequest(lease_id=id_)),
    lambda c: c.acquire(NS, KEYS[:2]),  # the default lease TTL: its expiry cannot be what ends it
    stored=2,
    aborts=0,
)
ANSWERS = pytest.mark.parametrize("answer", [ALLOCATE, ACQUIRE], ids=operator.attrgetter("rpc"))
ENDED_FIRST = pytest.mark.parametrize("ended_first", [False, True], ids=["undone", "undo-fails"])


def _spoilt(answer: Answer, r: Message, spoil: Spoil) -> Message:
    changed = type(r).FromString(r.SerializeToString())
    spoil(changed)
    assert answer.opened(changed)  # what the sidecar opened: the client's to end
    return changed


class Held(NamedTuple):
    """What the sidecar holds and counts."""

    allocations: int
    leases: int
    blocks: int
    aborted: int
    reclaimed: int  # allocations the TTL ended
    leases_expired: int  # leases the TTL ended


def _held(stats: dict[str, Any]) -> Held:
    return Held(stats["index"]["allocations"], stats["index"]["leases"], stats["index"]["blocks"],
                stats["writes"].get("aborted", 0), stats["writes"].get("reclaimed", 0),
                stats["reads"].get("leases_expired", 0))


def _after_refusal(answer: Answer, before: Held, after: Held) -> None:
    assert (after.allocations, after.leases) == (0, 0)  # ended now, by the client's undo: not left to the TTL
    assert after == before._replace(aborted=before.aborted + answer.aborts)


def _serve(serve_process: Callable[..., Any], tmp_path: Path) -> Any:
    return serve_process([*ARGS, "--data-dir", str(tmp_path / "d")], env=ENV)


def _blocks(answer: Answer) -> list[np.ndarray]:
    return [np.full(4096, i, np.uint8) for i in range(answer.stored)]


@ANSWERS
@ENDED_FIRST
def test_the_blocking_client_ends_what_an_answer_it_refuses_opened(
    serve_process: Callable[..., Any], tmp_path: Path, answer: Answer, ended_first: bool,
) -> None:
    """``ended_first``: the test ends what the answer opened before the client sees the answer,
    so the client's own undo fails (already aborted, or the lease unknown)."""
    sc = _serve(serve_process, tmp_path)
    with SyncClient(sc.grpc) as c:
        if answer.stored:
            c.put_blocks(NS, KEYS[: answer.stored], _blocks(answer))
        call = c._call
        for spoil, field in answer.malformed:

            def spoiling(name: str, request: Any, timeout: float | None = 30.0, spoil: Spoil = spoil) -> Any:
                r = call(name, request, timeout)
                if name != answer.rpc:
                    return r
                if ended_first:
                    call(*answer.undo(answer.opened(r)))
                return _spoilt(answer, r, spoil)

            before = _held(c.stats())
            c._call = spoiling  # type: ignore[method-assign]
            with pytest.raises(KVStoreError, match=field) as info, answer.enter(c):
                pytest.fail("a refused answer is not entered")
            c._call = call  # type: ignore[method-assign]
            assert info.value.code == grpc.StatusCode.INTERNAL  # the refusal, not the failed undo's error
            _after_refusal(answer, before, _held(c.stats()))


@ANSWERS
@ENDED_FIRST
async def test_the_async_client_ends_what_an_answer_it_refuses_opened(
    serve_process: Callable[..., Any], tmp_path: Path, answer: Answer, ended_first: bool,
) -> None:
    sc = _serve(serve_process, tmp_path)
    async with KVStoreClient.from_url(sc.grpc) as c:
        if answer.stored:
            await c.put_blocks(NS, KEYS[: answer.stored], _blocks(answer))
        call = c._call
        for spoil, field in answer.malformed:

            async def spoiling(name: str, request: Any, timeout: float | None = 30.0, spoil: Spoil = spoil) -> Any:
                r = await call(name, request, timeout)
                if name != answer.rpc:
                    return r
                if ended_first:
                    await call(*answer.undo(answer.opened(r)))
                return _spoilt(answer, r, spoil)

            before = _held(await c.stats())
            c._call = spoiling  # type: ignore[method-assign]
            with pytest.raises(KVStoreError, match=field) as info:
                async with answer.enter(c):
                    pytest.fail("a refused answer is not entered")
            c._call = call  # type: ignore[method-assign]
            assert info.value.code == grpc.StatusCode.INTERNAL  # the refusal, not the failed undo's error
            _after_refusal(answer, before, _held(await c.stats()))


# An answer naming a slab this process cannot map (a name it cannot open; the sidecar's 0600 slab
# seen by a client of another user, reaching it over TCP) fails in _fill with the mapping's own
# error, not a KVStoreError: the client cannot use what was opened either, so it is ended the same.
UNMAPPABLE = "kvstore-test-no-such-segment"


def _unmappable_slots(r: pb.AllocateResponse) -> None:
    for b in r.blocks:
        b.slot.segment = UNMAPPABLE


def _unmappable_run(r: pb.AcquireResponse) -> None:
    assert r.segment  # (the packed answer)
    r.segment = UNMAPPABLE


UNMAPPABLE_ANSWERS = pytest.mark.parametrize(
    ("answer", "spoil"), [(ALLOCATE, _unmappable_slots), (ACQUIRE, _unmappable_run)], ids=["Allocate", "Acquire"]
)


@UNMAPPABLE_ANSWERS
async def test_an_answer_whose_slab_cannot_be_mapped_is_ended_too(
    serve_process: Callable[..., Any], tmp_path: Path, answer: Answer, spoil: Spoil,
) -> None:
    sc = _serve(serve_process, tmp_path)
    with SyncClient(sc.grpc) as c:
        if answer.stored:
            c.put_blocks(NS, KEYS[: answer.stored], _blocks(answer))
        call = c._call

        def spoiling(name: str, request: Any, timeout: float | None = 30.0) -> Any:
            r = call(name, request, timeout)
            return _spoilt(answer, r, spoil) if name == answer.rpc else r

        before = _held(c.stats())
        c._call = spoiling  # type: ignore[method-assign]
        with pytest.raises(FileNotFoundError), answer.enter(c):  # (the mapping's error, as it was raised)
            pytest.fail("a refused answer is not entered")
        c._call = call  # type: ignore[method-assign]
        _after_refusal(answer, before, _held(c.stats()))

    async with KVStoreClient.from_url(sc.grpc) as ac:
        acall = ac._call

        async def aspoiling(name: str, request: Any, timeout: float | None = 30.0) -> Any:
            r = await acall(name, request, timeout)
            return _spoilt(answer, r, spoil) if name == answer.rpc else r

        before = _held(await ac.stats())
        ac._call = aspoiling  # type: ignore[method-assign]
        with pytest.raises(FileNotFoundError):
            async with answer.enter(ac):
                pytest.fail("a refused answer is not entered")
        ac._call = acall  # type: ignore[method-assign]
        _after_refusal(answer, before, _held(await ac.stats()))
