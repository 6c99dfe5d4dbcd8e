"""The tier Protocol: one small async interface that every storage tier implements.

Tiers store opaque block bytes plus a small self-describing header (:class:`BlockMeta`), so a
restarted sidecar can rebuild its index from what a tier holds (the :class:`Recoverable`
ability). Tiers do not judge checksums: the tiering layer verifies every block that crosses a
tier boundary against the checksum recorded at commit (one place for that decision).

A tier that cannot reach its server raises :class:`kvstore.errors.Unavailable`; a missing block is
``None`` / ``False``, never an error.
"""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvstore.checksum import checksums
from kvstore.errors import ChecksumMismatch
from kvstore.keys import TENANT_TAG_HEX, BlockKey, NamespaceRoot
from kvstore.util.threads import in_threads, split


@dataclass(slots=True, frozen=True)
class BlockRef:
    """A block's identity in every tier: its namespace root and its 32-byte key."""

    ns: NamespaceRoot
    key: BlockKey

    @property
    def name(self) -> str:
        """Storage name: ``<ns hex 16>/<key hex 64>`` (file names, Redis keys, S3 object keys)."""
        return f"{self.ns.hex()[:16]}/{self.key.hex()}"


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a tier keeps next to the bytes of a block."""

    ref: BlockRef
    parent: bytes  # key of the previous block in the prefix, b"" for the first
    size: int
    checksum: int  # xxh3_64 of the bytes
    label: str = ""  # namespace label, for stats after a restart (only for reading)
    tenant: str = ""  # the namespace's tenant tag (kvstore.store.books.tenants), for its quotas after a restart
    codec: int = 0  # the codec the stored bytes went through (kvstore.tiers.codec; 0: identity, as stored)


# magic, version, ns(32), key(32), has_parent, parent(32), size, checksum, length of the rest; the
# rest (version 2): the tenant tag (TENANT_BYTES, ASCII, NUL-padded; all NUL: no tenant), the label.
# Version 3 starts the rest with one byte more, the codec id (kvstore.tiers.codec), and is written
# only for a codec other than identity: an identity block's header is version 2, byte for byte what
# it was before the field (older sidecars read it; they refuse a version 3 one as a bad header).
# Version 1 (before the tenant was a field) has the label alone: read with no tenant, since its
# label, built from the client's free text, cannot tell one. Versions 1 and 2 read as identity.
_HEADER = struct.Struct("<4sH32s32s?32sQQH")
MAGIC = b"KVB1"
VERSION = 2
VERSION_CODEC = 3
TENANT_BYTES = TENANT_TAG_HEX
LABEL_MAX = 0xFFFF - TENANT_BYTES  # label bytes a header keeps (the rest's length is a u16)
HashedRead = tuple[BlockMeta | None, int | None]  # a block's header (None on a miss) and the xxh3_64 of its bytes


def _label_bytes(label: str, codec: int = 0) -> bytes:
    return label.encode()[: LABEL_MAX - bool(codec)]


def header_bytes(label: str, codec: int = 0) -> int:
    """Length of the header :func:`encode_header` writes for a block with ``label`` (and ``codec``)."""
    return _HEADER.size + bool(codec) + TENANT_BYTES + len(_label_bytes(label, codec))


def encode_header(meta: BlockMeta) -> bytes:
    codec = bytes([meta.codec]) if meta.codec else b""  # (version 3 only)
    rest = codec + meta.tenant.encode().ljust(TENANT_BYTES, b"\0") + _label_bytes(meta.label, meta.codec)
    return (
        _HEADER.pack(
            MAGIC, VERSION_CODEC if meta.codec else VERSION, meta.ref.ns, meta.ref.key, bool(meta.parent),
            meta.parent.ljust(32, b"\0"), meta.size, meta.checksum, len(rest),
        )
        + rest
    )


def header_size(buf: bytes | bytearray | memoryview) -> int:
    """Total header length (fixed part + the rest) given at least the fixed part."""
    if len(buf) < _HEADER.size:
        raise ChecksumMismatch(f"block header truncated ({len(buf)} of {_HEADER.size} bytes)")
    return _HEADER.size + int(_HEADER.unpack_from(buf)[-1])


HEADER_FIXED = _HEADER.size


def decode_header(buf: bytes | bytearray | memoryview) -> BlockMeta:
    """The header at the start of ``buf``; :class:`ChecksumMismatch` when it is not one."""
    if len(buf) < _HEADER.size:
        raise ChecksumMismatch(f"block header truncated ({len(buf)} of {_HEADER.size} bytes)")
    magic, version, ns, key, has_parent, parent, size, checksum, n = _HEADER.unpack_from(buf)
    if magic != MAGIC or version not in (1, VERSION, VERSION_CODEC):
        raise ChecksumMismatch(f"bad block header (magic {magic!r}, version {version})")
    rest = bytes(buf[_HEADER.size : _HEADER.size + n])
    tenant, codec = "", 0
    if version == VERSION_CODEC:
        if not rest or not rest[0]:
            raise ChecksumMismatch(f"bad block header (codec field {rest[:1]!r})")
        codec, rest = rest[0], rest[1:]
    if version >= VERSION:
        tenant = _tenant(rest[:TENANT_BYTES])
        rest = rest[TENANT_BYTES:]
    label = rest.decode(errors="replace")
    return BlockMeta(BlockRef(ns, key), parent if has_parent else b"", size, checksum, label, tenant, codec)


_HEX = frozenset(b"0123456789abcdef")


def _tenant(field: bytes) -> str:
    """The tenant tag of a header's field; :class:`ChecksumMismatch` when it is not one."""
    if len(field) == TENANT_BYTES and (field == bytes(TENANT_BYTES) or _HEX.issuperset(field)):
        return field.rstrip(b"\0").decode()
    raise ChecksumMismatch(f"bad block header (tenant field {field!r})")


