"""The segment tier's in-memory index: each live block's log record, by (namespace root, key).

The records sit in one numpy array of :data:`ROW` rows: a log record (:data:`~kvstore.tiers.segments.log.RECORD`,
128 bytes) less its key and its reserved bytes, 73 bytes a block. One dict per namespace root maps
a block's 32-byte key to its row, and a list gives each row's key back: the key objects are the
ones the tier was given (a put's ``BlockRef.key``: the sidecar's ``Block.key``) or hands out
(:meth:`Rows.live_keys`, what a restart's scan names), so a block's key is one bytes object in the
tier and in the sidecar's index (issue 41: where a 64-byte root + key was built for this dict and
the key was held a third time in the record). What the rows give out are whole log records again
(:func:`_records`: a checkpoint writes them as they are). Not thread-safe: the tier holds its lock.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.tiers.segments.log import PUT, RECORD

_FIELDS: dict[str, Any] = dict(RECORD.fields or {})
ROW = np.dtype([(name, _FIELDS[name][0]) for name in _FIELDS if name not in ("key", "reserved")])
_ROW_FIELDS = [name for name in _FIELDS if name not in ("key", "reserved")]


def _spans() -> list[tuple[int, int, int]]:
    """The byte ranges a row copies from a record: (offset in the record, offset in the row, length)."""
    spans: list[tuple[int, int, int]] = []
    at = 0
    for name in _ROW_FIELDS:
        dtype, offset = _FIELDS[name][0], _FIELDS[name][1]
        if spans and spans[-1][0] + spans[-1][2] == offset:
            spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + dtype.itemsize)
        else:
            spans.append((offset, at, dtype.itemsize))
        at += dtype.itemsize
    return spans


_SPANS = _spans()  # (two: the fields before the key, those between it and the reserved bytes)

# One row's fields as Python values, read straight from the array's bytes (a read's lookup: no
# numpy scalar or record built per block): op, flags, cls, ns, seq, parent, size, checksum, seg,
# slot, codec. (An ndarray is a buffer; numpy's stubs do not say so to mypy on Python 3.11.)
_ROW_STRUCT = struct.Struct("<BBHIQ32sQQIIB")
assert _ROW_STRUCT.size == ROW.itemsize and ROW.names == (
    "op", "flags", "cls", "ns", "seq", "parent", "size", "checksum", "seg", "slot", "codec"
)
_SEQ = struct.Struct("<Q")
_SEQ_AT = struct.calcsize("<BBHI")  # (the seq's offset in a row: after op, flags, cls, ns)


def _rows(records: np.ndarray) -> np.ndarray:
    """Log records as rows (their keys and reserved bytes left out), copied as bytes."""
    n = len(records)
    src = np.ascontiguousarray(records).view(np.uint8).reshape(n, RECORD.itemsize)
    out = np.empty((n, ROW.itemsize), np.uint8)
    for at, to, length in _SPANS:
        out[:, to : to + length] = src[:, at : at + length]
    rows: np.ndarray = out.view(ROW).reshape(n)
    return rows


def _records(rows: np.ndarray, keys: Sequence[bytes]) -> np.ndarray:
    """Rows as log records again, ``keys`` their keys (the reserved bytes zero)."""
    n = len(rows)
    src = np.ascontiguousarray(rows).view(np.uint8).reshape(n, ROW.itemsize)
    out = np.zeros((n, RECORD.itemsize), np.uint8)
    for at, to, length in _SPANS:
        out[:, at : at + length] = src[:, to : to + length]
    records: np.ndarray = out.view(RECORD).reshape(n)
    if n:
        records["key"] = np.frombuffer(b"".join(keys), "V32")
    return records


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
    """Live records, by namespace root and key."""

    def __init__(self) -> None:
        self._arr = np.zeros(1024, ROW)
        self._n = 0  # rows ever used
        self._free: list[int] = []
        self._where: dict[bytes, dict[bytes, int]] = {}  # namespace root -> key -> row
        self._keys: list[bytes | None] = []  # row -> the key object its dict holds (None: a free row)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def has(self, root: bytes, key: bytes) -> bool:
        rows = self._where.get(root)
        return rows is not None and key in rows

    def nbytes(self) -> int:
        """The row array, the dicts, their keys (bytes objects: shared with the sidecar's
        index when one reads this tier) and row numbers, and the row -> key list, in bytes."""
        total = int(self._arr.nbytes) + sys.getsizeof(self._keys) + sys.getsizeof(self._where)
        for rows in self._where.values():
            total += sys.getsizeof(rows) + sum(sys.getsizeof(k) for k in rows)
            total += sum(sys.getsizeof(i) for i in rows.values())  # (small ints are shared; most are not)
        return total

    def get(self, root: bytes, key: bytes) -> Any:
        """A copy of the record of ``key`` in namespace ``root`` (a numpy structured scalar), or None."""
        rows = self._where.get(root)
        i = rows.get(key) if rows is not None else None
        return None if i is None else _records(self._arr[i : i + 1], [key])[0]

    def find(self, root: bytes, key: bytes) -> tuple[Any, ...] | None:
        """The row of ``key`` in namespace ``root`` as a tuple (op, flags, cls, ns, seq, parent, size,
        checksum, seg, slot, codec; the parent's 32 bytes whole), or None: what a read needs, with
        no record built (:meth:`get` builds one)."""
        rows = self._where.get(root)
        i = rows.get(key) if rows is not None else None
        return None if i is None else _ROW_STRUCT.unpack_from(self._arr, i * ROW.itemsize)  # type: ignore[arg-type]

    def seq(self, root: bytes, key: bytes) -> int | None:
        """The sequence number of ``key``'s record in namespace ``root`` (None: not held)."""
        rows = self._where.get(root)
        i = rows.get(key) if rows is not None else None
        return None if i is None else int(_SEQ.unpack_from(self._arr, i * ROW.itemsize + _SEQ_AT)[0])  # type: ignore[arg-type]

    def _row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._n == len(self._arr):
            grown = np.zeros(2 * len(self._arr), ROW)
            grown[: self._n] = self._arr[: self._n]
            self._arr = grown
        self._n += 1
        if len(self._keys) < self._n:
            self._keys.append(None)
        return self._n - 1

    def put(self, records: np.ndarray, refs: Sequence[tuple[bytes, bytes]]) -> list[tuple[int, int]]:
        """Enter committed records, ``refs`` their (namespace root, key); the (class, slot) of each
        record they replace."""
        old = []
        records = _rows(records)
        for i, (root, key) in enumerate(refs):
            rows = self._where.get(root)
            if rows is None:
                rows = self._where[root] = {}
            row = rows.get(key)
            if row is None:
                row = rows[key] = self._row()
                self._keys[row] = key
                self._count += 1
            else:
                old.append((int(self._arr["cls"][row]), int(self._arr["slot"][row])))
            self._arr[row] = records[i]
        return old

    def pop(self, refs: Sequence[tuple[bytes, bytes]]) -> np.ndarray:
        """Remove the (namespace root, key)s held; their records (copies)."""
        found, keys = [], []
        for root, key in refs:
            rows = self._where.get(root)
            row = rows.pop(key, None) if rows is not None else None
            if row is None:
                continue
            found.append(row)
            keys.append(key)
            self._keys[row] = None
            if not rows:
                del self._where[root]
        self._count -= len(found)
        out = _records(self._arr[found], keys)
        self._arr["op"][found] = 0
        self._free.extend(found)
        return out

    def live(self) -> np.ndarray:
        """Every live record (a copy), in row order."""
        records, keys = self.live_keys()
        return _records(records, keys)

    def live_keys(self) -> tuple[np.ndarray, list[bytes]]:
        """Every live row (a copy, :data:`ROW`: no key) and its key object (the one this index
        holds), in row order."""
        arr = self._arr[: self._n]
        rows = np.flatnonzero(arr["op"] == PUT)
        keys = self._keys
        return arr[rows], [k for k in map(keys.__getitem__, rows.tolist()) if k is not None]  # (every live row has one)

    def restore(self, records: np.ndarray, roots: Sequence[bytes]) -> dict[int, np.ndarray]:
        """Rebuilt from a log's records (in order); the live slots of each size class."""
        records = records[records["ns"] < len(roots)] if len(records) else records
        if not len(records):
            return {}
        ids = records["ns"]
        one_root = len({roots[u] for u in np.unique(ids).tolist()}) == 1  # (the common case: one model)
        if one_root:  # the 32-byte keys kept from here on find each block's last record
            blob = records["key"].tobytes()
            keys = [blob[i : i + 32] for i in range(0, len(records) * 32, 32)]
        else:  # 64-byte root + keys, only to find them
            keys = _keys(records, roots)
        where = _last_puts(keys, records["op"])
        checkpointed = len(where) == len(records)  # each record a live put of its own key
        live = records if checkpointed else records[np.fromiter(where.values(), np.int64, len(where))]
        kept = list(where)  # live's keys, in its order
        del keys
        sid = (live["cls"].astype(np.uint64) << np.uint64(40)) | live["slot"].astype(np.uint64)
        deduped = len(np.unique(sid)) != len(sid)
        if deduped:  # two records name one slot: the later one holds it
            order = np.argsort(-live["seq"].astype(np.int64), kind="stable")
            _, first = np.unique(sid[order], return_index=True)
            keep = np.sort(order[first])
            live, kept = live[keep], [kept[i] for i in keep.tolist()]
        n = len(live)
        self._arr = np.zeros(max(1024, n + n // 4), ROW)
        self._arr[:n] = _rows(live)
        self._n = n
        self._free = []
        if one_root:
            self._keys = list(kept)
            rows = where if checkpointed and not deduped else dict(zip(kept, range(n)))
            self._where = {roots[int(ids[0])]: rows}
        else:
            blob = live["key"].tobytes()
            keys = [blob[i : i + 32] for i in range(0, n * 32, 32)]
            self._keys = list(keys)
            self._where = {}
            ns = live["ns"]
            for u in np.unique(ns).tolist():  # (ids of one root, another label: one dict)
                at = np.flatnonzero(ns == u).tolist()
                self._where.setdefault(roots[u], {}).update(zip(map(keys.__getitem__, at), at))
        self._count = n
        return {int(c): live["slot"][live["cls"] == c].astype(np.int64) for c in np.unique(live["cls"])}
