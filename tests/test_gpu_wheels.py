"""scripts/gpu-check starts on a bare CUDA image with torch and cupy: the wheels it carries are the
import closure of what it runs (scripts/gpu_wheels.py), every step is bounded, the demo runs once,
and it ends with one line of the key ratios (scripts/gpu_summary.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu-check"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _listed() -> set[str]:
    lines = (ROOT / "scripts" / "gpu-wheels.txt").read_text().splitlines()
    return {ln.split("==")[0] for ln in lines if ln.strip() and not ln.startswith("#")}


def test_the_wheel_list_is_the_import_closure_less_the_image() -> None:
    """scripts/gpu-wheels.txt names exactly the distributions the closure finds (regenerate with
    `python3 scripts/gpu_wheels.py --write`): what gpu-check's steps import at any depth, hiredis
    (imported unconditionally by the wire code), aiohttp, prometheus-client, transformers,
    tokenizers and pytest's plugins among them; nothing the image brings, nor boto3/botocore (no
    step reaches an S3 tier)."""
    wheels = _script("gpu_wheels")
    closure = set(wheels.wheels())
    assert _listed() == closure
    assert {"hiredis", "aiohttp", "prometheus-client", "transformers", "tokenizers", "pytest",
            "pytest-timeout", "pytest-asyncio", "huggingface-hub"} <= closure
    assert not closure & {"boto3", "botocore", "aioboto3", "torch", "numpy", "cupy", "typing-extensions"}


def test_the_closure_follows_lazy_imports_and_skips_type_checking() -> None:
    """A function-level import on a path gpu-check runs counts (transformers, inside
    benchmarks.transfer_gpu); an import under ``if TYPE_CHECKING:`` does not."""
    wheels = _script("gpu_wheels")
    src = (ROOT / "benchmarks" / "transfer_gpu.py").read_text()
    assert re.search(r"^\s+(from|import) transformers", src, re.M), "the lazy import this test relies on moved"
    names = wheels.third_party_imports()
    assert "transformers" in names and "xxhash" in names
    assert "vllm" not in names and "aioboto3" not in names


def test_every_step_is_bounded_and_the_demo_runs_once() -> None:
    """Every command gpu-check runs on the device goes through ``step`` (a timeout); the demo runs
    as its own step only (its test is deselected), and the summary line comes last."""
    body = CHECK.read_text().split('exit 0\nfi\n', 1)[1]  # after the --fetch branch (run beside the GPU machine)
    commands = [ln.strip() for ln in body.splitlines()
                if re.match(r"\s*(python3|nvidia-smi|step\b)(?!\(\))", ln)]
    assert commands and all(c.startswith("step ") for c in commands), commands
    runs_demo = [c for c in commands if "kvstore demo" in c]
    assert len(runs_demo) == 1
    assert "--deselect tests/connector/test_cuda_transfer.py::test_demo_on_the_gpu_matches_full_recompute" in body
    assert "gpu_summary.py" in commands[-1]


def test_the_summary_line_names_each_ratios_worst_shape(tmp_path: Path) -> None:
    (tmp_path / "gpu-tests.log").write_text("....\n===== 9 passed, 1 deselected in 41.0s =====\n")
    ratios = {"llama3_8b_gather_vs_pcie": 0.98, "qwen25_05b_gather_vs_pcie": 0.91, "llama3_8b_scatter_vs_pcie": 0.97,
              "llama3_8b_both_ways_vs_pcie": 0.95, "llama3_8b_one_block_vs_raw_plus_30us": 1.4,
              "reload_vs_recompute_4096": 12.34}
    (tmp_path / "bench-transfer.json").write_text("noise\n" + json.dumps({"ratios": ratios}) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("\n") == 1
    assert out.strip() == ("gpu-check: tests 9 passed, 1 deselected | gather/DMA 0.91 (qwen25_05b) | scatter/DMA 0.97"
                           " (llama3_8b) | both ways/DMA 0.95 (llama3_8b) | one block/(raw+30us) 1.40 (llama3_8b) |"
                           " reload/recompute@4096 12.3 | demo n/a")
