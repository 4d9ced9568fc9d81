"""Deadlines: every blocking call in wsync waits on one, so none waits forever unless asked to."""

from __future__ import annotations

import math
import time

__all__ = ["Deadline", "POLL"]


class Deadline:
    """A point in time on the monotonic clock; ``timeout=math.inf`` never expires.

    Raises ValueError for a negative or NaN timeout.
    """

    __slots__ = ("timeout", "_end")

    def __init__(self, timeout: float) -> None:
        if timeout is None or not timeout >= 0:  # (NaN compares False)
            raise ValueError(f"timeout must be a number >= 0 (math.inf to wait forever), got {timeout!r}")
        self.timeout = float(timeout)
        self._end = time.monotonic() + self.timeout

    def remaining(self) -> float:
        """Seconds left, never below 0 (``math.inf`` for a deadline that never expires)."""
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def slice(self, at_most: float) -> float:
        """Seconds to wait now: what remains, but no more than ``at_most``."""
        return min(self.remaining(), at_most)

    def seconds(self) -> float | None:
        """Seconds left for a blocking call that takes None as "forever" (``Condition.wait``,
        ``select.select``, ``socket.settimeout``): None for a deadline that never expires."""
        left = self.remaining()
        return None if math.isinf(left) else left

    def milliseconds(self) -> int:
        """Whole milliseconds left, rounded up, for calls that take -1 as "forever" (``zmq.Poller.poll``,
        ``select.poll``): -1 for a deadline that never expires."""
        left = self.remaining()
        return -1 if math.isinf(left) else math.ceil(left * 1000)

    def __repr__(self) -> str:
        return f"Deadline(remaining={self.remaining():.3f}s)"


#: a deadline that has already passed: a call given it polls (it waits for nothing)
POLL = Deadline(0.0)
