"""Slots: named shared-memory files under /dev/shm that hold one snapshot each.

A slot file is a 64-byte head, whose first 8 bytes hold the *generation* of the snapshot in
it, followed by the payload. Readers hold a shared ``flock`` on the file while they read it;
the sender takes an exclusive one, without waiting, before it writes. The kernel drops a
dead process's locks, so a killed reader never pins a slot.

A *device slot* keeps its payload in the sender's GPU memory: the file then holds, after the head,
the CUDA IPC handle of that memory (what ``torch.UntypedStorage._share_cuda_`` gives), which each
worker opens once; its copy into its own model then runs device to device. The lock and the
generation work as for a host slot.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Callable

import torch

from wsync_core import TransportError, memory

__all__ = ["Slot", "SHM_DIR", "HEAD"]

SHM_DIR = "/dev/shm"
#: bytes before the payload (keeps the payload 64-byte aligned)
HEAD = 64
_GEN = struct.Struct("<Q")
#: after the generation: 1 for a device slot, and the length of its handle record after the head
_KIND = struct.Struct("<II")
#: a device slot's handle record: device, storage bytes, offset, ref counter offset, event sync, then
#: the handle, the ref counter's name and the event handle, each with a 2-byte length
_RECORD = struct.Struct("<iqqqB")
_PART = struct.Struct("<H")
#: room for the record in a device slot's file
RECORD_BYTES = 1024


def encode_handle(shared: tuple) -> bytes:
    """A device slot's record: the tuple ``UntypedStorage._share_cuda_()`` returns, as bytes."""
    device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = shared
    out = _RECORD.pack(int(device), int(size), int(offset), int(ref_offset), int(bool(sync)))
    for part in (handle, ref_handle, event_handle or b""):
        out += _PART.pack(len(part)) + bytes(part)
    if len(out) > RECORD_BYTES:
        raise TransportError(f"a CUDA IPC handle of {len(out)} bytes does not fit a slot's {RECORD_BYTES}")
    return out


def decode_handle(data: bytes) -> tuple:
    """The tuple ``UntypedStorage._new_shared_cuda`` takes, from a record; raises TransportError
    naming what is wrong with a malformed one."""
    if len(data) < _RECORD.size:
        raise TransportError(f"a device slot's handle record has {len(data)} bytes, expected at least {_RECORD.size}")
    device, size, offset, ref_offset, sync = _RECORD.unpack_from(data, 0)
    if not 0 <= device < 1024 or size <= 0 or offset < 0 or ref_offset < 0 or sync > 1:
        raise TransportError(f"a device slot's handle record is out of range (device {device}, {size} bytes at "
                             f"offset {offset})")
    parts, at = [], _RECORD.size
    for _ in range(3):
        if at + _PART.size > len(data):
            raise TransportError("a device slot's handle record is truncated")
        (n,), at = _PART.unpack_from(data, at), at + _PART.size
        if at + n > len(data):
            raise TransportError("a device slot's handle record is truncated")
        parts.append(bytes(data[at:at + n]))
        at += n
    if at != len(data) or not parts[0] or not parts[1]:
        raise TransportError("a device slot's handle record is malformed")
    return device, parts[0], size, offset, parts[1], ref_offset, parts[2], bool(sync)


#: (handle, offset) -> the payload this process exported or opened under it: CUDA opens a handle
#: once per process, and never in the process that exported it (a sender and its receivers may
#: share one process)
_OPENED: weakref.WeakValueDictionary[tuple[bytes, int], torch.Tensor] = weakref.WeakValueDictionary()


def _open_device_payload(record: bytes) -> torch.Tensor:
    """A uint8 tensor over the sender's GPU memory that ``record`` names (the whole storage: the
    core checks its size); raises TransportError if it cannot be opened here (no CUDA, another
    machine's handle, a malformed record)."""
    device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = decode_handle(record)
    known = _OPENED.get((handle, offset))
    if known is not None:
        return known
    if not torch.cuda.is_available():
        raise TransportError("the shm sender keeps its snapshots in GPU memory (cuda_ipc=True), and torch here "
                             "has no CUDA; leave the sender's cuda_ipc off to stage them in host memory")
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, ref_handle, ref_offset,
                                                         event_handle, sync)
    except RuntimeError as exc:
        raise TransportError(f"cannot open the shm sender's GPU memory (CUDA IPC, device {device}): {exc}") from None
    payload = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage)
    _OPENED[(handle, offset)] = payload
    return payload


