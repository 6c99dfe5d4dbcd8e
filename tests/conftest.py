"""Fixtures shared by the whole suite: an in-process sidecar on loopback, a subprocess sidecar,
a namespace, and free ports. Tier servers (redis, S3) live in tests/tiers/conftest.py."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from kvstore.config import Config, load_config
from kvstore.harness.sidecar import ServeProcess
from kvstore.keys import Namespace
from kvstore.server.sidecar import Sidecar

REPO = Path(__file__).resolve().parent.parent

# Every test is checked for leaked fds, threads, processes, shared memory, temp files and running
# sidecars (tests/leaks.py; opt out with @pytest.mark.leaks_allowed("why"), skip with --no-leak-check).
pytest_plugins = ["tests.leaks"]


def small_config(tmp_path: Path, **overrides: Any) -> Config:
    """A sidecar with a tiny slab: 4 pages of 64 KiB, slots from 4 KiB."""
    base = {
        "data_dir": str(tmp_path / "data"),
        "server.grpc_address": "127.0.0.1:0",
        "server.http_address": "127.0.0.1:0",
        "dram.capacity_bytes": 4 * 65536,
        "dram.page_bytes": 65536,
        "dram.min_slot_bytes": 4096,
        "ssd.enabled": False,
        "index.reaper_interval_ms": 50,
        "index.policy": "lru",  # tests that assert an eviction order assert LRU's
    }
    base.update(overrides)
    return load_config(None, base)


@pytest.fixture
def ns() -> Namespace:
    return Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    async with Sidecar(small_config(tmp_path)) as sc:
        yield sc


@pytest.fixture
async def client(sidecar: Sidecar) -> AsyncIterator[KVStoreClient]:
    async with KVStoreClient.from_url(f"127.0.0.1:{sidecar.grpc_port}") as c:
        yield c


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    started: list[ServeProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None, **kw: Any) -> ServeProcess:
        p = ServeProcess(args, env, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.stop(signal.SIGKILL)
        p.log.close()
        Path(p.log.name).unlink(missing_ok=True)  # ServeProcess never removes its log (tests/leaks.py)
