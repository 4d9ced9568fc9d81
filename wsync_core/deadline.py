"""Deadlines: every blocking call in wsync waits on one, so none waits forever unless asked to."""

from __future__ import annotations

import math
import numbers
import os
import threading
import time

__all__ = ["Deadline", "POLL", "Wakeup"]

#: a timeout longer than this (about 31 years) never expires: the waits it would give
#: ``select``, ``Condition.wait`` or ``time_t`` overflow (OverflowError) where ``math.inf`` does not
_FOREVER_S = 1e9


class Deadline:
    """A point in time on the monotonic clock; ``timeout=math.inf`` (or any timeout over 10**9 s)
    never expires.

    Raises TypeError for a timeout that is not a number (a bool, a string), ValueError for a
    negative or NaN one.
    """

    __slots__ = ("timeout", "_end")
    timeout: float
    _end: float

    def __init__(self, timeout: float) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be a number of seconds >= 0 (math.inf to wait forever), got {timeout!r}")
        if not timeout >= 0:  # (NaN compares False)
            raise ValueError(f"timeout must be a number >= 0 (math.inf to wait forever), got {timeout!r}")
        self.timeout = float(timeout)
        self._end = time.monotonic() + self.timeout if self.timeout <= _FOREVER_S else math.inf

    def remaining(self) -> float:
        """Seconds left, never below 0 (``math.inf`` for a deadline that never expires)."""
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        """Whether no time is left."""
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


class Wakeup:
    """What ``wake()`` needs in an endpoint that waits in ``select`` or ``poll``: a flag that stays
    set, and an eventfd (``fd``, from ``open()`` to ``close()``) that the wait also watches."""

    __slots__ = ("is_set", "fd", "_lock")

    def __init__(self) -> None:
        self.is_set = False
        self.fd = -1
        self._lock = threading.Lock()  # set() never writes to a number close() gave back (and another file took)

    def open(self) -> int:
        """Make the eventfd (readable at once if ``set`` came first) and return it."""
        with self._lock:
            self.fd = os.eventfd(1 if self.is_set else 0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            return self.fd

    def set(self) -> None:
        """Set the flag and make ``fd`` readable, from any thread; stays set."""
        with self._lock:
            self.is_set = True
            if self.fd >= 0:
                os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        """Close the eventfd; idempotent (the flag stays as it is)."""
        with self._lock:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copy of the eventfd (the lock may have been
        held by another thread of the parent when it forked: it is made anew)."""
        self._lock = threading.Lock()
        self.close()
