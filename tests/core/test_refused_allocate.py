"""An Allocate answer the client refuses (:meth:`kvstore.client.wire.AllocationState._fill`: INTERNAL
naming the field) still opened an allocation on the sidecar, its blocks' slots reserved. The client
aborts it at once, the blocking and the async one alike, rather than leave it to the sidecar's TTL
(30 s here, far longer than the test): right after the refusal the sidecar holds no open allocation
and no block, and counts one more abort. The Abort is best effort: where it fails (the allocation
was ended already), the refusal is still what is raised.

A ``kvstore serve`` process and the clients in this process. Each Allocate goes to the sidecar,
which opens the allocation; its answer is spoilt on the way back to the client, as a faulty sidecar
would have sent it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import KVStoreClient, SyncClient
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, prefix_keys
from kvstore.v1 import kvstore_pb2 as pb

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="uint8", block_size=16)
KEYS = prefix_keys(NS, list(range(16 * 2)))
ARGS = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--dram-bytes", str(8 << 20)]
ENV = {"KVSTORE_SSD__ENABLED": "false"}


def _short(r: pb.AllocateResponse) -> None:
    del r.blocks[1]


def _long_slot(r: pb.AllocateResponse) -> None:
    r.blocks[1].slot.length = 8192


def _swapped(r: pb.AllocateResponse) -> None:
    r.blocks[0].key, r.blocks[1].key = r.blocks[1].key, r.blocks[0].key


# How the answer is spoilt, and the field its refusal names.
MALFORMED: list[tuple[Callable[[pb.AllocateResponse], None], str]] = [
    (_short, r"blocks has 1 entries for 2 blocks asked"),
    (_long_slot, r"blocks\[1\]\.slot\.length 8192 is not the size asked \(4096\)"),
    (_swapped, r"blocks\[0\]\.key is not the key asked"),
]


def _spoilt(r: pb.AllocateResponse, spoil: Callable[[pb.AllocateResponse], None]) -> pb.AllocateResponse:
    changed = pb.AllocateResponse.FromString(r.SerializeToString())
    spoil(changed)
    assert changed.allocation_id  # the allocation the sidecar opened: the client's to abort
    return changed


def _held(stats: dict[str, Any]) -> tuple[int, int, int, int]:
    """(open allocations, blocks, aborted, reclaimed by the TTL), as the sidecar counts them."""
    return (stats["index"]["allocations"], stats["index"]["blocks"], stats["writes"].get("aborted", 0),
            stats["writes"].get("reclaimed", 0))


def _serve(serve_process: Callable[..., Any], tmp_path: Path) -> Any:
    return serve_process([*ARGS, "--data-dir", str(tmp_path / "d")], env=ENV)


@pytest.mark.parametrize("ended_first", [False, True], ids=["aborted", "abort-fails"])
def test_the_blocking_client_aborts_the_allocation_of_an_answer_it_refuses(
    serve_process: Callable[..., Any], tmp_path: Path, ended_first: bool,
) -> None:
    """``ended_first``: the allocation is aborted before the client sees the answer, so the
    client's own Abort fails (FAILED_PRECONDITION: already aborted)."""
    sc = _serve(serve_process, tmp_path)
    with SyncClient(sc.grpc) as c:
        call = c._call
        for spoil, field in MALFORMED:

            def spoiling(name: str, request: Any, timeout: float | None = 30.0,
                         spoil: Callable[[pb.AllocateResponse], None] = spoil) -> Any:
                r = call(name, request, timeout)
                if name != "Allocate":
                    return r
                if ended_first:
                    call("Abort", pb.AbortRequest(allocation_id=r.allocation_id))
                return _spoilt(r, spoil)

            aborted = _held(c.stats())[2]
            c._call = spoiling  # type: ignore[method-assign]
            with pytest.raises(KVStoreError, match=field) as info, c.allocate(NS, KEYS[:2], 4096):
                pytest.fail("a refused answer is not entered")
            c._call = call  # type: ignore[method-assign]
            assert info.value.code == grpc.StatusCode.INTERNAL  # the refusal, not the failed Abort's error
            assert _held(c.stats()) == (0, 0, aborted + 1, 0)  # ended now, by one Abort: not left to the TTL


@pytest.mark.parametrize("ended_first", [False, True], ids=["aborted", "abort-fails"])
async def test_the_async_client_aborts_the_allocation_of_an_answer_it_refuses(
    serve_process: Callable[..., Any], tmp_path: Path, ended_first: bool,
) -> None:
    sc = _serve(serve_process, tmp_path)
    async with KVStoreClient.from_url(sc.grpc) as c:
        call = c._call
        for spoil, field in MALFORMED:

            async def spoiling(name: str, request: Any, timeout: float | None = 30.0,
                               spoil: Callable[[pb.AllocateResponse], None] = spoil) -> Any:
                r = await call(name, request, timeout)
                if name != "Allocate":
                    return r
                if ended_first:
                    await call("Abort", pb.AbortRequest(allocation_id=r.allocation_id))
                return _spoilt(r, spoil)

            aborted = _held(await c.stats())[2]
            c._call = spoiling  # type: ignore[method-assign]
            with pytest.raises(KVStoreError, match=field) as info:
                async with c.allocate(NS, KEYS[:2], 4096):
                    pytest.fail("a refused answer is not entered")
            c._call = call  # type: ignore[method-assign]
            assert info.value.code == grpc.StatusCode.INTERNAL  # the refusal, not the failed Abort's error
            assert _held(await c.stats()) == (0, 0, aborted + 1, 0)  # ended now, by one Abort: not left to the TTL
