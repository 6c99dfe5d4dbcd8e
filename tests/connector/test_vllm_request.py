"""An adapter's identity (connector/vllm/request_keys.py): a hash of its files, cached by path, mtime
and size; the same files elsewhere are the same adapter, changed files another one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from safetensors.numpy import save_file

from connector.vllm.request_keys import AdapterHashes


def adapter(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4}')
    rng = np.random.default_rng(seed)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal((2, 8))
               .astype(np.float32)}, str(path / "adapter_model.safetensors"))
    return path


def request(path: str | None) -> SimpleNamespace:
    lora = SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=path) if path is not None else None
    return SimpleNamespace(lora_request=lora)


def test_the_identity_is_the_files_not_the_path(tmp_path: Path) -> None:
    hashes = AdapterHashes()
    a = adapter(tmp_path / "a", 1)
    b = adapter(tmp_path / "b", 2)
    copy = Path(shutil.copytree(a, tmp_path / "other" / "a"))
    ida = hashes.identity(str(a))
    assert ida is not None and ida.startswith("sha256:") and len(ida) == len("sha256:") + 64
    assert hashes.identity(str(copy)) == ida
    assert hashes.identity(str(b)) != ida
    assert hashes.hashed == 3
    assert hashes.identity(str(a)) == ida and hashes.hits == 1 and hashes.hashed == 3  # cached by path


def test_changed_files_at_the_same_path_are_another_adapter(tmp_path: Path) -> None:
    hashes = AdapterHashes()
    a = adapter(tmp_path / "a", 1)
    before = hashes.identity(str(a))
    config = a / "adapter_config.json"
    config.write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 8}')  # same size, other scaling
    st = os.stat(config)
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    after = hashes.identity(str(a))
    assert after != before and hashes.hashed == 2


def test_a_request_s_adapter_field(tmp_path: Path) -> None:
    hashes = AdapterHashes()
    a = adapter(tmp_path / "a", 1)
    assert hashes.of_request(request(None)) == ""  # no adapter
    assert hashes.of_request(request(str(a))) == hashes.identity(str(a))
    assert hashes.of_request(request(str(tmp_path / "missing"))) is None  # not a local adapter: bypassed
    assert hashes.of_request(request("")) is None
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    assert hashes.of_request(request(str(tmp_path / "empty"))) is None  # no weight files
