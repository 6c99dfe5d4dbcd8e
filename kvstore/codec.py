"""The codec seam: where a block's bytes are transformed between DRAM's slab and a tier below (or
the peer data path), and back.

Every write down a level (a demotion, a write-through, an eviction's pass-down, the stop's drain)
writes what its level's codec encodes (:meth:`kvstore.movers.level.Level.encoded`), and the
block's header names the codec (``BlockMeta.codec``; the segment layout keeps it in its log
record; a peer answer in each entry). A read decodes by the codec its header names
(:func:`decode`) before the checksum is compared: the checksum recorded at commit is always over
the raw bytes the engine reads, never over what a tier stores. A header naming a codec this process
does not know is an unreadable copy (:class:`UnknownCodec`: a miss, never handed to a model).

Only :data:`IDENTITY` ships (id 0; headers written before the field existed read as it). A codec
of this step keeps a block's size (``stored_size(size) == size``, checked by :func:`encode`): the
tiers size a read, and a level its footprint, by the block's size. A compressing codec (a later
issue) adds the stored size to the header and has the level account it as the footprint
(:meth:`Codec.stored_size` is that hook).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.errors import ChecksumMismatch


class Codec(Protocol):
    """A reversible transform of a block's bytes on their way to a tier and back."""

    id: int  # the byte a header names it by (1-255; 0 is identity)
    name: str

    def stored_size(self, size: int) -> int:
        """Bytes stored for a raw block of ``size`` bytes (the footprint a level accounts)."""
        ...

    def encode(self, raw: memoryview) -> memoryview:
        """The bytes to store for ``raw`` (may be ``raw`` itself; ``raw`` is not changed)."""
        ...

    def decode(self, stored: memoryview, into: memoryview) -> None:
        """Write the raw bytes of ``stored`` into ``into`` (``len(into)`` raw bytes)."""
        ...


class Identity:
    """Bytes stored as they are: the default, and every header without a codec field."""

    id = 0
    name = "identity"

    def stored_size(self, size: int) -> int:
        return size

    def encode(self, raw: memoryview) -> memoryview:
        return raw

    def decode(self, stored: memoryview, into: memoryview) -> None:
        if stored is not into:
            into[:] = stored


IDENTITY = Identity()
_codecs: dict[int, Codec] = {IDENTITY.id: IDENTITY}


class UnknownCodec(ChecksumMismatch):
    """A header names a codec this process does not know: the copy cannot be read."""


def register(codec: Codec) -> None:
    """Make ``codec`` readable and writable by its id (another codec under a taken id is refused)."""
    if not 0 <= codec.id <= 0xFF:
        raise ValueError(f"codec.id must be 0-255, got {codec.id}")
    known = _codecs.get(codec.id)
    if known is not None and known is not codec:
        raise ValueError(f"codec.id {codec.id} is taken by {known.name!r}")
    _codecs[codec.id] = codec


def unregister(codec: Codec) -> None:
    if codec.id != IDENTITY.id and _codecs.get(codec.id) is codec:
        del _codecs[codec.id]


def codec_of(codec_id: int) -> Codec:
    """The registered codec named ``codec_id``; :class:`UnknownCodec` when there is none."""
    codec = _codecs.get(codec_id)
    if codec is None:
        raise UnknownCodec(f"codec: unknown codec id {codec_id} (known: {sorted(_codecs)})")
    return codec


def encode(codec: Codec, raw: memoryview) -> memoryview:
    """The bytes stored for ``raw`` through ``codec`` (as many as ``raw``: this step's seam)."""
    if codec.id == IDENTITY.id:
        return raw
    stored = codec.encode(raw)
    if len(stored) != len(raw):
        raise ValueError(f"codec {codec.name!r}: stored {len(stored)} bytes for a block of {len(raw)}")
    return stored


def decode(codec_id: int, data: memoryview) -> None:
    """Decode in place the stored bytes in ``data`` by the codec named ``codec_id`` (identity: as
    they are); :class:`UnknownCodec` when it is not registered."""
    if codec_id == IDENTITY.id:
        return
    codec_of(codec_id).decode(memoryview(bytes(data)), data)
