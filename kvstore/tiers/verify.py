"""Checksum-verified reads from a tier: a bad copy is a miss, and is removed. What a tier read is
first decoded by the codec its header names (:mod:`kvstore.codec`): the checksum is of the raw bytes."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvstore.checksum import checksum
from kvstore.codec import IDENTITY, UnknownCodec, decode
from kvstore.errors import ChecksumMismatch
from kvstore.tiers.base import BlockMeta, BlockRef, HashedRead, Tier

log = logging.getLogger(__name__)


def raw(meta: BlockMeta, into: memoryview) -> BlockMeta:
    """Decode in place the stored bytes a tier read into ``into`` by ``meta``'s codec: the header
    of the raw bytes (codec identity). :class:`~kvstore.codec.UnknownCodec` for a codec not registered."""
    if meta.codec == IDENTITY.id:
        return meta
    decode(meta.codec, into[: meta.size])
    return dataclasses.replace(meta, codec=IDENTITY.id)


def decoded(read: Sequence[HashedRead], into: Sequence[memoryview]) -> list[HashedRead]:
    """A batch read (header, hash of the bytes as read) made raw: each block stored through a
    codec decoded in place and hashed again; one whose codec is unknown is unreadable (None, None)."""
    out: list[HashedRead] = []
    for (meta, got), view in zip(read, into):
        if meta is None or meta.codec == IDENTITY.id:
            out.append((meta, got))
            continue
        try:
            meta = raw(meta, view)
        except UnknownCodec as exc:
            log.warning("unreadable copy of %s: %s", meta.ref.name, exc)
            out.append((None, None))
            continue
        out.append((meta, checksum(view[: meta.size])))
    return out


async def verified_get(tier: Tier, ref: BlockRef, into: memoryview, expected_checksum: int) -> BlockMeta | None:
    """Read ``ref`` into ``into`` and check its bytes against ``expected_checksum`` (the one
    recorded at commit, ``BlockMeta.checksum`` in the index).

    Returns the header of the raw bytes (decoded by the codec the stored header names), or None on
    a miss. A copy whose header is unreadable (or names a codec this process does not know), whose
    stored checksum differs from the expected one, or whose bytes do not hash to it is deleted from
    the tier and reported as a miss: never wrong data.
    """
    try:
        meta = await tier.get(ref, into)
        if meta is not None:
            meta = raw(meta, into)
    except ChecksumMismatch as exc:
        log.warning("unreadable copy of %s: %s", ref.name, exc)
        meta = None
        bad = True
    else:
        if meta is None:
            return None
        bad = meta.checksum != expected_checksum or checksum(into[: meta.size]) != expected_checksum
    if bad:
        await tier.delete(ref)
        return None
    return meta
