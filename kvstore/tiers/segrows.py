"""The segment tier's in-memory index: each live block's log record, by (namespace root, key).

The records sit in one numpy array of :data:`~kvstore.tiers.seglog.RECORD` rows (128 bytes a
block, exactly what the log holds for it), and a dict maps the 64-byte (root + key) to a row; a
checkpoint writes the live rows as they are. Not thread-safe: the tier holds its lock.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.tiers.seglog import PUT, RECORD


def _keys(records: np.ndarray, roots: Sequence[bytes]) -> list[bytes]:
    """Each record's (namespace root + key), 64 bytes."""
    n = len(records)
    table = np.frombuffer(b"".join(roots), np.uint8).reshape(-1, 32)
    keys = np.empty((n, 64), np.uint8)
    keys[:, :32] = table[records["ns"]]
    keys[:, 32:] = np.frombuffer(records["key"].tobytes(), np.uint8).reshape(n, 32)
    blob = keys.tobytes()
    return [blob[i : i + 64] for i in range(0, n * 64, 64)]


def _last_puts(keys: list[bytes], ops: np.ndarray) -> dict[bytes, int]:
    """Each key's last record, where that is a put: key -> record number."""
    if bool((ops == PUT).all()):
        return dict(zip(keys, range(len(keys))))  # (a checkpointed log: puts only)
    where: dict[bytes, int] = {}
    for i, (k, op) in enumerate(zip(keys, ops.tolist())):
        if op == PUT:
            where[k] = i
        else:
            where.pop(k, None)
    return where


class Rows:
    """Live records, by key."""

    def __init__(self) -> None:
        self._arr = np.zeros(1024, RECORD)
        self._n = 0  # rows ever used
        self._free: list[int] = []
        self._where: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: bytes) -> bool:
        return key in self._where

    def nbytes(self) -> int:
        """The record array, the dict and its keys (bytes objects), in bytes."""
        keys = sum(sys.getsizeof(k) for k in self._where)
        ints = sum(sys.getsizeof(i) for i in self._where.values())  # (small ints are shared; most are not)
        return int(self._arr.nbytes) + sys.getsizeof(self._where) + keys + ints

    def get(self, key: bytes) -> Any:
        """A copy of ``key``'s record (a numpy structured scalar), or None."""
        i = self._where.get(key)
        return None if i is None else self._arr[i].copy()

    def _row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._n == len(self._arr):
            grown = np.zeros(2 * len(self._arr), RECORD)
            grown[: self._n] = self._arr[: self._n]
            self._arr = grown
        self._n += 1
        return self._n - 1

    def put(self, records: np.ndarray, keys: list[bytes]) -> list[tuple[int, int]]:
        """Enter committed records; the (class, slot) of each record they replace."""
        old = []
        for i, key in enumerate(keys):
            row = self._where.get(key)
            if row is None:
                row = self._where[key] = self._row()
            else:
                old.append((int(self._arr["cls"][row]), int(self._arr["slot"][row])))
            self._arr[row] = records[i]
        return old

    def pop(self, keys: list[bytes]) -> np.ndarray:
        """Remove the keys held; their records (copies)."""
        rows = [r for r in (self._where.pop(k, None) for k in keys) if r is not None]
        out = self._arr[rows].copy()
        self._arr["op"][rows] = 0
        self._free.extend(rows)
        return out

    def live(self) -> np.ndarray:
        """Every live record (a copy), in no particular order."""
        arr = self._arr[: self._n]
        live: np.ndarray = arr[arr["op"] == PUT].copy()
        return live

    def restore(self, records: np.ndarray, roots: Sequence[bytes]) -> dict[int, np.ndarray]:
        """Rebuilt from a log's records (in order); the live slots of each size class."""
        records = records[records["ns"] < len(roots)] if len(records) else records
        if not len(records):
            return {}
        keys = _keys(records, roots)
        where = _last_puts(keys, records["op"])
        if len(where) == len(records):  # each record a live put of its own key (a checkpointed log)
            live = records
        else:
            live = records[np.fromiter(where.values(), np.int64, len(where))]
            keys = list(where)
            where = dict(zip(keys, range(len(live))))
        sid = (live["cls"].astype(np.uint64) << np.uint64(40)) | live["slot"].astype(np.uint64)
        if len(np.unique(sid)) != len(sid):  # two records name one slot: the later one holds it
            order = np.argsort(-live["seq"].astype(np.int64), kind="stable")
            _, first = np.unique(sid[order], return_index=True)
            keep = np.sort(order[first])
            live, keys = live[keep], [keys[i] for i in keep.tolist()]
            where = dict(zip(keys, range(len(live))))
        self._arr = np.zeros(max(1024, len(live) + len(live) // 4), RECORD)
        self._arr[: len(live)] = live
        self._n = len(live)
        self._free = []
        self._where = where
        return {int(c): live["slot"][live["cls"] == c].astype(np.int64) for c in np.unique(live["cls"])}
