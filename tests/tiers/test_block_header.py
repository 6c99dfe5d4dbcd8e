"""The block header every tier keeps next to a block's bytes (kvstore/tiers/base.py): it carries
the namespace's tenant as a field; a header of version 1 (before the field) reads with no tenant,
whatever its label says; a tenant field that is not a tag is a bad header."""

from __future__ import annotations

import struct

import pytest

from kvstore.errors import ChecksumMismatch
from kvstore.keys import salt_tag
from kvstore.tiers.base import (
    HEADER_FIXED,
    BlockMeta,
    BlockRef,
    decode_header,
    encode_header,
    header_bytes,
    header_size,
)

REF = BlockRef(b"N" * 32, b"K" * 32)
TAG = salt_tag("tenant-a")


@pytest.mark.parametrize("tenant", ["", TAG])
def test_the_tenant_round_trips(tenant: str) -> None:
    meta = BlockMeta(REF, b"P" * 32, 4096, 123, f"m#{TAG}", tenant)
    raw = encode_header(meta)
    assert decode_header(raw) == meta and header_size(raw) == len(raw) == header_bytes(meta.label)


def test_a_version_1_header_has_no_tenant_whatever_its_label() -> None:
    label = f"m#{TAG[:6]}".encode()
    v1 = struct.pack("<4sH32s32s?32sQQH", b"KVB1", 1, REF.ns, REF.key, False, bytes(32), 4096, 7, len(label)) + label
    assert HEADER_FIXED + len(label) == len(v1) == header_size(v1)
    assert decode_header(v1) == BlockMeta(REF, b"", 4096, 7, f"m#{TAG[:6]}", "")


@pytest.mark.parametrize("field", [b"ABCDEF0123456789", b"abc" + bytes(13), b"../../etc/passwd"])
def test_a_tenant_field_that_is_not_a_tag_is_a_bad_header(field: bytes) -> None:
    raw = bytearray(encode_header(BlockMeta(REF, b"", 4096, 7, "m", TAG)))
    raw[HEADER_FIXED : HEADER_FIXED + 16] = field
    with pytest.raises(ChecksumMismatch, match="tenant field"):
        decode_header(raw)
