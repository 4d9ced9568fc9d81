"""Slots of shared memory for same-host transports (shm, mp): one file of memory, mapped.

A *slot* is a file of memory (a named file under /dev/shm, or an anonymous memfd whose
descriptor travels to the workers) holding one payload. The sender maps it read-write
(``Slot``); a worker maps it read-only (``map_shared``) or, to adopt it as its model's memory,
privately (``map_private``: reads see the slot, a worker's writes stay in its process). A fresh
mapping has no page-table entries: the first read of every page traps into the kernel, which
here costs about one more read of the whole payload; ``populate`` takes those faults in one
call instead, where the caller chooses (after the ack: ``Delivery.warm``). A worker may keep a
private mapping of a slot from one delivery to the next (no page tables torn down and built again
per version): ``discard_written`` then drops the pages it wrote, so that they read the slot again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import sys
import warnings
from collections.abc import Callable

import torch

from .errors import TransportError

__all__ = ["Slot", "PrivateMap", "map_shared", "map_private", "populate", "discard_written"]

#: the seals a memfd slot carries: its size can never change under a reader
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

#: madvise(2) advice that maps every page of a range for reading, without copying on write (Linux 5.14)
_MADV_POPULATE_READ = 22
_MADV_DONTNEED = 4
#: /proc/self/pagemap, one 64-bit entry per page: present, swapped, a page of a file (or shared)
_PM_PRESENT, _PM_SWAPPED, _PM_FILE = 63, 62, 61
#: runs of written pages past which one madvise over the whole range is cheaper
_MAX_RUNS = 256
_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


class Slot:
    """A sender's slot: a file of shared memory, mapped read-write; ``tensor`` is its ``nbytes``
    of payload after ``offset`` bytes of the transport's own (a head)."""

    def __init__(self, fd: int, nbytes: int, offset: int = 0) -> None:
        """Map the file ``fd`` (sized already; owned from now on). Raises OSError if it cannot be mapped."""
        self.fd = fd
        self.nbytes = nbytes
        self.map: mmap.mmap | None = mmap.mmap(fd, max(offset + nbytes, 1), flags=mmap.MAP_SHARED | _POPULATE)
        self.tensor: torch.Tensor | None = (torch.frombuffer(self.map, dtype=torch.uint8, offset=offset, count=nbytes)
                                            if nbytes else torch.empty(0, dtype=torch.uint8))

    @classmethod
    def memfd(cls, name: str, nbytes: int) -> Slot:
        """A new anonymous, sealed memfd slot (its descriptor can be passed to workers, who cannot
        resize it). Raises TransportError if the memory cannot be had."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(nbytes, 1))  # an empty file cannot be mapped
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, nbytes)
        except BaseException as exc:  # a KeyboardInterrupt while a large map fills in too: no descriptor is left
            os.close(fd)
            if not isinstance(exc, OSError):
                raise
            raise TransportError(f"cannot allocate a slot of {nbytes} bytes of shared memory: {exc}") from None

    @classmethod
    def file(cls, path: str, nbytes: int, offset: int = 0) -> Slot:
        """A new named slot file at ``path`` (mode 0600) of ``offset + nbytes`` bytes, allocated
        now (ENOSPC here rather than SIGBUS on first write). Raises TransportError if it exists or
        the memory cannot be had."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create shared-memory file {path}: {exc}") from None
        try:
            os.posix_fallocate(fd, 0, offset + nbytes)
            return cls(fd, nbytes, offset)
        except BaseException as exc:  # a KeyboardInterrupt in a large allocation too: no file is left behind
            os.close(fd)
            os.unlink(path)
            if not isinstance(exc, OSError):
                raise
            raise TransportError(f"cannot allocate {offset + nbytes} bytes of shared memory at {path}: {exc}; "
                                 f"is {os.path.dirname(path)} large enough?") from None

    def close(self) -> None:
        """Close the descriptor and let go of the mapping, which is unmapped once the last tensor
        viewing it is freed (torch.frombuffer does not pin an mmap); idempotent."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        self.tensor = None
        self.map = None


def map_shared(fd: int, size: int, offset: int = 0, nbytes: int | None = None) -> tuple[mmap.mmap, torch.Tensor]:
    """Map ``size`` bytes of file ``fd`` read-only and shared (a worker's view of a sender's slot):
    the mapping and a uint8 tensor over ``nbytes`` (default: all) of it after ``offset``. Raises
    OSError if it cannot be mapped."""
    nbytes = size - offset if nbytes is None else nbytes
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    if nbytes == 0:
        return mm, torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only on purpose: a worker cannot write the sender's slot
        warnings.simplefilter("ignore", UserWarning)
        return mm, torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=nbytes)


class PrivateMap:
    """A worker's private (copy-on-write) mapping of a whole slot file, kept from one delivery to
    the next: mapping and faulting in a large payload, then tearing it down, cost more CPU than the
    copy they save, once per version and worker. Unwritten pages follow the file (so the mapping
    shows what the sender wrote only while the worker holds the slot against it); ``clean``, once
    no delivery views the mapping, drops the pages the worker wrote, so that the next delivery
    reads the slot's bytes, never the worker's old writes."""

    def __init__(self, fd: int, size: int) -> None:
        """Map ``size`` bytes of file ``fd``. Raises OSError if it cannot be mapped."""
        self.base = map_private(fd, 0, size)
        self._cold = True     # pages to fault in (new, or some dropped by ``clean``)
        self._viewed = False  # a view went out since the last ``clean``

    def view(self, offset: int, nbytes: int) -> tuple[torch.Tensor, Callable[[], object] | None]:
        """A delivery's payload: ``nbytes`` at ``offset``; and what to run after the ack to fault
        its pages in (``Delivery.warm``), or None when they are in already."""
        payload = self.base[offset:offset + nbytes]
        self._viewed = True
        warm, self._cold = ((lambda: populate(payload)) if self._cold else None), False
        return payload, warm

    def clean(self) -> None:
        """Drop the pages this process wrote since a view went out; call it when no delivery
        views the mapping any more. Raises OSError if the kernel refuses."""
        if self._viewed:
            self._viewed = False
            if discard_written(self.base):
                self._cold = True


def map_private(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a new copy-on-write map of ``nbytes`` at ``offset`` in file ``fd``: reads
    see the file, writes stay in this process; unmapped once the last tensor viewing it is freed.
    Raises OSError if the file cannot be mapped."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(fd, offset + nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=nbytes)  # keeps ``mm`` alive


def populate(tensor: torch.Tensor) -> bool:
    """Fault in the pages a CPU tensor views, for reading, in one call; True if the kernel did.

    Only a speed-up: on a kernel without MADV_POPULATE_READ (before Linux 5.14) or another system
    it does nothing and returns False, and the pages fault in on first use as before.
    """
    if _madvise_fn is None or tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    start -= start % _PAGE
    return _madvise_fn(start, end - start, _MADV_POPULATE_READ) == 0


def discard_written(base: torch.Tensor) -> int:
    """Drop this process's own copies of the pages of ``base`` (a CPU uint8 tensor over the whole of a
    private file mapping, page-aligned) that it wrote, present or swapped out: those pages read
    the file again. Returns how many pages were dropped; where ``/proc/self/pagemap`` cannot
    tell them apart, drops every page of the range (all of them then fault in again) and returns
    their number. Raises OSError if the kernel refuses the madvise."""
    start, nbytes = base.data_ptr(), base.numel()
    pages = -(-nbytes // _PAGE)
    if pages == 0 or _madvise_fn is None:
        return 0
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            f.seek(start // _PAGE * 8)
            entries = bytearray(pages * 8)
            if f.readinto(entries) != len(entries):
                raise OSError("short read")
    except OSError:
        _advise(start, pages * _PAGE, _MADV_DONTNEED)
        return pages
    flags = torch.frombuffer(entries, dtype=torch.int64)
    written = (((flags >> _PM_PRESENT) & 1) & ~((flags >> _PM_FILE) & 1)) | ((flags >> _PM_SWAPPED) & 1)
    index = written.nonzero().flatten()
    if index.numel() == 0:
        return 0
    gaps = (index[1:] - index[:-1]) != 1
    firsts = torch.cat([index[:1], index[1:][gaps]]).tolist()
    lasts = torch.cat([index[:-1][gaps], index[-1:]]).tolist()
    if len(firsts) > _MAX_RUNS:
        _advise(start, pages * _PAGE, _MADV_DONTNEED)
    else:
        for first, last in zip(firsts, lasts):
            _advise(start + first * _PAGE, (last - first + 1) * _PAGE, _MADV_DONTNEED)
    return index.numel()


def _advise(start: int, length: int, advice: int) -> None:
    assert _madvise_fn is not None  # (discard_written, its caller, returns first without one)
    if _madvise_fn(start, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) of {length} bytes failed: {os.strerror(err)}")
