"""Mapped memory for shared-memory transports: private copy-on-write maps and faulting them in.

A receiver that adopts a slot of shared memory maps it privately (reads see the slot, a worker's
writes stay in its process). A fresh mapping has no page-table entries: the first read of every
page traps into the kernel, which on this kind of machine costs about one more read of the
whole payload. ``populate`` takes those faults in one call instead, where the caller chooses
(after the ack: ``Delivery.warm``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

__all__ = ["map_private", "populate"]

#: madvise(2) advice that maps every page of a range for reading, without copying on write (Linux 5.14)
_MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE


def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


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
