"""The command line of a test's own sidecar process: gRPC and HTTP on free loopback ports, a data
directory and a DRAM size (``kvstore serve`` flags; what each test adds goes after)."""

from __future__ import annotations

from pathlib import Path


def loopback_args(data_dir: Path, dram_bytes: int) -> list[str]:
    return ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(data_dir),
            "--dram-bytes", str(dram_bytes)]
