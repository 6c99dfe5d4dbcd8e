"""Prefix block keys and namespaces.

The scheme, exactly (so that any language can reimplement it):

* ``u32(x)`` is ``x`` as 4 bytes little-endian; ``SHA256`` is FIPS 180-4 SHA-256 (32 bytes).
* Namespace root::

      h_0 = SHA256(b"kvstore/v1/namespace" || field(name_1, value_1) || ... )
      field(n, v) = u32(len(n)) || n || u32(len(v)) || v

  over the fields of :class:`Namespace` in declaration order (model, revision, kv_layout, dtype,
  block_size, rank, world_size, adapter, cache_salt), names and values UTF-8, integers written in
  decimal (``world_size`` 0 is written as 1).
* Block ``i`` (1-based) of a prompt, covering tokens ``t`` (``len(t) <= block_size``) and
  optional extra bytes ``e`` (multimodal content hashes, ...)::

      h_i = SHA256(h_{i-1} || u32(len(t)) || u32(t_1) || ... || u32(t_n) || u32(len(e)) || e)

  Only full blocks are keyed by :func:`prefix_keys`; a trailing partial block is recomputed.
* An engine-computed block hash ``x`` (vLLM's ``BlockHash``, already chained by the engine)
  is scoped by the namespace: ``k = SHA256(b"kvstore/v1/engine" || h_0 || u32(len(x)) || x)``.

No per-process seed and no Python ``hash()`` anywhere: two hosts compute the same keys.
"""

from __future__ import annotations

import array
import functools
import hashlib
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from kvstore.errors import InvalidArgument

BlockKey = NewType("BlockKey", bytes)
NamespaceRoot = NewType("NamespaceRoot", bytes)

KEY_BYTES = 32
DTYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2", "int8", "uint8"})
KV_LAYOUTS = frozenset({"vllm_cpu", "vllm_gpu", "vllm_mla", "hf", "raw"})
# Characters a free-text namespace field may hold. The label built from them is kept with every
# block (stats, SSD and remote headers, so a restart can name it): unbounded, a 60,000-character
# model made every SSD block file 64 KiB. 256 holds any Hugging Face id (96) or a model path;
# the label then stays under 2.1 KB of UTF-8, and an SSD block's header within its 4 KiB page.
TEXT_FIELD_MAX = 256
_TEXT_FIELDS = ("model", "revision", "adapter", "cache_salt")

_U32 = struct.Struct("<I")

# A tenant's tag: the first hex digits of its cache_salt's SHA-256 (never the salt itself). 16
# digits (64 bits): a client that wants another tenant's tag has no salt giving it short of about
# 2^64 hashes (6 digits, as before, took 2^24: seconds).
TENANT_TAG_HEX = 16
# Characters of the free-text fields that the label escapes (``%XX``), so that only the label's
# own markers (``+`` adapter, ``@`` rank, ``#`` tenant) stand for them: ``model="m#<tag>"`` shows
# as ``m%23<tag>``, not as tenant <tag>'s namespace of model m.
_LABEL_ESCAPED = {c: f"%{ord(c):02X}" for c in "%+@#"}
_LABEL_TABLE = str.maketrans(_LABEL_ESCAPED)


def salt_tag(salt: str) -> str:
    """The tenant tag of a ``cache_salt``: its SHA-256's first :data:`TENANT_TAG_HEX` hex digits;
    "" for no salt."""
    return hashlib.sha256(salt.encode()).hexdigest()[:TENANT_TAG_HEX] if salt else ""


@dataclass(slots=True, frozen=True)
class Namespace:
    """Everything that changes the bytes of a block."""

    model: str
    kv_layout: str
    dtype: str
    block_size: int
    revision: str = ""
    rank: int = 0
    world_size: int = 1
    adapter: str = ""
    cache_salt: str = ""

    def __post_init__(self) -> None:
        validate_namespace(self)

    @property
    def root(self) -> NamespaceRoot:
        return namespace_root(self)

    @property
    def tenant(self) -> str:
        """The tenant whose quotas this namespace's blocks count against: its salt's tag."""
        return salt_tag(self.cache_salt)

    @property
    def label(self) -> str:
        """Short human-readable name used in stats: the model, ``+adapter``, ``@rank/world``,
        ``#tenant``; ``%+@#`` in the free text escaped, so the markers are the label's own. Only
        for reading: the tenant is :attr:`tenant`, never parsed out of a label."""
        parts = [self.model.translate(_LABEL_TABLE)]
        if self.adapter:
            parts.append(f"+{self.adapter.translate(_LABEL_TABLE)}")
        if self.world_size > 1:
            parts.append(f"@{self.rank}/{self.world_size}")
        if self.cache_salt:
            parts.append(f"#{self.tenant}")
        return "".join(parts)


_FIELD_ORDER = ("model", "revision", "kv_layout", "dtype", "block_size", "rank", "world_size", "adapter", "cache_salt")


