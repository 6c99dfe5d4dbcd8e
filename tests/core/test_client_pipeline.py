"""The clients' pipelines (``client.pipeline()``, kvstore.client.pipeline) against a sidecar
process: calls sent now and answered later, each answer its own call's, with the client's token;
the blocking client's only over its local socket (none over gRPC). The connectors' use of it,
and the local socket's rules it follows, are in tests/connector/test_connector_pipeline.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.client import KVStoreClient, Pipeline, SyncClient
from kvstore.errors import InvalidArgument, NotFound
from kvstore.keys import Namespace, prefix_keys

NS = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
ARGS = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--dram-bytes", str(8 << 20)]
ENV = {"KVSTORE_SSD__ENABLED": "false", "KVSTORE_SERVER__AUTH_TOKEN": "s3cret"}
KEYS = prefix_keys(NS, list(range(16 * 4)))
BLOCKS = [np.full(4096, i, dtype=np.uint8) for i in range(4)]


def _serve(serve_process, data_dir: Path):
    return serve_process([*ARGS, "--data-dir", str(data_dir)], env=ENV)


def test_the_blocking_clients_pipeline_goes_over_its_local_socket_with_its_token(serve_process, tmp_path: Path):
    sc = _serve(serve_process, tmp_path / "d")
    with SyncClient(sc.grpc, token="s3cret") as c, SyncClient(sc.grpc, token="s3cret", local=False) as remote:
        c.put_blocks(NS, KEYS, BLOCKS)
        assert remote.pipeline() is None  # gRPC only: nothing to pipeline on
        pipe = c.pipeline()
        assert isinstance(pipe, Pipeline)
        heard: list[object] = []
        first = pipe.acquire(NS, KEYS[:2], 10_000)
        wrong = pipe.lookup(NS, [b"short"])
        whole = pipe.lookup(NS, KEYS, heard.append)
        lease = pipe.result(first)
        assert len(lease.offsets) == 2 and lease.lease_id
        with pytest.raises(InvalidArgument, match="keys"):
            pipe.result(wrong)
        pipe.release(lease.lease_id, heard.append)
        pipe.release("no-such-lease", heard.append)
        pipe.drain()
        assert heard[0] is pipe.result(whole) and pipe.result(whole).matched == 4
        assert heard[1].released == 2 and isinstance(heard[2], NotFound)
        pipe.close()
        assert c.stats()["index"]["leases"] == 0


async def test_the_async_clients_pipeline_sends_at_once_and_answers_each_call(serve_process, tmp_path: Path):
    sc = _serve(serve_process, tmp_path / "d")
    async with KVStoreClient.from_url(sc.grpc, token="s3cret") as c:
        await c.put_blocks(NS, KEYS, BLOCKS)
        pipe = await c.pipeline()
        assert c.transport == "local"
        heard: list[object] = []
        calls = [pipe.lookup(NS, KEYS[:n]) for n in (1, 2, 3)]
        wrong = pipe.lookup(NS, [b"short"], heard.append)
        lease = await pipe.result(pipe.acquire(NS, KEYS, 10_000))
        pipe.forget(pipe.release(lease.lease_id), heard.append)
        await pipe.aclose()
        assert [(await pipe.result(call)).matched for call in calls] == [1, 2, 3]
        with pytest.raises(InvalidArgument, match="keys"):
            await pipe.result(wrong)
        errors = [h for h in heard if isinstance(h, InvalidArgument)]  # (two connections: either may answer first)
        assert len(errors) == 1 and [h.released for h in heard if h not in errors] == [4]
        assert (await c.stats())["index"]["leases"] == 0
