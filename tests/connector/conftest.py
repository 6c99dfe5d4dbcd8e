"""Fixtures for the connector's integration tests: a tiny Llama on disk and a real sidecar
(`kvstore serve` in a subprocess, on free loopback ports)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvstore.testing.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


class SidecarProcess:
    def __init__(self, data_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--grpc-address", "127.0.0.1:0", "--http-address",
             "127.0.0.1:0", "--data-dir", str(data_dir), "--dram-bytes", str(64 << 20), "--log-format", "text"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=dict(os.environ),
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"kvstore serve exited with {self.proc.wait()}")
        self.url = json.loads(line)["grpc"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def sidecar_process(tmp_path: Path) -> Iterator[SidecarProcess]:
    sc = SidecarProcess(tmp_path / "kvstore-data")
    yield sc
    sc.stop()
