"""The sidecar as users run it: `kvstore serve` in its own process, workers in others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from kvstore.harness.servers import free_port
from tests.conftest import REPO

WRITER = """
import sys, numpy as np
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
ns = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
keys = prefix_keys(ns, list(range(16 * 6)))
rng = np.random.default_rng(7)
blocks = [rng.integers(0, 256, 100_000, dtype=np.uint8) for _ in keys]
with SyncClient(sys.argv[1]) as c:
    r = c.put_blocks(ns, keys, blocks, checksums=True)
    print(r.stored, flush=True)
"""

READER = """
import sys, hashlib
from kvstore.client import SyncClient
from kvstore.keys import Namespace, prefix_keys
ns = Namespace(model="tiny-llama", kv_layout="raw", dtype="float16", block_size=16)
keys = prefix_keys(ns, list(range(16 * 6)))
with SyncClient(sys.argv[1]) as c:
    assert c.lookup(ns, keys).matched == len(keys)
    with c.acquire(ns, keys) as lease:
        assert lease.verify() == len(keys)
        print(len(lease.views), hashlib.sha256(b"".join(v.tobytes() for v in lease.views)).hexdigest(), flush=True)
"""


def run_py(code: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=REPO)
    assert "Exception ignored" not in p.stderr, p.stderr  # e.g. a mapping that cannot close at exit
    return p.stdout.strip()


def test_one_process_writes_another_reads_byte_for_byte(serve_process, tmp_path):
    import hashlib

    import numpy as np

    sc = serve_process(["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "d"), "--dram-bytes", str(16 << 20)])
    assert run_py(WRITER, sc.grpc) == "6"
    # The writer has exited: the slab must survive it.
    rng = np.random.default_rng(7)
    expected = hashlib.sha256(
        b"".join(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(6))
    ).hexdigest()
    assert run_py(READER, sc.grpc) == f"6 {expected}"
    assert run_py(READER, sc.grpc) == f"6 {expected}"  # and the first reader's exit changed nothing
    stats = json.loads(urllib.request.urlopen(f"http://{sc.http}/stats").read())
    assert stats["reads"]["blocks"] == 12 and stats["writes"]["blocks_committed"] == 6
    segment = sc.ready["segment"]
    assert os.path.exists(f"/dev/shm/{segment}")
    assert sc.stop(signal.SIGTERM) == 0
    assert not os.path.exists(f"/dev/shm/{segment}"), "clean shutdown must unlink the slab"


def test_http_endpoints_and_stats_cli(serve_process, tmp_path):
    sc = serve_process(["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "d"), "--dram-bytes", str(16 << 20)])
    run_py(WRITER, sc.grpc)
    run_py(READER, sc.grpc)
    assert json.loads(urllib.request.urlopen(f"http://{sc.http}/healthz").read()) == {"status": "ok"}
    assert json.loads(urllib.request.urlopen(f"http://{sc.http}/readyz").read()) == {"ready": True, "failing": {}}
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--url", sc.grpc, "--json"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    doc = json.loads(out)
    assert doc["tiers"]["dram"]["used_bytes"] == 6 * 131072  # 100 kB blocks in 128 KiB slots
    table = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--url", sc.grpc],
                           capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "hit rate 100.00%" in table and "dram" in table and "tiny-llama" in table


def test_second_sidecar_refuses_a_data_dir_in_use(serve_process, tmp_path):
    serve_process(["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
                   "--dram-bytes", str(4 << 20)])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--grpc-address",
            f"127.0.0.1:{free_port()}",
            "--http-address",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "d"),
            "--dram-bytes",
            str(4 << 20),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert p.returncode == 2
    assert "data_dir" in p.stderr and "in use" in p.stderr


def test_kill_9_leaves_no_claims_and_restart_cleans_the_slab(serve_process, tmp_path):
    args = ["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
            "--dram-bytes", str(16 << 20)]
    sc = serve_process(args)
    run_py(WRITER, sc.grpc)
    old = sc.ready["segment"]
    sc.stop(signal.SIGKILL)
    sc2 = serve_process(args)
    assert not os.path.exists(f"/dev/shm/{old}")
    out = run_py(
        "import sys; from kvstore.client import SyncClient; from kvstore.keys import Namespace, prefix_keys;"
        "ns = Namespace(model='tiny-llama', kv_layout='raw', dtype='float16', block_size=16);"
        "c = SyncClient(sys.argv[1]); print(c.lookup(ns, prefix_keys(ns, list(range(96)))).matched); c.close()",
        sc2.grpc,
    )
    assert out == "0"  # DRAM blocks died with the process; nothing claims them


def test_invalid_config_fails_at_start_naming_the_field(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--data-dir", str(tmp_path), "--grpc-address", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "KVSTORE_INDEX__POLICY": "nonsense"},
        timeout=60,
    )
    assert p.returncode == 2
    assert "index.policy" in p.stderr


STUCK_SERVE = """
import asyncio, sys
from kvstore.cli import main
from kvstore.movers.tiering import Tiering

async def never(self):  # a tier that never answers its close
    await asyncio.Event().wait()

Tiering.close = never
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_a_stuck_shutdown_is_ended_by_the_watchdog_with_its_stacks(serve_process, tmp_path):
    """SIGTERM, then a close that never ends: past shutdown_grace_s + drain_s + shutdown_watchdog_s the
    sidecar logs the step it stuck in and every task's stack, unlinks its slab and exits 70."""
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "d"}"\n[server]\ngrpc_address = "127.0.0.1:0"\n'
                   'http_address = "127.0.0.1:0"\nshutdown_grace_s = 0.1\ndrain_s = 0\nshutdown_watchdog_s = 1.0\n'
                   f"[dram]\ncapacity_bytes = {16 << 20}\n[ssd]\nenabled = true\n")
    sc = serve_process(["--config", str(cfg)], entry=("-c", STUCK_SERVE))
    ready = sc.ready
    run_py(WRITER, sc.grpc)
    code = sc.stop(signal.SIGTERM)
    text = sc.logs()
    assert code == 70, text[-3000:]
    assert "shutdown did not finish within 1 s (stuck in: finishing tier moves and closing the tiers)" in text, text
    tasks = text.split("--- asyncio task", 1)[-1]
    assert "in never" in tasks and "in stop" in tasks, text[-3000:]  # the stuck task's awaits, to the innermost
    assert "Traceback" not in text, text[-3000:]
    assert not os.path.exists(f"/dev/shm/{ready['segment']}")
