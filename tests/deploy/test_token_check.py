"""One constant-time token check (``kvstore.server.auth.token_matches``) behind every door: HTTP (header
and ``?token=``), gRPC metadata and the local socket's hello. Time cannot be asserted here, so the
test watches what decides: every comparison of a supplied token goes through
``hmac.compare_digest`` (a spy that calls the real one), none through ``==``."""

from __future__ import annotations

import hmac

import aiohttp
import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.client.local_channel import AsyncLocalChannel
from kvstore.errors import Unauthenticated
from kvstore.server.sidecar import Sidecar
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import small_config

TOKEN = "s3cret-token"


@pytest.fixture
def compared(monkeypatch) -> list[tuple[bytes, bytes]]:
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    return seen


async def test_http_grpc_and_local_socket_compare_tokens_in_constant_time(tmp_path, compared):
    async with Sidecar(small_config(tmp_path, **{"server.auth_token": TOKEN})) as sc, aiohttp.ClientSession() as http:
        stats = f"http://127.0.0.1:{sc.http_port}/stats"
        async with http.get(stats, headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        assert (b"Bearer wrong", f"Bearer {TOKEN}".encode()) in compared
        compared.clear()
        async with http.get(stats, params={"token": "guess"}) as r:
            assert r.status == 401
        assert (b"guess", TOKEN.encode()) in compared
        for ok in ({"headers": {"Authorization": f"Bearer {TOKEN}"}}, {"params": {"token": TOKEN}}):
            compared.clear()
            async with http.get(stats, **ok) as r:
                assert r.status == 200
            assert compared, "the right token was accepted without the constant-time check"

        compared.clear()
        async with KVStoreClient.from_url(f"127.0.0.1:{sc.grpc_port}", token="wrong", local=False) as c:
            with pytest.raises(Unauthenticated):
                await c.stats()
        assert (b"Bearer wrong", f"Bearer {TOKEN}".encode()) in compared

        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:
            bearer = (("authorization", f"Bearer {TOKEN}"),)
            hello = await pb_grpc.KVStoreStub(ch).Hello(pb.HelloRequest(), metadata=bearer)
        compared.clear()
        local = AsyncLocalChannel(hello.local_socket, token="wrong")
        try:
            with pytest.raises(Unauthenticated):
                await local.call("Stats", pb.StatsRequest())
        finally:
            await local.aclose()
        assert (b"wrong", TOKEN.encode()) in compared
