"""`kvstore serve`: run the sidecar until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.commands import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="run the sidecar (embedded defaults: DRAM + local SSD directory)")
    p.add_argument("--config", help="TOML config file (see `kvstore config --print-defaults`)")
    p.add_argument("--grpc-address", help="HOST:PORT or unix:/path (default 127.0.0.1:50051)")
    p.add_argument("--http-address",
                   help="HOST:PORT for /stats, /metrics, /healthz and the dashboard (default 127.0.0.1:8080)")
    p.add_argument("--data-dir", help="directory for SSD blocks and state (default ./kvstore-data)")
    p.add_argument("--dram-bytes", type=int, help="size of the shared-memory slab in bytes")
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.config import load_config
    from kvstore.server.sidecar import Sidecar
    from kvstore.util.logs import setup_logging
    from kvstore.util.tuning import tune_malloc

    config = load_config(
        args.config,
        {
            "server.grpc_address": args.grpc_address,
            "server.http_address": args.http_address,
            "data_dir": args.data_dir,
            "dram.capacity_bytes": args.dram_bytes,
        },
    )
    setup_logging(config.log_level, args.log_format)
    tune_malloc()
    sidecar = Sidecar(config)
    try:
        # past server.shutdown_grace_s + drain_s + shutdown_watchdog_s after the signal, a shutdown
        # still under way is ended with its stacks logged (kvstore/server/watchdog.py)
        asyncio.run(sidecar.serve_forever())
    finally:
        sidecar.finished()
    return 0