class Slot:
    """One mapped slot file (``wsync_core.memory``) with a head; ``payload`` is a uint8 tensor over
    its payload bytes."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, payload: torch.Tensor, writable: bool, size: int) -> None:
        self.path = path
        self._fd = fd
        self._mm: mmap.mmap | None = mm  # None once closed
        self._size = size  # of the file: the head and the payload
        self.payload = payload
        self._locks = 0
        self._guard = threading.Lock()  # a lease may give a lock back from another thread
        self._closing = False
        self.writable = writable
        self._private: memory.PrivateMap | None = None  # a zero-copy reader's, kept across deliveries

    @classmethod
    def create(cls, path: str, nbytes: int, device: torch.device | None = None) -> Slot:
        """Create, size and map a new slot file; with a CUDA ``device``, a device slot whose payload
        is that GPU's memory. Raises TransportError if the file exists or /dev/shm is full."""
        if device is None or device.type != "cuda" or not nbytes:
            slot = memory.Slot.file(path, nbytes, offset=HEAD)
            mm, tensor = slot.map, slot.tensor
            assert mm is not None and tensor is not None  # (a new slot: only its close() drops them)
            return cls(path, slot.fd, mm, tensor, writable=True, size=HEAD + nbytes)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        shared = payload.untyped_storage()._share_cuda_()
        record = encode_handle(shared)
        _OPENED[(bytes(shared[1]), int(shared[3]))] = payload
        slot = memory.Slot.file(path, RECORD_BYTES, offset=HEAD)
        mm = slot.map
        assert mm is not None  # (a new slot: only its close() drops it)
        _KIND.pack_into(mm, _GEN.size, 1, len(record))
        mm[HEAD:HEAD + len(record)] = record
        return cls(path, slot.fd, mm, payload, writable=True, size=HEAD + RECORD_BYTES)

    @classmethod
    def open(cls, path: str, *, shared_payload: bool = True) -> Slot:
        """Map an existing slot file read-only; with ``shared_payload=False``
        only its head (a zero-copy reader maps the payload privately per delivery:
        ``private_payload``), and ``payload`` is empty; a device slot's payload is the sender's GPU
        memory, opened here. Raises TransportError if the file is missing or malformed, or the GPU
        memory cannot be opened."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportError(f"cannot open shared-memory file {path}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEAD:
                raise TransportError(f"shared-memory file {path} has {size} bytes, expected at least {HEAD}")
            kind, length = _KIND.unpack_from(os.pread(fd, HEAD, 0), _GEN.size)
            if kind == 1:
                if not 0 < length <= min(RECORD_BYTES, size - HEAD):
                    raise TransportError(f"shared-memory file {path} names a handle record of {length} bytes")
                mm, _ = memory.map_shared(fd, HEAD, offset=HEAD)
                payload = _open_device_payload(os.pread(fd, length, HEAD))
            else:
                mm, payload = memory.map_shared(fd, size if shared_payload else HEAD, offset=HEAD)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, payload, writable=False, size=size)

    @property
    def on_device(self) -> bool:
        """Whether the payload is GPU memory (a device slot)."""
        return self.payload.is_cuda

    def private_payload(self) -> tuple[torch.Tensor, Callable[[], object] | None]:
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
        mm = self._mm
        assert mm is not None  # (an endpoint forgets a slot it closes: it reads only open ones)
        return _GEN.unpack_from(mm, 0)[0]

    @gen.setter
    def gen(self, value: int) -> None:
        mm = self._mm
        assert mm is not None  # (as above: the sender writes only the slots it holds open)
        _GEN.pack_into(mm, 0, value)

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
