"""`kvstore config --print-defaults` and `kvstore config --check FILE`."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import deploy_topology as topo

from kvstore.config import Config, load_config


def kvstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", "config", *args], capture_output=True, text=True,
                          cwd=topo.REPO, env={**os.environ, **(env or {})}, timeout=60)


def test_print_defaults_is_a_complete_valid_config(tmp_path):
    out = kvstore("--print-defaults")
    assert out.returncode == 0
    assert tomllib.loads(out.stdout).keys() == Config.model_fields.keys()
    path = tmp_path / "defaults.toml"
    path.write_text(out.stdout)
    assert load_config(path) == Config()
    assert "# bearer token required on gRPC and HTTP when set" in out.stdout
    assert kvstore("--check", str(path)).stdout.strip() == f"{path}: ok"


def test_check_names_the_field_and_the_allowed_values(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('log_level = "loud"\n')
    out = kvstore("--check", str(bad))
    assert out.returncode == 2
    assert "log_level" in out.stderr and "'debug', 'info', 'warning' or 'error'" in out.stderr
    bad.write_text('[index]\npolicy = "fifo"\n')
    out = kvstore("--check", str(bad))
    assert out.returncode == 2 and "index.policy" in out.stderr and "lru" in out.stderr
    good = tmp_path / "good.toml"
    good.write_text("[dram]\npage_bytes = 65536\n")
    out = kvstore("--check", str(good), env={"KVSTORE_DRAM__PAGE_BYTES": "3000"})  # env applies too
    assert out.returncode == 2 and "dram.page_bytes" in out.stderr
    out = kvstore("--check", str(good), "--show")
    assert out.returncode == 0 and '"page_bytes": 65536' in out.stdout


def test_a_cluster_without_a_token_is_refused(tmp_path):
    """The cluster never runs unauthenticated (docs/security.md, "The cluster"): its keys are
    derived from cluster.token, so a config that turns the cluster on without one is refused."""
    bad = tmp_path / "cluster.toml"
    bad.write_text("[cluster]\nenabled = true\n")
    out = kvstore("--check", str(bad), env={"KVSTORE_CLUSTER__TOKEN": ""})
    assert out.returncode == 2 and "token" in out.stderr and "cluster" in out.stderr
    out = kvstore("--check", str(bad), env={"KVSTORE_CLUSTER__TOKEN": "a" * 32})
    assert out.returncode == 0, out.stderr
