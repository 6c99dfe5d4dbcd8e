"""Redis tier specifics: key layout and slots, partial eviction, TTL, faults, cluster scan."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis
import redis.asyncio
from redis.cluster import key_slot

from kvstore.config import Config, RedisConfig
from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.harness.servers import redis_server
from kvstore.tiers import build_tier
from kvstore.tiers.redis import RedisTier
from kvstore.wire import resp

CHUNK = 64 * 1024
SIZE = 3 * CHUNK + 100  # four chunks


def buffer(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.fixture
async def single(redis_clean):
    tier = RedisTier(redis.asyncio.Redis.from_url(redis_clean.url), key_prefix="t", chunk_bytes=CHUNK)
    yield tier
    await tier.close()


async def test_keys_share_one_slot_and_carry_prefix_and_namespace(single, block):
    meta, data = block(1, SIZE)
    keys = [single.header_key(meta.ref), *single.chunk_keys(meta.ref, SIZE)]
    assert len(keys) == 5
    assert all(k.startswith(f"t:{meta.ref.ns.hex()[:16]}:{{{meta.ref.key.hex()}}}:") for k in keys)
    assert len({key_slot(k.encode()) for k in keys}) == 1
    await single.put(meta, data)
    assert sorted(k.decode() for k in await single.client.keys("t:*")) == sorted(keys)
    stride = CHUNK - 64
    assert await single.client.strlen(keys[1]) == stride and await single.client.strlen(keys[-1]) == SIZE - 3 * stride


async def test_a_full_chunk_takes_chunk_bytes_of_redis_memory(single, block):
    """A chunk leaves room for Redis's own bytes, so its allocation is exactly ``chunk_bytes``
    (a jemalloc size class): a block costs its size in Redis memory. A value of exactly 64 KiB
    takes the next class up, 80 KiB."""
    meta, data = block(5, 8 * CHUNK)
    await single.put(meta, data)
    keys = single.chunk_keys(meta.ref, meta.size)
    assert len(keys) == 9  # eight full chunks and 512 bytes
    for k in keys[:-1]:
        assert await single.client.memory_usage(k) <= CHUNK + 256  # the key and its entry aside
    await single.client.set("t:plain", bytes(CHUNK))
    assert await single.client.memory_usage("t:plain") >= CHUNK * 5 // 4


async def test_block_with_a_chunk_gone_is_a_miss(single, block):
    meta, data = block(2, SIZE)
    await single.put(meta, data)
    await single.client.delete(single.chunk_keys(meta.ref, SIZE)[2])  # as maxmemory eviction would
    assert await single.get(meta.ref, buffer(SIZE)) is None
    assert await single.get_many([meta.ref], [buffer(SIZE)]) == [None]
    await single.delete(meta.ref)  # what is left is cleaned up
    assert await single.client.keys("t:*") == []


async def test_maxmemory_eviction_gives_misses_never_errors_or_wrong_bytes(block):
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-random") as server:
        tier = RedisTier(redis.asyncio.Redis.from_url(server.url), chunk_bytes=CHUNK)
        try:
            blocks = [block(100 + i, SIZE) for i in range(24)]  # ~6 MiB into 2 MiB
            for meta, data in blocks:
                await tier.put(meta, data)
            bufs = [buffer(SIZE) for _ in blocks]
            got = await tier.get_many([m.ref for m, _ in blocks], bufs)
            hits = [i for i, m in enumerate(got) if m is not None]
            assert len(hits) < len(blocks)
            for i in hits:
                assert bufs[i] == blocks[i][1]
            assert int((await tier.client.info("stats"))["evicted_keys"]) > 0
        finally:
            await tier.close()


async def test_ttl(redis_clean, block):
    tier = RedisTier(redis.asyncio.Redis.from_url(redis_clean.url), chunk_bytes=CHUNK, ttl_s=300)
    try:
        meta, data = block(3, SIZE)
        await tier.put(meta, data)
        for key in [tier.header_key(meta.ref), *tier.chunk_keys(meta.ref, SIZE)]:
            assert 0 < await tier.client.ttl(key) <= 300
    finally:
        await tier.close()


async def test_killed_server_raises_unavailable_then_recovers(block):
    with redis_server() as server:
        cfg = RedisConfig(url=server.url, retries=2, backoff_base_s=0.01, backoff_cap_s=0.05, socket_timeout_s=2)
        tier = build_tier("redis", cfg)
        try:
            meta, data = block(4, SIZE)
            await tier.put(meta, data)
            server.stop()
            with pytest.raises(Unavailable):
                await tier.get(meta.ref, buffer(SIZE))
            with pytest.raises(Unavailable):
                await tier.put(meta, data)
            with pytest.raises(Unavailable):
                await tier.contains_many([meta.ref])
            server.start()  # an empty server (no persistence): the old block is a miss
            assert await tier.get(meta.ref, buffer(SIZE)) is None
            await tier.put(meta, data)
            into = buffer(SIZE)
            assert await tier.get(meta.ref, into) == meta and into == data
        finally:
            await tier.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "redis_py"])
async def test_a_put_refused_for_memory_stores_nothing_of_that_block(direct, block):
    """noeviction and a block bigger than the room left: the put fails with ResourceExhausted,
    and none of the block's chunks stays behind (each block is one MULTI/EXEC)."""
    with redis_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction") as server:
        tier = RedisTier(redis.asyncio.Redis.from_url(server.url), key_prefix="t", chunk_bytes=CHUNK, direct_io=direct)
        try:
            small, big = block(20, SIZE), block(21, 64 * CHUNK)  # 4 MiB into 3 MiB
            await tier.put_many([small])
            with pytest.raises(ResourceExhausted):
                await tier.put_many([big])
            keys = sorted(k.decode() for k in await tier.client.keys("t:*"))
            assert keys == sorted([tier.header_key(small[0].ref), *tier.chunk_keys(small[0].ref, SIZE)])
            into = buffer(SIZE)
            assert await tier.get(small[0].ref, into) == small[0] and into == small[1]
        finally:
            await tier.close()


