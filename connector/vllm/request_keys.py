"""What a vLLM request adds to its keys beyond the engine's namespace and its token ids: its LoRA
adapter's identity (the namespace's ``adapter``) and its multimodal items (the extra bytes of the
keys of the blocks they overlap).

vLLM names an adapter three ways, none of which holds across hosts: ``lora_int_id`` is assigned
per server and reused for another adapter once one is unloaded, and ``lora_name`` and
``lora_path`` can be re-pointed at other weights. The adapter's identity is therefore a hash of
what its KV depends on: the adapter's files as vLLM loads them from ``lora_path`` (every
``*.safetensors`` or ``*.bin`` weight file, by name, and ``adapter_config.json``, whose ``lora_alpha``
and ``r`` scale the weights), written to the namespace's ``adapter`` field as ``sha256:<hex>``. Two
hosts with the same adapter files at different paths, under different names and ids, share
blocks; an adapter whose files change is another adapter.

The hash is computed once per adapter path on the scheduler side (where the ``LoRARequest`` is
visible), when its first request arrives, and cached by path and each file's mtime and size
(``AdapterHashes``): a later request costs one ``stat`` per file. A ``lora_path`` that is not a
local directory holding ``adapter_config.json`` and weight files (an adapter loaded another way)
has no identity here and its request bypasses the connector (counted as ``lora``).

A multimodal item (vLLM's ``MultiModalFeatureSpec``: image, audio, video) is the placeholder
tokens at ``mm_position`` (offset, length) in the prompt, whose KV depends on the item, not on the
placeholder token ids. As vLLM's own block hashes do (``extra_keys``), every block the item
overlaps carries, in its key, the item's modality, its full ``identifier`` (never truncated) and its
offset and length in the prompt (:func:`media_extras`): another item, or the same item at
another position, gives other keys from the first block it touches on (keys are chained), and
the blocks before it are shared. vLLM's identifier is the content hash of the item's processed
data, or the UUID the client supplied (``multi_modal_uuids``); a UUID is only as good as the
client's, so it is scoped by the namespace, which holds the request's ``cache_salt``: a salted
request never meets another salt's UUIDs (unsalted traffic trusts its clients' UUIDs, as vLLM's
own prefix cache does).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = (".safetensors", ".bin")  # PEFT's weight files, as vLLM's LoRA loader reads them
CHUNK = 1 << 20


def _files(path: Path) -> list[Path]:
    """The files an adapter at ``path`` is made of (config first, then weights by name); [] when
    it is not a local PEFT adapter directory."""
    if not path.is_dir() or not (path / CONFIG).is_file():
        return []
    weights = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHTS))
    return [path / CONFIG, *weights] if weights else []


def _stamp(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    """Each file's name, mtime (ns) and size: what the cache is keyed by besides the path."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append((f.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


def hash_adapter_files(files: list[Path]) -> str:
    """``sha256:<hex>`` over each file's name, length and bytes, in order."""
    h = hashlib.sha256(b"kvstore/lora/v1")
    for f in files:
        name = f.name.encode()
        h.update(len(name).to_bytes(4, "little") + name + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    return f"sha256:{h.hexdigest()}"


class AdapterHashes:
    """Adapter identities by ``lora_path``, computed once per path and revalidated by the files'
    mtimes and sizes (counted: ``hashed`` and ``hashed_bytes`` when computed, ``hits`` when reused)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}
        self.hashed = 0
        self.hashed_bytes = 0
        self.hits = 0

    def identity(self, lora_path: str) -> str | None:
        """The adapter's ``sha256:<hex>``, or None when ``lora_path`` is not a local PEFT adapter."""
        files = _files(Path(lora_path))
        if not files:
            return None
        stamp = _stamp(files)
        cached = self._cache.get(lora_path)
        if cached is not None and cached[0] == stamp:
            self.hits += 1
            return cached[1]
        digest = hash_adapter_files(files)
        self._cache[lora_path] = (stamp, digest)
        self.hashed += 1
        self.hashed_bytes += sum(size for _, _, size in stamp)
        return digest


    def of_request(self, request: Any) -> str | None:
        """The namespace ``adapter`` of a vLLM request: "" without a LoRA adapter, its identity with
        one, None for an adapter without one here (its request bypasses the connector)."""
        lora = getattr(request, "lora_request", None)
        if not lora:
            return ""
        path = getattr(lora, "lora_path", "") or ""
        return self.identity(path) if path else None


def _field(value: str | int) -> bytes:
    raw = str(value).encode()
    return len(raw).to_bytes(4, "little") + raw


def media_extras(features: Any, block_size: int) -> dict[int, bytes]:
    """Block index -> the extra key bytes of the multimodal items it overlaps (vLLM's
    ``request.mm_features``: ``modality``, ``identifier``, ``mm_position.offset/length``), each item
    as its modality, identifier, offset and length, length-prefixed, in the request's order."""
    extras: dict[int, bytes] = {}
    for f in features or ():
        pos = f.mm_position
        if pos.length <= 0:
            continue
        item = b"".join(_field(v) for v in (f.modality, f.identifier, pos.offset, pos.length))
        for block in range(pos.offset // block_size, (pos.offset + pos.length - 1) // block_size + 1):
            extras[block] = extras.get(block, b"") + item
    return extras
