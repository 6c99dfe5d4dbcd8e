"""Fixtures for the connector's integration tests: a tiny Llama on disk and a real sidecar
(`kvstore serve` in a subprocess on free loopback ports, via kvstore.harness.sidecar.ServeProcess)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import SyncClient
from kvstore.harness.sidecar import ServeProcess
from tests.support.sidecar_args import loopback_args

SIDECAR_DRAM_BYTES = 64 << 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvstore.harness.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def serve_args(data_dir: Path, dram_bytes: int = SIDECAR_DRAM_BYTES) -> list[str]:
    return [*loopback_args(data_dir, dram_bytes), "--log-format", "text"]


@pytest.fixture
def sidecar_process(tmp_path: Path) -> Iterator[ServeProcess]:
    """``.url`` (= ``.grpc``) is its address; ``.stop()`` takes it down (tests do, to make it
    unreachable; stopping twice is harmless)."""
    sc = ServeProcess(serve_args(tmp_path / "kvstore-data"))
    sc.url = sc.grpc  # type: ignore[attr-defined]  # an alias the connector tests read
    yield sc
    sc.stop()


@pytest.fixture
def client(sidecar_process: ServeProcess) -> Iterator[SyncClient]:
    """The blocking client the connectors use, on ``sidecar_process``."""
    with SyncClient(sidecar_process.url) as c:
        yield c
