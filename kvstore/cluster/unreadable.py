"""The ``members`` entries a node cannot read, and since when each has been there unchanged.

An entry that is not UTF-8 or not ``address|incarnation|expiry_ms`` (a stray write, a bad byte, a
version that writes another format) is skipped by every read of the members
(:func:`~kvstore.cluster.directory.parse_member`); nobody renews it, so once it has been there
unchanged for longer than a lease it is deleted (compare-and-delete: an entry rewritten since
stays), a bounded batch a heartbeat. So such entries cannot pile up and slow every heartbeat.
"""

from __future__ import annotations

from itertools import islice

TRACKED = 1 << 20  # entries followed at most (the rest are followed once those are gone)


class UnreadableMembers:
    def __init__(self) -> None:
        self._since: dict[bytes, tuple[bytes, int]] = {}  # field -> (value, first seen in directory ms)

    def __len__(self) -> int:
        return len(self._since)

    def seen(self, entries: dict[bytes, bytes], now_ms: int) -> int:
        """The unreadable entries of a heartbeat (field -> value) read at ``now_ms`` (the
        directory's clock); how many of them are new (or changed) since the last one."""
        since: dict[bytes, tuple[bytes, int]] = {}
        new = 0
        for field, value in islice(entries.items(), TRACKED):
            prev = self._since.get(field)
            if prev is not None and prev[0] == value:
                since[field] = prev
            else:
                since[field] = (value, now_ms)
                new += 1
        self._since = since
        return new

    def due(self, now_ms: int, age_ms: int, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` entries (field, value) unchanged for ``age_ms`` or longer at ``now_ms``."""
        old = ((f, v) for f, (v, t) in self._since.items() if now_ms - t >= age_ms)
        return list(islice(old, limit))

    def gone(self, entries: list[tuple[bytes, bytes]]) -> None:
        for field, _ in entries:
            self._since.pop(field, None)
