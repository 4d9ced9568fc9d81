"""Slots: named shared-memory files under /dev/shm that hold one snapshot each.

A slot file is a 64-byte head, whose first 8 bytes hold the *generation* of the snapshot in
it, followed by the payload. Readers hold a shared ``flock`` on the file while they read it;
the sender takes an exclusive one, without waiting, before it writes. The kernel drops a
dead process's locks, so a killed reader never pins a slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Callable

import torch

from wsync_core import TransportError, memory

__all__ = ["Slot", "SHM_DIR", "HEAD"]

SHM_DIR = "/dev/shm"
#: bytes before the payload (keeps the payload 64-byte aligned)
HEAD = 64
_GEN = struct.Struct("<Q")


class Slot:
    """One mapped slot file (``wsync_core.memory``) with a head; ``payload`` is a uint8 tensor over
    its payload bytes."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, payload: torch.Tensor, writable: bool, size: int) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self._size = size  # of the file: the head and the payload
        self.payload = payload
        self._locks = 0
        self._guard = threading.Lock()  # a lease may give a lock back from another thread
        self._closing = False
        self.writable = writable
        self._private: memory.PrivateMap | None = None  # a zero-copy reader's, kept across deliveries

    @classmethod
    def create(cls, path: str, nbytes: int) -> Slot:
        """Create, size and map a new slot file; raises TransportError if it exists or /dev/shm is full."""
        slot = memory.Slot.file(path, nbytes, offset=HEAD)
        return cls(path, slot.fd, slot.map, slot.tensor, writable=True, size=HEAD + nbytes)

    @classmethod
    def open(cls, path: str, *, shared_payload: bool = True) -> Slot:
        """Map an existing slot file read-only; with ``shared_payload=False`` only its head (a
        zero-copy reader maps the payload privately per delivery: ``private_payload``), and
        ``payload`` is empty. Raises TransportError if the file is missing or malformed."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportError(f"cannot open shared-memory file {path}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEAD:
                raise TransportError(f"shared-memory file {path} has {size} bytes, expected at least {HEAD}")
            mm, payload = memory.map_shared(fd, size if shared_payload else HEAD, offset=HEAD)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, payload, writable=False, size=size)

    def private_payload(self) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """A copy-on-write view of the payload (reads see the slot's bytes, writes stay in this
        process), and what faults its pages in after the ack (None if they are in): a
        ``memory.PrivateMap`` of the file, kept across deliveries, which follows the slot only while
        this process holds a lock on it; ``unlock`` cleans it when the last lock goes. Raises
        OSError if the file cannot be mapped."""
        if self._private is None:
            self._private = memory.PrivateMap(self._fd, self._size)
        return self._private.view(HEAD, self._size - HEAD)

    # -- generation and locks ---------------------------------------------------------------
    @property
    def gen(self) -> int:
        """The generation of the snapshot this slot holds (0: none yet)."""
        return _GEN.unpack_from(self._mm, 0)[0]

    @gen.setter
    def gen(self, value: int) -> None:
        _GEN.pack_into(self._mm, 0, value)

    def try_lock(self, exclusive: bool) -> bool:
        """Take the slot's lock without waiting; False if a conflicting lock is held.

        Shared locks are counted: each successful call needs one ``unlock``.
        """
        with self._guard:
            if self._fd < 0 or self._closing:
                return False
            try:
                fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self._locks += 1
            return True

    def unlock(self) -> None:
        """Give back one lock taken by ``try_lock``; the file is unlocked when none is left (and
        closed then, if ``close`` was called meanwhile)."""
        with self._guard:
            if self._locks > 0:
                self._locks -= 1
                if self._locks == 0:
                    if self._private is not None and not self._closing:  # no delivery views it now
                        self._private.clean()
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    if self._closing:
                        self._close_now()

    def close(self) -> None:
        """Let go of the file and the mapping (unmapped when the last tensor viewing it goes);
        idempotent. A reader's lock still taken keeps the file open, and the slot safe from
        the writer, until its ``unlock``: a tensor may still view the slot through it."""
        with self._guard:
            if self._fd < 0:
                return
            if self._locks and not self.writable:
                self._closing = True
                return
            if self._locks:
                self._locks = 0
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._close_now()

    def _close_now(self) -> None:
        os.close(self._fd)
        self._fd = -1
        # torch.frombuffer does not count as an export, so mmap.close() would unmap memory that
        # a tensor may still view; dropping our references unmaps it once the last view is gone.
        self.payload = torch.empty(0, dtype=torch.uint8)
        self._mm = None
        self._private = None

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copy of the descriptor, keeping the parent's
        lock (a lock belongs to the descriptor both share) and the mapping; idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._locks = 0

    def unlink(self) -> None:
        """Remove the file's name (mappings stay valid); a missing name is fine."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