@runtime_checkable
class Tier(Protocol):
    """A storage tier below DRAM (SSD, Redis, S3)."""

    name: str

    async def contains(self, ref: BlockRef) -> bool: ...

    async def get(self, ref: BlockRef, into: memoryview) -> BlockMeta | None:
        """Read the block into ``into`` (at least ``size`` bytes); its header, or None on a miss."""
        ...

    async def put(self, meta: BlockMeta, data: memoryview) -> None: ...

    async def delete(self, ref: BlockRef) -> None: ...

    async def close(self) -> None: ...

    # Batch forms. Implementations override them where the server can batch (pipelines,
    # concurrent requests); :class:`TierBase` gives loops over the single-key calls.
    async def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]: ...

    async def get_many(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]: ...

    async def get_many_hashed(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[HashedRead]:
        """``get_many`` plus the xxh3_64 of each block's bytes as read (None on a miss), for the
        tiering layer to compare with the commit's checksum."""
        ...

    async def put_many(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None: ...

    async def delete_many(self, refs: Sequence[BlockRef]) -> None: ...


@runtime_checkable
class Recoverable(Protocol):
    """A tier whose contents survive the sidecar: list them after a restart."""

    def scan(self) -> AsyncIterator[BlockMeta]: ...


# One block as a restart lists it, without a BlockMeta: (namespace root, key, parent, size,
# checksum, label, tenant, codec), the fields of :class:`BlockMeta` flattened.
Row = tuple[NamespaceRoot, BlockKey, bytes, int, int, str, str, int]


def meta_row(m: BlockMeta) -> Row:
    return (m.ref.ns, m.ref.key, m.parent, m.size, m.checksum, m.label, m.tenant, m.codec)


@runtime_checkable
class ScansRows(Protocol):
    """A :class:`Recoverable` tier that also lists its blocks as batches of :data:`Row`, in
    ``scan``'s order: what a restart's recovery reads (kvstore.movers.recovery), without building
    a ``BlockRef`` and a ``BlockMeta`` per block."""

    def scan_rows(self) -> AsyncIterator[list[Row]]: ...


@runtime_checkable
class Bounded(Protocol):
    """A tier with a fixed capacity that the sidecar fills and evicts itself (SSD)."""

    capacity_bytes: int

    def footprint(self, size: int, label: str) -> int:
        """Bytes of capacity that a block of ``size`` bytes takes (header with ``label``, alignment)."""
        ...


class TierBase:
    """Default batch forms that loop over the single-key calls, and the whole-config constructor."""

    @classmethod
    def from_app_config(cls, config: Any) -> Any:
        """Build from the whole :class:`kvstore.config.Config`: its section named ``cls.name``
        goes to ``cls.from_config``. Tiers that need shared settings override this."""
        return cls.from_config(getattr(config, cls.name))  # type: ignore[attr-defined]  # each tier class has its own

    async def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        return [await self.contains(r) for r in refs]  # type: ignore[attr-defined]  # a Tier method (mixin)

    async def get_many(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        return [await self.get(r, b) for r, b in zip(refs, into)]  # type: ignore[attr-defined]  # a Tier method (mixin)

    async def get_many_hashed(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[HashedRead]:
        """Read, then hash (:func:`with_hashes`); tiers that can hash while the bytes arrive override it."""
        return await with_hashes(await self.get_many(refs, into), into)

    async def put_many(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        for meta, data in items:
            await self.put(meta, data)  # type: ignore[attr-defined]  # a Tier method (mixin)

    async def delete_many(self, refs: Sequence[BlockRef]) -> None:
        for r in refs:
            await self.delete(r)  # type: ignore[attr-defined]  # a Tier method (mixin)


class ThreadedTier(TierBase):
    """A tier of synchronous local I/O (both SSD layouts): a batch split over ``io_threads``
    threads of ``_io`` (a device answers several reads at once, and page-cache copies run on
    several cores), each block hashed by the thread that read it. A subclass gives the three
    synchronous steps: :meth:`read_one`, :meth:`write_batch` (durable on return) and
    :meth:`remove_batch`."""

    io_threads: int
    _io: ThreadPoolExecutor

    def read_one(self, ref: BlockRef, into: memoryview, hashed: bool) -> HashedRead:
        raise NotImplementedError

    def write_batch(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        raise NotImplementedError

    def remove_batch(self, refs: Sequence[BlockRef]) -> None:
        raise NotImplementedError

    async def get(self, ref: BlockRef, into: memoryview) -> BlockMeta | None:
        return (await self.get_many([ref], [into]))[0]

    async def get_many(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[BlockMeta | None]:
        return [meta for meta, _ in await self._read_many(refs, into, hashed=False)]

    async def get_many_hashed(self, refs: Sequence[BlockRef], into: Sequence[memoryview]) -> list[HashedRead]:
        return await self._read_many(refs, into, hashed=True)

    async def _read_many(
        self, refs: Sequence[BlockRef], into: Sequence[memoryview], hashed: bool
    ) -> list[HashedRead]:
        def read(a: int, b: int) -> list[HashedRead]:
            return [self.read_one(r, buf, hashed) for r, buf in zip(refs[a:b], into[a:b])]

        calls = [functools.partial(read, a, b) for a, b in split(len(refs), self.io_threads)]
        parts = await in_threads(self._io, calls)
        return [got for part in parts for got in part]

    async def put(self, meta: BlockMeta, data: memoryview) -> None:
        await self.put_many([(meta, data)])

    async def put_many(self, items: Sequence[tuple[BlockMeta, memoryview]]) -> None:
        """(Returns, raises or is cancelled once no thread holds ``items``' buffers: ``in_threads``.
        ``write_batch`` spreads its files over ``_io``, so it runs on the loop's default pool.)"""
        if items:
            await in_threads(None, [functools.partial(self.write_batch, items)])

    async def delete(self, ref: BlockRef) -> None:
        await self.delete_many([ref])

    async def delete_many(self, refs: Sequence[BlockRef]) -> None:
        if refs:
            await asyncio.to_thread(self.remove_batch, refs)


async def with_hashes(metas: Sequence[BlockMeta | None], into: Sequence[memoryview]) -> list[HashedRead]:
    """Each read block's header with the xxh3_64 of the bytes it filled (:func:`kvstore.checksum.checksums`)."""
    read = [(i, v[: m.size]) for i, (v, m) in enumerate(zip(into, metas)) if m is not None]
    sums: list[int | None] = [None] * len(metas)
    for (i, _), c in zip(read, await checksums([v for _, v in read])):
        sums[i] = c
    return list(zip(metas, sums))