def validate_namespace(ns: Namespace) -> None:
    if not ns.model:
        raise InvalidArgument("namespace.model: required")
    for name in _TEXT_FIELDS:
        n = len(getattr(ns, name))
        if n > TEXT_FIELD_MAX:
            raise InvalidArgument(f"namespace.{name}: {n} characters exceed the limit of {TEXT_FIELD_MAX}")
    if ns.kv_layout not in KV_LAYOUTS:
        raise InvalidArgument(f"namespace.kv_layout: {ns.kv_layout!r} is not one of {sorted(KV_LAYOUTS)}")
    if ns.dtype not in DTYPES:
        raise InvalidArgument(f"namespace.dtype: {ns.dtype!r} is not one of {sorted(DTYPES)}")
    if not isinstance(ns.block_size, int) or ns.block_size <= 0:
        raise InvalidArgument(f"namespace.block_size: must be a positive integer, got {ns.block_size!r}")
    world = ns.world_size or 1
    if ns.rank < 0 or ns.rank >= world:
        raise InvalidArgument(f"namespace.rank: {ns.rank} is outside world_size {world}")


def _field(name: str, value: str) -> bytes:
    n, v = name.encode(), value.encode()
    return _U32.pack(len(n)) + n + _U32.pack(len(v)) + v


@functools.lru_cache(maxsize=256)  # a pure function of a frozen value
def namespace_root(ns: Namespace) -> NamespaceRoot:
    h = hashlib.sha256(b"kvstore/v1/namespace")
    for name in _FIELD_ORDER:
        value = getattr(ns, name)
        if name == "world_size":
            value = value or 1
        h.update(_field(name, str(value)))
    return NamespaceRoot(h.digest())


def _chain(parent: bytes, data: bytes | memoryview, extra: bytes = b"") -> BlockKey:
    """The one definition of a block key: SHA-256 of the parent key, the token count (u32), the
    tokens (u32 each, ``data``), the extra's length (u32) and the extra; one SHA-256 call."""
    return BlockKey(
        hashlib.sha256(b"".join((parent, _U32.pack(len(data) // 4), data, _U32.pack(len(extra)), extra))).digest()
    )


def chain_key(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> BlockKey:
    return _chain(parent, token_bytes(tokens), extra)


_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"  # the array typecode of a u32


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """``tokens`` as the bytes block keys hash: ``u32`` each, little-endian."""
    if isinstance(tokens, np.ndarray):
        return np.asarray(tokens, dtype="<u4").tobytes()
    a = array.array(_U32_CODE, tokens)  # a list of ints converts ~4x faster than through numpy
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()



def _chain_full_blocks(
    parent: bytes, data: bytes, block_size: int, first: int, end: int, extras: Mapping[int, bytes] | None = None
) -> list[BlockKey]:
    """Keys of full blocks ``first..end-1`` of the token bytes ``data``, chained from ``parent``
    (the key of block ``first - 1``, or the root); ``extras[i]`` (if any) goes into block ``i``'s key."""
    step = 4 * block_size
    mv = memoryview(data)
    keys: list[BlockKey] = []
    for i in range(first, end):
        parent = _chain(parent, mv[i * step : (i + 1) * step], extras.get(i, b"") if extras else b"")
        keys.append(parent)
    return keys


def prefix_keys(
    ns: Namespace | NamespaceRoot,
    tokens: Sequence[int] | np.ndarray,
    block_size: int | None = None,
    extras: Iterable[bytes] | None = None,
) -> list[BlockKey]:
    """Keys of every full block of ``tokens``."""
    if isinstance(ns, Namespace):
        root, block_size = ns.root, block_size or ns.block_size
    else:
        root = ns
        if block_size is None:
            raise ValueError("block_size is required with a bare namespace root")
    data = token_bytes(tokens)
    return _chain_full_blocks(
        root, data, block_size, 0, len(data) // (4 * block_size), None if extras is None else dict(enumerate(extras))
    )


class PrefixKeys:
    """The keys of one growing token sequence (a request's prompt, then its generated tokens):
    :meth:`of` hashes only the full blocks it has not keyed before. Tokens that differ from the
    ones keyed before (compared byte for byte) are keyed from scratch."""

    __slots__ = ("_data", "_extras", "_keys", "block_size", "root")

    def __init__(self, ns: Namespace, extras: Mapping[int, bytes] | None = None) -> None:
        """``extras``: block index -> the extra bytes in its key (multimodal items it overlaps)."""
        self.root, self.block_size, self._extras = ns.root, ns.block_size, extras
        self._data = b""  # the token bytes of the full blocks in _keys
        self._keys: list[BlockKey] = []

    def of(self, tokens: Sequence[int] | np.ndarray) -> list[BlockKey]:
        """``prefix_keys(ns, tokens)``."""
        step = 4 * self.block_size
        data = token_bytes(tokens)
        n = len(data) // step
        known = min(n, len(self._keys))
        if data[: known * step] != self._data[: known * step]:
            self._data, self._keys, known = b"", [], 0
        if n > known:
            parent = self._keys[known - 1] if known else self.root
            self._keys.extend(_chain_full_blocks(parent, data, self.block_size, known, n, self._extras))
            self._data = data[: n * step]
        return self._keys[:n]


def engine_key(ns: Namespace | NamespaceRoot, engine_hash: bytes) -> BlockKey:
    root = ns.root if isinstance(ns, Namespace) else ns
    h = hashlib.sha256(b"kvstore/v1/engine")
    h.update(root)
    h.update(_U32.pack(len(engine_hash)))
    h.update(engine_hash)
    return BlockKey(h.digest())


def check_key(key: bytes, field: str) -> BlockKey:
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"{field}: a block key is {KEY_BYTES} bytes, got {len(key)}")
    return BlockKey(key)
