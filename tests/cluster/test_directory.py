"""The directory's scripts on a real redis-server and a real 3-node Redis Cluster: a deletion
removes only the record it read (FORGET), and a heartbeat that renews a lease which had run out
gives the node a new incarnation (HEARTBEAT)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis, RedisCluster

from kvstore.cluster.directory import Directory, Record
from kvstore.harness.servers import redis_cluster, redis_server


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def directory_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    if request.param == "redis":
        with redis_server() as server:
            yield server.url, False
    else:
        with redis_cluster(3) as cluster:
            yield cluster.url, True


@pytest.fixture
async def directory(directory_url: tuple[str, bool], request: pytest.FixtureRequest) -> AsyncIterator[Directory]:
    url, clustered = directory_url
    client = RedisCluster.from_url(url) if clustered else Redis.from_url(url)
    d = Directory(client, f"t{abs(hash(request.node.nodeid)) % 10**8}", "x")
    try:
        yield d
    finally:
        await d.close()


ROOT = bytes(range(16))


async def test_forget_deletes_only_the_record_it_read(directory: Directory) -> None:
    keys = [bytes([i]) * 32 for i in range(8)]  # spread over the cluster's slots
    read = Record(5, 1, 4096, 77)
    await directory.publish([(ROOT, k, read) for k in keys], [])
    rewritten = keys[1::2]  # written again since it was read: a new incarnation's record
    await directory.publish([(ROOT, k, Record(6, 1, 4096, 77)) for k in rewritten], [])
    await directory.forget([(ROOT, k, "x", read) for k in keys])
    found = await directory.find(ROOT, keys)
    assert [f.get("x") for f in found] == [None if k not in rewritten else Record(6, 1, 4096, 77) for k in keys]


async def server_ms(d: Directory) -> int:
    secs, micros = await d.client.time()
    return int(secs) * 1000 + int(micros) // 1000


async def test_a_lease_renewed_after_it_ran_out_is_a_new_incarnation(directory: Directory) -> None:
    first = await directory.heartbeat("10.0.0.1:1", 1000, 60_000)
    assert (first.created, first.incarnation) == (True, 1000)
    in_time = await directory.heartbeat("10.0.0.1:1", 1000, 1)  # renewed while the lease ran: the same life
    assert (in_time.created, in_time.incarnation) == (False, 1000)
    expiry = in_time.members["x"].expiry_ms
    while await server_ms(directory) <= expiry:  # the 1 ms lease runs out (in the server's clock)
        await asyncio.sleep(0.005)
    late = await directory.heartbeat("10.0.0.1:1", 1000, 60_000)
    assert late.incarnation == 1001 and not late.created
    assert late.members["x"].incarnation == late.incarnation
    again = await directory.heartbeat("10.0.0.1:1", late.incarnation, 60_000)
    assert again.incarnation == late.incarnation
    restarted = await directory.heartbeat("10.0.0.1:1", 5000, 60_000)  # a later start: its own incarnation
    assert restarted.incarnation == 5000


async def test_a_new_incarnation_whose_reply_was_lost_is_taken_up_at_the_next_heartbeat(directory: Directory) -> None:
    first = await directory.heartbeat("10.0.0.1:1", 1000, 1)
    while await server_ms(directory) <= first.members["x"].expiry_ms:
        await asyncio.sleep(0.005)
    lost = await directory.heartbeat("10.0.0.1:1", 1000, 60_000)  # its reply never reaches the node ...
    assert lost.incarnation == 1001
    nxt = await directory.heartbeat("10.0.0.1:1", 1000, 60_000)  # ... which asks with the old one again
    assert nxt.incarnation == lost.incarnation and nxt.members["x"].incarnation == lost.incarnation


async def test_a_member_entry_is_sealed_whole(directory: Directory) -> None:
    """Another node reads x's entry only as x wrote it: with its incarnation, its expiry or its
    address changed (each within the format), it does not check out, and is counted (66d9839
    sealed the address only: the first two were read as x's)."""
    other = Directory(directory.client, directory.prefix.decode(), "z")
    await directory.heartbeat("10.0.0.1:1", 1000, 60_000)
    entry = await directory.client.hget(directory.members_key, "x")  # type: ignore[misc]
    sealed, incarnation, expiry = entry.rsplit(b"|", 2)
    changed = [
        b"|".join([sealed, b"%d" % (int(incarnation) + 1), expiry]),
        b"|".join([sealed, incarnation, b"%d" % (int(expiry) + 60_000)]),
        b"|".join([sealed.replace(b"10.0.0.1:1", b"10.0.0.2:1"), incarnation, expiry]),
    ]
    for i, value in enumerate(changed, 1):
        await directory.client.hset(directory.members_key, "x", value)  # type: ignore[misc]
        beat = await other.heartbeat("10.0.0.9:1", 1000, 60_000)
        assert "x" not in beat.members and other.rejected_members == i, value
    await directory.client.hset(directory.members_key, "x", entry)  # type: ignore[misc]
    assert (await other.heartbeat("10.0.0.9:1", 1000, 60_000)).members["x"].address == "10.0.0.1:1"


async def test_the_heartbeat_writes_no_entry_whose_expiry_runs_past_two_leases(directory: Directory) -> None:
    """The script writes the entry the node sealed only when its expiry lies at most two leases
    ahead of the server's clock; one further ahead (a node's estimate gone wrong) is sealed again
    from the script's reply, within a lease of it."""
    beat = await directory.heartbeat("10.0.0.1:1", 1000, 60_000, expiry_ms=10**13)
    expiry = beat.members["x"].expiry_ms
    assert beat.written and beat.now_ms < expiry <= beat.now_ms + 60_000
