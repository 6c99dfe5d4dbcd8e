"""The blocking client offers the async client's calls, with the same parameters (names, kinds,
defaults, annotations), and so do their allocations and leases (``with`` for ``async with``):
adding a call or a parameter to one and not the other fails here."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from kvstore.client import Allocation, KVStoreClient, Lease, SyncAllocation, SyncClient, SyncLease

PAIRS = [(KVStoreClient, SyncClient), (Allocation, SyncAllocation), (Lease, SyncLease)]

# async name -> blocking name, where the two differ by convention. The async client is built from
# a URL by from_url (its constructor takes a grpc.aio channel), the blocking one by its constructor.
RENAMED = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__", "from_url": "__init__"}
CONTEXT = {"__aenter__", "__aexit__", "__enter__", "__exit__"}


def surface(cls: type) -> dict[str, Any]:
    """Public calls and properties and the context-manager methods, by the blocking class's names."""
    names = [n for n in dir(cls) if not n.startswith("_") or n in CONTEXT]
    return {RENAMED.get(n, n): inspect.getattr_static(cls, n) for n in names}


def parameters(member: Any) -> list[tuple[str, Any, Any, Any]]:
    """(name, kind, default, annotation) of every parameter but ``self`` / ``cls``; none for a property."""
    if isinstance(member, property):
        return []
    func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
    params = list(inspect.signature(func).parameters.values())
    if not isinstance(member, staticmethod):
        params = params[1:]
    return [(p.name, p.kind, p.default, p.annotation) for p in params]


def test_the_surface_is_what_we_think() -> None:
    calls = {n for n in surface(SyncClient) if not n.startswith("_")}
    assert calls == {
        "acquire", "acquire_shards", "allocate", "close", "delete", "get_blocks", "hello", "lookup", "pipeline",
        "prefetch", "put_blocks", "release", "report", "retain", "stats", "transport", "wait_ready",
    }
    assert set(surface(SyncAllocation)) == {"__enter__", "__exit__", "abort", "commit", "slot_refs", "writable"}
    assert set(surface(SyncLease)) == {"__enter__", "__exit__", "verify"}


@pytest.mark.parametrize(("aio", "sync"), PAIRS, ids=[s.__name__ for _, s in PAIRS])
def test_blocking_and_async_offer_the_same_calls(aio: type, sync: type) -> None:
    a, s = surface(aio), surface(sync)
    if sync is SyncClient:  # built from a URL: SyncClient(url, ...) and KVStoreClient.from_url(url, ...)
        s["__init__"] = inspect.getattr_static(sync, "__init__")
    assert sorted(a) == sorted(s)
    for name in s:
        assert parameters(a[name]) == parameters(s[name]), f"{aio.__name__} / {sync.__name__}: {name}"
        assert isinstance(a[name], property) == isinstance(s[name], property), name
        assert not inspect.iscoroutinefunction(s[name]), f"{sync.__name__}.{name} must block, not be awaited"


@pytest.mark.parametrize(("aio", "sync"), PAIRS, ids=[s.__name__ for _, s in PAIRS])
def test_what_blocks_in_one_is_awaited_in_the_other(aio: type, sync: type) -> None:
    """A call that talks to the sidecar is a coroutine on the async side; the rest (allocate and
    acquire hand back context managers, writable / slot_refs / verify read local state) are not."""
    local_only = {"allocate", "acquire", "writable", "slot_refs", "verify", "transport", "__init__"}
    for name, member in surface(aio).items():
        if name in local_only or name not in surface(sync):
            continue
        assert inspect.iscoroutinefunction(member), f"{aio.__name__}.{name} must be a coroutine"
