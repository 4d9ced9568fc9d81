"""A private, copy-on-write mapping of an object's bytes in this node's Ray object store.

Ray hands a reader a read-only view of the object's memory, which lives in a shared file mapping
(``/dev/shm/plasma...``). Mapping the same file pages again with ``MAP_PRIVATE`` gives this
process memory of its own that starts out holding the object's bytes without copying them:
writing it copies the page written and reaches no one else, so the core may adopt it as the
model's tensors. The pages not yet written follow the file, which Ray never writes while the
object is held: the receiver keeps its reference and Ray's buffer until the core releases the
delivery, i.e. until no tensor views the mapping.

It needs ``/proc/self/map_files`` (Linux, and the right to open those entries: root or
CAP_SYS_ADMIN); anywhere else ``private_map`` returns None and the receiver copies instead.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import torch

__all__ = ["private_map"]

_PAGE = mmap.ALLOCATIONGRANULARITY


#: the file mapping the last object was found in: Ray maps its store once per process
_last: list[tuple[int, int, int]] = []


def _region(addr: int, nbytes: int) -> tuple[int, int, int] | None:
    """(start, end, file offset) of the file mapping holding ``[addr, addr + nbytes)``, or None."""
    for start, end, offset in _last:
        if start <= addr and addr + nbytes <= end:
            return start, end, offset
    found = _scan(addr, nbytes)
    if found is not None:
        _last[:] = [found]
    return found


def _scan(addr: int, nbytes: int) -> tuple[int, int, int] | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                if start <= addr and addr + nbytes <= end:
                    return start, end, int(parts[2], 16)
    except OSError:
        return None
    return None


def private_map(value: Any) -> tuple[torch.Tensor, mmap.mmap] | None:
    """A writable uint8 tensor over a private mapping of the bytes of ``value`` (a buffer Ray
    returned for an object in this node's store) and the mapping itself; None if this process
    cannot map them (the caller then copies)."""
    view = memoryview(value).cast("B")
    nbytes = view.nbytes
    if nbytes == 0:
        return None
    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    region = _region(addr, nbytes)
    if region is None:
        return None
    start, end, offset = region
    try:
        fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDONLY)
    except OSError:
        return None
    try:
        at = offset + (addr - start)
        base = at - at % _PAGE
        mapped = mmap.mmap(fd, nbytes + (at - base), flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=at - base), mapped
