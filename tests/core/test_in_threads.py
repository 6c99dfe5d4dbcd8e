"""kvstore.util.threads.in_threads: once it returns, no worker references the caller's buffers.

A ThreadPoolExecutor's worker drops its work item only after the item's future is done, so the
caller could resume while the worker still held the call and the views bound into it: a slab
closed right after an Acquire's hashing (dram.verify_local_reads) kept its mapping exported, and
the segment's SharedMemory.__del__ later failed "cannot close exported pointers exist". Here an
executor that keeps every call it ran, for as long as it lives, stands for that worker."""

from __future__ import annotations

import asyncio
import functools
import gc
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from kvstore.checksum import checksum
from kvstore.util.threads import in_threads


class KeepingExecutor(ThreadPoolExecutor):
    """A pool that keeps a reference to every call submitted to it, and to its arguments (as a
    worker's work item does)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.kept: list[Callable[..., Any]] = []
        self.kept_args: list[tuple[Any, ...]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.kept.append(fn)
        self.kept_args.append((args, kwargs))
        return super().submit(fn, *args, **kwargs)


def _sums(views: list[np.ndarray]) -> list[int]:
    return [checksum(v) for v in views]


async def test_the_buffers_handed_to_threads_are_let_go_when_it_returns() -> None:
    shm = shared_memory.SharedMemory(name=f"kvstore-test-{uuid.uuid4().hex[:8]}", create=True, size=1 << 16)
    try:
        mem = np.frombuffer(shm.buf, dtype=np.uint8)
        mem[:] = 7
        views = [mem[i : i + 4096] for i in range(0, 1 << 16, 4096)]
        with KeepingExecutor() as pool:
            parts = await in_threads(pool, [functools.partial(_sums, views[:8]), functools.partial(_sums, views[8:])])
            assert [c for part in parts for c in part] == [checksum(np.full(4096, 7, np.uint8))] * 16
            assert len(pool.kept) == 2
            del mem, views
            shm.close()  # raises BufferError while any view of the mapping is referenced
    finally:
        shm.unlink()


async def test_the_slots_handed_to_a_peer_io_thread_are_let_go_when_blocking_returns() -> None:
    """The same for the peer data path's I/O pools (kvstore.wire.peer.blocking): a fetch's
    thread reads the holder's answer straight into the slab's slots, an answer's thread sends from
    them; it used to submit the call and its views to the pool as they were."""
    from kvstore.wire import peer as peer_wire

    shm = shared_memory.SharedMemory(name=f"kvstore-test-{uuid.uuid4().hex[:8]}", create=True, size=1 << 16)
    a, b = socket.socketpair()
    try:
        a.sendall(b"\7" * 4096)
        slot = memoryview(shm.buf)[4096:8192]
        with KeepingExecutor() as pool:
            await peer_wire.blocking(b, pool, peer_wire.recv_into_all, b, slot)
            assert bytes(shm.buf[4096:8192]) == b"\7" * 4096
            assert len(pool.kept) == 1
            del slot  # (not released: a view the worker still referenced would keep the mapping exported)
            shm.close()  # raises BufferError while any view of the mapping is referenced
    finally:
        a.close()
        b.close()
        shm.unlink()


def _stalled(sock: socket.socket, slot: memoryview) -> None:
    from kvstore.wire import peer as peer_wire

    raise peer_wire.PeerStalled("took no bytes")  # (an answer abandoned: its fetcher stopped reading)


async def test_the_slots_of_a_failed_peer_io_call_are_let_go_too() -> None:
    """And when the call fails. The error raised through ``blocking`` held its frame (the
    traceback), the frame the futures and they the error: a cycle that kept the call's views
    alive until the next garbage collection, so an answer abandoned because its fetcher stopped
    reading (kvstore.cluster.peer_server) kept its slots' views after its lease was released, and
    a sidecar stopped before a collection failed to release the slab's mapping."""
    from kvstore.wire import peer as peer_wire

    shm = shared_memory.SharedMemory(name=f"kvstore-test-{uuid.uuid4().hex[:8]}", create=True, size=1 << 16)
    a, b = socket.socketpair()
    collecting = gc.isenabled()
    gc.disable()  # (only reference counts free the views: what a collection would free is the defect)
    try:
        assert shm.buf is not None
        slot = shm.buf[4096:8192]
        with ThreadPoolExecutor(1) as pool:
            try:
                await peer_wire.blocking(a, pool, _stalled, a, slot)
                raise AssertionError("the call's error was not raised")
            except peer_wire.PeerStalled:
                pass  # (not pytest.raises: it keeps the error, and the error its traceback's frames)
            del slot
        # (the pool joined: its worker has let go of its work item, and the error with it; and a
        # loop turn: this step of the task began from the future that held the error)
        await asyncio.sleep(0)
        shm.close()  # raises BufferError while any view of the mapping is referenced
    finally:
        if collecting:
            gc.enable()
        a.close()
        b.close()
        shm.unlink()
