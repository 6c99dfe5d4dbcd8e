"""Block checksums: xxh3_64 (fast, portable, available in every language)."""

from __future__ import annotations

import xxhash


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)
