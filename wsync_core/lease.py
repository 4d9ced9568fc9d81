"""Leases: a transport's memory that a receiver's tensors view, given back only when nothing views it.

When a delivery is adoptable, the core makes the model's tensors views of the transport's
memory (a shared-memory slot, a receive buffer) instead of copying it. That memory must not be
written again while *any* tensor views it: the model's, one the worker kept (a ``state_dict``
taken after a receive, a view, a tensor handed to another thread), or the copy of either in a
child made by ``fork``. So the core does not decide when to give it back; the memory's life does:

- ``Lease.wrap`` returns a tensor over the same bytes whose storage, when the last tensor viewing
  it is freed, asks for the transport's ``release``;
- a fork while the storage is alive pins it too, until that child and every process it forked
  in turn have exited (a pipe the children inherit tells: its read end sees EOF then);
- the release itself runs in the receiving scheme's thread (``LeaseBook.drain``: after each
  receive's ack, and at the start of the next), never inside the garbage collector, where a
  transport's locks may be held; after the scheme shut down, at once.

Memory is then bounded by what the user holds, as with any tensor.
"""

from __future__ import annotations

import os
import select
import threading
import weakref
from collections.abc import Callable, Iterable

import torch

from . import forked

__all__ = ["LeaseBook", "exclusive"]

_lock = threading.Lock()
#: leases whose storage is alive, in this process (a fork pins each)
_live: set[_Lease] = set()
#: read ends of pipes whose write ends live in forked children, with the leases each pins
_forks: dict[int, list[_Lease]] = {}
_pending_fork: tuple[int, int, list[_Lease]] | None = None


class _Lease:
    """One delivery's memory: released once its storage is freed and every pinning child exited."""

    __slots__ = ("book", "release", "holds", "__weakref__")

    def __init__(self, book: LeaseBook, release: Callable[[], None]) -> None:
        self.book = book
        self.release = release
        self.holds = 1  # the storage; +1 per forked child that may view it

    def drop(self) -> None:
        """One holder let go; the last one queues the release with the book."""
        with _lock:
            self.holds -= 1
            if self.holds:
                return
            _live.discard(self)
        self.book._due(self)


class LeaseBook:
    """The leases of one receiving scheme. ``drain`` runs the releases that fell due."""

    def __init__(self) -> None:
        self._pid = forked.pid()
        self._due_list: list[_Lease] = []
        self._closed = False

    def wrap(self, payload: torch.Tensor, release: Callable[[], None] | None) -> torch.Tensor:
        """A uint8 CPU tensor over ``payload``'s bytes; ``release`` runs once no tensor views those
        bytes (in this process or a child forked meanwhile). Raises ValueError for a non-CPU payload."""
        if payload.device.type != "cpu":
            raise ValueError(f"only CPU memory can be leased, got a payload on {payload.device}")
        if payload.numel() == 0 or release is None:
            return payload
        lease = _Lease(self, release)
        array = payload.numpy()  # keeps ``payload``, and so the transport's memory, alive
        weakref.finalize(array, _storage_freed, weakref.ref(lease), forked.pid())
        with _lock:
            _live.add(lease)
        return torch.frombuffer(array, dtype=torch.uint8)  # its storage holds ``array``: the last view frees it

    def drain(self) -> None:
        """Run the releases that fell due, and notice children that exited. Call from the scheme's thread."""
        _poll_forks()
        while self._due_list:
            lease = self._due_list.pop(0)
            lease.release()

    def close(self) -> None:
        """Run what is due; later releases run as they fall due (no scheme call will drain them)."""
        self._closed = True
        self.drain()

    def _due(self, lease: _Lease) -> None:
        if forked.pid() != self._pid:
            return  # a forked child never gives back its parent's memory
        if self._closed:
            lease.release()
        else:
            self._due_list.append(lease)


def _storage_freed(ref: weakref.ref[_Lease], pid: int) -> None:
    lease = ref()
    if lease is not None and forked.pid() == pid:
        lease.drop()


def exclusive(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor, whether re-pointing every one of ``tensors`` at memory of its own leaves
    nothing behind: every tensor that shares its storage is among ``tensors`` (no view, alias or
    state_dict entry held elsewhere), and none of those overlaps it (two of the model's tensors
    that share bytes, as ``weight`` and ``weight.detach()``, must go on sharing them). A tensor
    listed twice (tied under two names) counts once. All False when torch cannot tell."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return [False] * len(tensors)
    keys = [t.untyped_storage()._cdata for t in tensors]
    on: dict[int, dict[int, torch.Tensor]] = {}  # storage -> the distinct tensors of ``tensors`` on it
    for key, t in zip(keys, tensors):
        on.setdefault(key, {})[id(t)] = t
    alone = {key: count(key) - _WRAPPER_REFS <= len(mine) and (len(mine) == 1 or not _overlap(mine.values()))
             for key, mine in on.items()}
    return [alone[key] for key in keys]


def _overlap(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any two of ``tensors`` (on one storage) cover a common byte."""
    spans = sorted((t.storage_offset() * t.element_size(),
                    (t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
                    * t.element_size()) for t in tensors if t.numel())
    return any(start < end for (_, end), (start, _) in zip(spans, spans[1:]))


def _wrapper_refs() -> int:
    """References a storage's Python wrapper adds to its use count (calibrated on this torch)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return 0
    probe = torch.zeros(1)
    return count(probe.untyped_storage()._cdata) - 1


_WRAPPER_REFS = _wrapper_refs()


# -- fork: a child keeps what it forked with ---------------------------------------------------
def _before_fork() -> None:
    global _pending_fork
    with _lock:
        leases = list(_live)  # storages freed before the fork are viewed by no one in the child
    if not leases:
        return
    r, w = os.pipe()  # both ends close on exec: a child that execs no longer maps anything
    _pending_fork = (r, w, leases)


def _after_fork_in_parent() -> None:
    global _pending_fork
    if _pending_fork is None:
        return
    r, w, leases = _pending_fork
    _pending_fork = None
    os.close(w)
    with _lock:
        for lease in leases:
            lease.holds += 1
        _forks[r] = leases


def _after_fork_in_child() -> None:
    global _pending_fork
    if _pending_fork is not None:
        os.close(_pending_fork[0])  # the write end stays open until this child (and its own children) exit
        _pending_fork = None
    for r in _forks:
        os.close(r)
    _forks.clear()
    _live.clear()


def _poll_forks() -> None:
    """Drop the pins of children that have exited (their pipe's read end is at EOF)."""
    if not _forks:
        return
    with _lock:
        fds = list(_forks)
    ready, _, _ = select.select(fds, [], [], 0)
    for r in ready:
        with _lock:
            leases = _forks.pop(r, [])
        os.close(r)
        for lease in leases:
            lease.drop()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