async def test_a_put_cut_off_mid_pipeline_leaves_no_chunk_of_the_unfinished_block(redis_clean, block):
    """The connection ends after half of the pipeline went out (the sidecar killed mid-put): the
    block whose transaction went out whole is stored whole, the one cut off not at all."""
    single = RedisTier(redis.asyncio.Redis.from_url(redis_clean.url), key_prefix="t", chunk_bytes=CHUNK, pipelines=1)
    whole, cut = block(22, SIZE), block(23, 21 * CHUNK)
    send = resp.Connection._send
    watcher = redis.Redis(port=redis_clean.port)

    def send_half_then_end(conn: resp.Connection, bufs: list[resp.Buffer]) -> None:
        send(conn, bufs[: len(bufs) // 2])
        conn.sock.shutdown(socket.SHUT_WR)  # the server reads all that was sent, then EOF
        port = conn.sock.getsockname()[1]
        for _ in range(2000):
            if f":{port} " not in watcher.execute_command("CLIENT", "LIST").decode():
                break  # the server has dropped this client: it has read everything sent
            time.sleep(0.01)
        raise ConnectionResetError("cut off")

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(resp.Connection, "_send", send_half_then_end)
            with pytest.raises(Unavailable):
                await single.put_many([whole, cut])
        keys = sorted(k.decode() for k in await single.client.keys("t:*"))
        assert keys == sorted([single.header_key(whole[0].ref), *single.chunk_keys(whole[0].ref, SIZE)])
        into = buffer(SIZE)
        assert await single.get(whole[0].ref, into) == whole[0] and into == whole[1]
    finally:
        watcher.close()
        await single.close()


async def test_cluster_scan_covers_every_node(cluster_clean, block):
    cfg = Config(redis=RedisConfig(enabled=True, url=cluster_clean.url, cluster=True, chunk_bytes=CHUNK))
    tier = build_tier("redis", cfg)
    try:
        assert tier.cluster
        blocks = [block(200 + i, 1000 + i) for i in range(40)]
        await tier.put_many(blocks)
        nodes_used = {tier.client.get_node_from_key(tier.header_key(m.ref)).port for m, _ in blocks}
        assert len(nodes_used) == 3
        found = sorted([m async for m in tier.scan()], key=lambda m: m.ref.key)
        assert found == sorted((m for m, _ in blocks), key=lambda m: m.ref.key)
    finally:
        await tier.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
async def test_delete_leaves_no_chunk_behind_when_the_header_cannot_say_how_many(cluster, request, block):
    """A block's header corrupted, naming another block, or gone (a put cut short before its
    header, a header evicted by Redis) still has every chunk deleted with it, in a batch with
    healthy blocks: nothing is left in Redis for nobody to free."""
    server = request.getfixturevalue("cluster_clean" if cluster else "redis_clean")
    cfg = Config(redis=RedisConfig(enabled=True, url=server.url, cluster=cluster, chunk_bytes=CHUNK, key_prefix="t"))
    tier = build_tier("redis", cfg)
    try:
        big = 20 * CHUNK + 1  # 21 chunks: more than two runs of stray deletes
        blocks = [block(300, SIZE), block(301, big), block(302, SIZE), block(303, SIZE), block(304, 100)]
        await tier.put_many(blocks)
        (healthy, _), (corrupt, _), (other, _), (gone, _), _ = blocks
        await tier.client.setrange(tier.header_key(corrupt.ref), 0, b"garbage!")
        await tier.client.set(tier.header_key(other.ref), await tier.client.get(tier.header_key(healthy.ref)))
        await tier.client.delete(tier.header_key(gone.ref))
        async def keys() -> list[bytes]:
            return [k async for k in tier.client.scan_iter(match="t:*")]  # (every node of a cluster)

        assert len(await keys()) == 5 + 22 + 5 + 4 + 2
        await tier.delete_many([m.ref for m, _ in blocks])
        assert await keys() == []
    finally:
        await tier.close()


def test_from_config_picks_the_client_class():
    single = RedisTier.from_config(RedisConfig(url="redis://127.0.0.1:1/0", key_prefix="p", ttl_s=5))
    assert isinstance(single.client, redis.asyncio.Redis) and not single.cluster
    assert (single.key_prefix, single.ttl_s, single.chunk_bytes) == ("p", 5, 2 << 20)
    assert single.client.get_retry().get_retries() == 3


def test_pool_is_sized_for_the_movers_pipelines():
    tier = RedisTier.from_config(RedisConfig(url="redis://127.0.0.1:1/0", pipelines=4, max_connections=64))
    assert tier.pipelines == 4 and tier.direct_io
    assert tier.client.connection_pool.max_connections == 16  # a pipeline per request in flight
    plain = RedisTier.from_config(RedisConfig(url="redis://127.0.0.1:1/0", pipelines=4, max_connections=64,
                                              direct_io=False))
    assert plain.client.connection_pool.max_connections == 64  # 16 requests x 4 pipelines
    with pytest.raises(ValueError, match=r"max_connections: 100 < 128 \(16 requests in flight x pipelines 8\)"):
        RedisConfig(pipelines=8, max_connections=100)


async def test_a_burst_of_deletes_opens_no_more_connections_than_the_pool_holds(redis_clean, block):
    """64 deletes at once (the soak's clients deleting while Redis restarted) share the pool's
    connections instead of opening one each: the pool had 24 connections before a Redis restart in
    the soak and 33 after it, for good (its open fds up 10 %)."""
    from kvstore.config import TIER_IN_FLIGHT

    tier = RedisTier.from_config(RedisConfig(url=redis_clean.url, key_prefix="t", chunk_bytes=CHUNK))
    raw = redis.Redis.from_url(redis_clean.url)
    try:
        blocks = [block(300 + i, 100) for i in range(64)]
        await tier.put_many(blocks)
        await asyncio.gather(*(tier.delete_many([m.ref]) for m, _ in blocks))
        assert [await tier.contains(m.ref) for m, _ in blocks] == [False] * 64
        clients = [c for c in raw.client_list() if c["cmd"] != "client|list"]
        assert 0 < len(clients) <= TIER_IN_FLIGHT + 2 * tier.pipelines  # redis-py's, the direct path's
    finally:
        raw.close()
        await tier.close()


# ---- the direct path (kvstore.wire.resp) against redis-py -------------------------------------


async def test_direct_and_redis_py_paths_read_each_others_blocks(redis_clean, block):
    direct = RedisTier(redis.asyncio.Redis.from_url(redis_clean.url), key_prefix="t", chunk_bytes=CHUNK)
    plain = RedisTier(redis.asyncio.Redis.from_url(redis_clean.url), key_prefix="t", chunk_bytes=CHUNK, direct_io=False)
    try:
        assert direct.direct_io and not plain.direct_io
        a, b = block(10, SIZE), block(11, CHUNK)  # several chunks; exactly one
        await direct.put_many([a])
        await plain.put_many([b])
        for reader in (direct, plain):
            bufs = [buffer(SIZE), buffer(SIZE)]
            got = await reader.get_many_hashed([a[0].ref, b[0].ref], bufs)
            assert got == [(a[0], a[0].checksum), (b[0], b[0].checksum)]
            assert bufs[0] == a[1] and bufs[1][:CHUNK] == b[1]
    finally:
        await direct.close()
        await plain.close()


async def test_direct_path_counts_a_chunk_of_the_wrong_length_as_a_miss(single, block):
    meta, data = block(12, SIZE)
    await single.put(meta, data)
    await single.client.append(single.chunk_keys(meta.ref, SIZE)[1], b"x")  # same total bytes elsewhere: not the block
    await single.client.set(single.chunk_keys(meta.ref, SIZE)[3], bytes(data[3 * single.stride : -1]))
    assert await single.get_many_hashed([meta.ref], [buffer(SIZE)]) == [(None, None)]


async def test_direct_path_authenticates_and_selects_the_db(block):
    with redis_server("--requirepass", "s3cret") as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        tier = RedisTier(redis.asyncio.Redis.from_url(url), key_prefix="t", chunk_bytes=CHUNK)
        wrong = RedisTier(
            redis.asyncio.Redis.from_url(url.replace("s3cret", "nope")), key_prefix="t", chunk_bytes=CHUNK
        )
        try:
            assert tier.direct_io
            meta, data = block(13, SIZE)
            await tier.put(meta, data)
            assert len(server.cli("-n", "3", "KEYS", "t:*").split()) == 5  # in db 3
            into = buffer(SIZE)
            assert await tier.get(meta.ref, into) == meta and into == data
            with pytest.raises(Unavailable, match=r"WRONGPASS|invalid"):
                await wrong.get(meta.ref, buffer(SIZE))
        finally:
            await tier.close()
            await wrong.close()


def test_connections_the_direct_path_cannot_follow_stay_on_redis_py():
    assert not RedisTier(redis.asyncio.Redis.from_url("rediss://127.0.0.1:1/0")).direct_io  # TLS
    assert not RedisTier(redis.asyncio.Redis.from_url("unix:///tmp/redis.sock")).direct_io
    assert not RedisTier.from_config(RedisConfig(url="redis://127.0.0.1:1/0", direct_io=False)).direct_io
    assert RedisTier.from_config(RedisConfig(url="redis://127.0.0.1:1/0")).direct_io


async def test_cluster_redirect_on_the_direct_path_falls_back_to_redis_py(cluster_clean, block):
    """A stale slot map (a resharded cluster) sends the direct path to the wrong node: MOVED.
    The batch goes through redis-py, which follows the redirect and refreshes the map."""
    tier = RedisTier(redis.asyncio.cluster.RedisCluster.from_url(cluster_clean.url), key_prefix="t", chunk_bytes=CHUNK)
    try:
        meta, data = block(14, SIZE)
        await tier.client.initialize()
        slot = key_slot(tier.header_key(meta.ref).encode())
        owner = tier.client.get_node_from_key(tier.header_key(meta.ref))
        other = next(n for n in tier.client.get_primaries() if n.name != owner.name)
        tier.client.nodes_manager.slots_cache[slot] = [other]
        await tier.put(meta, data)
        assert tier.client.get_node_from_key(tier.header_key(meta.ref)).name == owner.name  # map refreshed
        tier.client.nodes_manager.slots_cache[slot] = [other]
        into = buffer(SIZE)
        assert await tier.get_many_hashed([meta.ref], [into]) == [(meta, meta.checksum)] and into == data
    finally:
        await tier.close()
