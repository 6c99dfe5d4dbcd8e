"""One int object for each of the few values that many blocks repeat (issue 41, the compact index).

An int above 256 is a new 28-byte object (32 with the allocator's rounding) each time Python makes
one: a million blocks of 16 KiB read back from a tier hold a million ``16384``s as their size, and
as many as their footprint. :func:`shared` hands every caller of one value the same object. The
values a store sees are few (block sizes, their footprints); past ``LIMIT`` distinct ones a value
is returned as it is, so a client sending odd sizes cannot grow the table.
"""

from __future__ import annotations

LIMIT = 4096

_SHARED: dict[int, int] = {}


def shared(n: int) -> int:
    """``n``, as the one object every caller with the same value gets (while the table has room)."""
    got = _SHARED.get(n)
    if got is not None:
        return got
    if len(_SHARED) < LIMIT:
        _SHARED[n] = n
    return n
