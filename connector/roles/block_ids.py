"""Engine block ids as the metadata carries them to the worker: one read-only int64 array.

The scheduler side gets a request's block table from the engine as Python ints; a load's or a
save's ids are turned into one array once, when the step's metadata is built (scheduler side,
once per spec), so the worker hands them to the transfer engine as they are: no conversion of
each id on the batch path (``np.fromiter`` over a tuple was ~0.02 µs an id, ~40 µs for 2,048
blocks), and across processes they travel as one buffer (a tuple of 2,048 ints pickles and
unpickles in ~85 µs, the array's bytes in a few).

:class:`BlockIds` is a ``Sequence[int]`` that is equal to (and hashes as) the tuple of its ids, and
to another :class:`BlockIds` of the same ids (so specs and results compare as before, and
iterating it gives Python ints); unlike a tuple it has no ``+`` and no ordering; ``array`` is what the
transfer engines take. :func:`ids_array` gives any ids as that array (a copy only for ids that
are not a :class:`BlockIds` or an int64 array already).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


class BlockIds(Sequence[int]):
    """Engine block ids (see the module docstring). A slice is a :class:`BlockIds` sharing the array."""

    __slots__ = ("array",)

    array: np.ndarray  # int64, read-only

    def __init__(self, ids: Sequence[int] | np.ndarray = ()) -> None:
        if isinstance(ids, BlockIds):
            a = ids.array
        elif isinstance(ids, np.ndarray):
            a = ids.astype(np.int64)  # a copy: the caller's array may change after
        else:
            a = np.fromiter(ids, np.int64, len(ids))
        a.flags.writeable = False
        self.array = a

    @classmethod
    def around(cls, a: np.ndarray) -> BlockIds:
        """Around ``a`` (int64, read-only) as it is."""
        out = cls.__new__(cls)
        out.array = a
        return out

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> BlockIds: ...

    def __getitem__(self, i: int | slice) -> int | BlockIds:
        if isinstance(i, slice):
            return BlockIds.around(self.array[i])
        out: int = self.array.item(i)
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockIds):
            return bool(np.array_equal(self.array, other.array))
        if isinstance(other, tuple):
            return tuple(self.array.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.array.tolist()))

    def __repr__(self) -> str:
        return f"BlockIds({self.array.tolist()})"

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        a = self.array if dtype is None else self.array.astype(dtype)
        return a.copy() if copy and a is self.array else a  # np.array(ids) is the caller's to change

    def __reduce__(self) -> tuple[Any, ...]:
        return _from_bytes, (self.array.tobytes(),)

    def take(self, positions: Sequence[int]) -> BlockIds:
        """The ids at ``positions``, in that order."""
        a = self.array[np.asarray(positions, dtype=np.intp)]
        a.flags.writeable = False
        return BlockIds.around(a)


def _from_bytes(raw: bytes) -> BlockIds:
    return BlockIds.around(np.frombuffer(raw, np.int64))  # read-only: a view of the bytes


def ids_array(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as an int64 array: a :class:`BlockIds`' own (no copy), an int64 array as it is,
    anything else converted."""
    if isinstance(ids, BlockIds):
        return ids.array
    if isinstance(ids, np.ndarray):
        return ids if ids.dtype == np.int64 else ids.astype(np.int64)
    return np.fromiter(ids, np.int64, len(ids))
