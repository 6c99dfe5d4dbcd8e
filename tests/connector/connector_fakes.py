"""An in-process stand-in for ``kvstore.client.SyncClient`` with failure injection.

Used only for the connector's unit tests; the integration tests use a real sidecar.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvstore.checksum import checksum
from kvstore.errors import Unavailable
from kvstore.keys import Namespace


@dataclass
class FakeLookup:
    matched: int
    blocks: list[tuple[str, int]]
    lease_id: str | None = None


@dataclass
class FakeLease:
    views: list[np.ndarray]
    checksums: list[int]


@dataclass
class FakeAllocation:
    owner: FakeClient
    ns: Namespace
    keys: list[bytes]
    sizes: list[int]
    bufs: dict[int, np.ndarray] = field(default_factory=dict)
    committed: bool = False

    def writable(self, cpu: bool = True) -> Iterator[tuple[int, np.ndarray]]:
        for i, k in enumerate(self.keys):
            if (self.ns.root, k) not in self.owner.blocks:
                self.bufs[i] = np.zeros(self.sizes[i], np.uint8)
                yield i, self.bufs[i]

    def commit(self) -> int:
        self.owner._check("commit")
        for i, buf in self.bufs.items():
            self.owner.blocks[(self.ns.root, self.keys[i])] = (buf.copy(), checksum(buf))
        self.committed = True
        return len(self.bufs)


class FakeClient:
    def __init__(self) -> None:
        self.blocks: dict[tuple[bytes, bytes], tuple[np.ndarray, int]] = {}
        self.tier: dict[bytes, str] = {}  # key -> tier reported by lookup (default dram)
        self.down: set[str] = set()  # operations that raise Unavailable
        self.calls: Counter[str] = Counter()
        self.aborted = 0
        self.reports: list[dict] = []

    def _check(self, op: str) -> None:
        self.calls[op] += 1
        if op in self.down or "all" in self.down:
            raise Unavailable(f"fake sidecar: {op} is down")

    def _run(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and (ns.root, keys[n]) in self.blocks:
            n += 1
        return n

    def lookup(self, ns: Namespace, keys: Sequence[bytes], lease_ttl_ms: int = 0) -> FakeLookup:
        self._check("lookup")
        n = self._run(ns, keys)
        return FakeLookup(n, [(self.tier.get(k, "dram"), self.blocks[(ns.root, k)][0].size) for k in keys[:n]])

    @contextmanager
    def allocate(
        self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int], parents: Sequence[bytes] | None = None
    ) -> Iterator[FakeAllocation]:
        self._check("allocate")
        alloc = FakeAllocation(self, ns, list(keys), list(sizes))
        try:
            yield alloc
        finally:
            if not alloc.committed:
                self.aborted += 1

    @contextmanager
    def acquire(self, ns: Namespace, keys: Sequence[bytes]) -> Iterator[FakeLease]:
        self._check("acquire")
        n = self._run(ns, keys)
        views, sums = [], []
        for k in keys[:n]:
            data, crc = self.blocks[(ns.root, k)]
            v = data.view()
            v.flags.writeable = False
            views.append(v)
            sums.append(crc)
        yield FakeLease(views, sums)

    def report(self, records: Sequence[dict]) -> None:
        self._check("report")
        self.reports.extend(records)

    # --- failure injection ----------------------------------------------------------------------

    def corrupt(self, ns: Namespace, key: bytes) -> None:
        data, _ = self.blocks[(ns.root, key)]
        data[len(data) // 2] ^= 0xFF

    def evict(self, ns: Namespace, key: bytes) -> None:
        del self.blocks[(ns.root, key)]
