"""Bearer token on gRPC (UNAUTHENTICATED) and HTTP (401), and TLS for gRPC with a self-signed
certificate made here with ``cryptography``."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import aiohttp
import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.errors import Unauthenticated, Unavailable
from kvstore.server.auth import TokenInterceptor
from kvstore.server.sidecar import Sidecar
from tests.conftest import small_config

TOKEN = "s3cret-token"


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def health(channel: grpc.aio.Channel) -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return resp.status


async def test_grpc_requires_the_bearer_token(tmp_path):
    async with Sidecar(small_config(tmp_path, **{"server.auth_token": TOKEN})) as sc:
        url = f"grpc://127.0.0.1:{sc.grpc_port}"
        for token in ("", "wrong"):
            async with KVStoreClient.from_url(url, token=token) as c:
                with pytest.raises(Unauthenticated, match="bearer token"):
                    await c.stats()
        async with KVStoreClient.from_url(url, token=TOKEN) as c:
            doc = await c.stats()
        assert doc["errors"] == {}  # rejected calls never reached the servicer
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.grpc_port}") as ch:  # health stays open
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
            # a streaming method (reflection is bidi) is refused the same way
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=(("authorization", f"Bearer {TOKEN}"),))
            names = [s.name async for r in call for s in r.list_services_response.service]
            assert "kvstore.v1.KVStore" in names


async def test_http_requires_the_bearer_token_except_health(tmp_path):
    async with Sidecar(small_config(tmp_path, **{"server.auth_token": TOKEN})) as sc:
        base = f"http://127.0.0.1:{sc.http_port}"
        async with aiohttp.ClientSession() as s:
            for path in ("/stats", "/metrics", "/dashboard", "/"):
                async with s.get(base + path) as r:
                    assert r.status == 401, path
                async with s.get(base + path, headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401, path
            async with s.get(base + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200 and "lookups" in await r.json()
            async with s.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200 and "kvstore_lookups_total" in await r.text()
            async with s.get(base + f"/dashboard?token={TOKEN}") as r:
                assert r.status == 200 and "<canvas" in await r.text()
            for path in ("/healthz", "/readyz"):
                async with s.get(base + path) as r:
                    assert r.status == 200, path


async def test_grpc_over_tls_with_a_token(tmp_path):
    cert, key = self_signed(tmp_path)
    cfg = small_config(
        tmp_path, **{"server.auth_token": TOKEN, "server.tls_cert": str(cert), "server.tls_key": str(key)}
    )
    async with Sidecar(cfg) as sc:
        url = f"grpcs://127.0.0.1:{sc.grpc_port}"
        async with KVStoreClient.from_url(url, token=TOKEN, root_certificates=cert.read_bytes()) as c:
            doc = await c.stats()
            assert doc["lookups"]["calls"] == 0
        async with KVStoreClient.from_url(url, root_certificates=cert.read_bytes()) as c:
            with pytest.raises(Unauthenticated):
                await c.stats()
        async with KVStoreClient.from_url(f"grpc://127.0.0.1:{sc.grpc_port}", token=TOKEN) as c:
            with pytest.raises(Unavailable):  # plaintext against a TLS port
                await c.stats()


def test_interceptor_refuses_an_empty_token_and_compares_exactly():
    with pytest.raises(ValueError):
        TokenInterceptor("")
    t = TokenInterceptor("abc")
    assert t.authorized((("authorization", "Bearer abc"),))
    assert not t.authorized((("authorization", "Bearer abcd"),))
    assert not t.authorized((("authorization", "abc"),))
    assert not t.authorized(())
