"""How long to wait before trying again after a failure: doubling from a base up to a cap, back
to the base after a success (redis-py's ``ExponentialBackoff`` with the attempt count inside)."""

from __future__ import annotations


class Backoff:
    """``next()``: the wait before the next try (``base_s``, then twice the last, at most
    ``cap_s``); ``reset()`` after a success."""

    __slots__ = ("_next", "base_s", "cap_s")

    def __init__(self, base_s: float, cap_s: float) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"base_s: {base_s} must be above 0 and at most cap_s ({cap_s})")
        self.base_s = base_s
        self.cap_s = cap_s
        self._next = base_s

    def next(self) -> float:
        wait = self._next
        self._next = min(2 * wait, self.cap_s)
        return wait

    def reset(self) -> None:
        self._next = self.base_s


ACCEPT_BACKOFF_MIN_S, ACCEPT_BACKOFF_MAX_S = 0.01, 1.0


def accept_backoff() -> Backoff:
    """The wait between accepts of a listener that fail (the process out of file descriptors):
    short at first, a second at most, so the listener is read again soon after some are freed."""
    return Backoff(ACCEPT_BACKOFF_MIN_S, ACCEPT_BACKOFF_MAX_S)
