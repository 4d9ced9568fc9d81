"""``files``: weights exchanged through files in a shared directory, each written atomically.

Everything lives in the ``directory`` option (a local folder, or a shared-filesystem mount
that every side reaches). Every file is written to a hidden temporary name, then moved into
place with ``os.replace``, so a reader sees a whole file or none:

- ``sender``: the sender's claim on the directory (``host pid token``);
- ``payload-<token>-<n>.bin``: one snapshot, written once and never changed;
- ``to-<w>``: worker ``w``'s mailbox: ``<token> <seq> <payload file>`` then a newline and the
  core's header bytes; only the listed workers' mailboxes change, so a subset send reaches
  only its targets; ``refused <why>`` for a worker the sender does not take (an index out of
  range);
- ``hello-<w>``: worker ``w`` is here (``host pid token``); ``ack-<w>-<seq>``: one ack.

Both sides poll (1 ms, backing off to 20 ms while idle), never past the deadline. Nothing read
from the directory is unpickled: names are parsed strictly, sizes are bounded.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from wsync_core import (
    Acked,
    Buffer,
    Capabilities,
    Deadline,
    Delivery,
    Joined,
    Left,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
    TransportError,
)
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.transport import Event, flag, index_refusal

__all__ = ["FilesTransport"]

_HOST = socket.gethostname()
_PROC = os.path.isdir("/proc/self")
_PAYLOAD = re.compile(r"payload-[0-9a-f]{12}-[0-9]+\.bin")
_ACK = re.compile(r"ack-([0-9]{1,9})-[0-9]{20}")
_HELLO = re.compile(r"hello-([0-9]{1,9})")
T = TypeVar("T")


def _poll(deadline: Deadline, check: Callable[[], T | None], woken: threading.Event | None = None) -> T | None:
    """Call ``check`` until it returns something truthy, the deadline passes or ``woken`` is set."""
    delay = 0.001
    while True:
        if woken is not None and woken.is_set():
            return None
        found = check()
        if found or deadline.expired():
            return found
        if woken is not None:
            woken.wait(deadline.slice(delay))
        else:
            time.sleep(deadline.slice(delay))
        delay = min(2 * delay, 0.02)


def _write(directory: str, name: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``directory/name`` atomically: a temporary file, then ``os.replace``."""
    tmp = os.path.join(directory, f".tmp-{name}-{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise TransportError(f"cannot write {name} in {directory}: {exc}") from exc
        raise


def _open(path: str) -> io.FileIO | None:
    """``path`` opened for reading (None if it is missing). Raises TransportError if it is not a
    regular file: a FIFO would block the open (past every deadline), a directory the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TransportError(f"cannot read {path}: {exc}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise TransportError(f"{path} is not a regular file ({stat.filemode(mode)}); is something else "
                             f"writing to this directory?")
    return os.fdopen(fd, "rb", buffering=0)


def _read(path: str, limit: int) -> bytes | None:
    """The bytes of ``path`` (None if it is missing); raises TransportError if it exceeds ``limit``
    or is not a regular file."""
    f = _open(path)
    if f is None:
        return None
    try:
        with f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise TransportError(f"cannot read {path}: {exc}") from exc
    if len(data) > limit:
        raise TransportError(f"{path} holds more than {limit} bytes; is something else writing to this directory?")
    return data


def _hello_owner(path: str) -> bytes:
    """What the hello at ``path`` says of its worker ("host pid token"), b"" if it is gone; a
    hello that is not a file names no one, and so no one whose death would free it (b"?")."""
    try:
        return _read(path, 256) or b""
    except TransportError:
        return b"?"


def _mkdir(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise TransportError(f"cannot create the files transport's directory: {exc}") from exc


def _listdir(directory: str, closing: bool = False) -> list[str]:
    """The names in ``directory``, sorted; when ``closing``, [] if it is gone (nothing left to remove)."""
    try:
        return sorted(os.listdir(directory))
    except OSError as exc:
        if closing:
            return []
        raise TransportError(f"cannot list the files transport's directory: {exc}") from exc


def _unlink(path: str) -> None:
    """Remove the file ``path`` if it is there (a directory of that name is not this transport's)."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        os.unlink(path)


def _alive(owner: bytes) -> bool:
    """Whether the process that wrote ``host pid token`` still runs (always True on another host)."""
    host, pid = (owner.split() + [b"", b""])[:2]
    if host != _HOST.encode() or not (pid.isdigit() and len(pid) <= 10):
        return True
    if not _PROC:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:  # a zombie (killed, not reaped) counts as dead
            return f.read().rpartition(b")")[2].split()[:1] not in ([b"Z"], [b"X"])
    except FileNotFoundError:
        return False


def _check_open(endpoint: _Sender | _Receiver) -> None:
    """Raise TransportError unless ``endpoint`` is open (the core may call it from a send() that
    shutdown() in another thread overtook: it must then do nothing)."""
    if not endpoint.opened:
        raise TransportError(f"{endpoint.what} is not open (closed, or not opened yet)")


class _Sender(SenderEndpoint):
    def __init__(self, transport: FilesTransport, ctx: SenderContext) -> None:
        self.dir = transport.options["directory"]
        self.what = f"files sender on {self.dir}"
        self.nbytes = ctx.layout.nbytes
        self.token = uuid.uuid4().hex[:12]
        self.me = f"{_HOST} {os.getpid()} {self.token}".encode()
        self.buffers: list[Buffer] = []
        self.written: dict[int, str] = {}  # buffer slot -> payload file holding its bytes
        self.latest = -1  # the slot published last
        self.files: list[str] = []  # payload files on disk, oldest first
        self.mailbox: dict[int, str] = {}  # worker -> payload file its mailbox names
        self.hellos: dict[int, bytes] = {}  # workers seen, with their hello
        self.num_workers = ctx.num_workers
        self.told: dict[int, bytes] = {}  # workers out of range, with the hello their refusal answered
        self.refused: set[str] = set()  # entries that raised once and could not be removed (not files)
        self.seq = self.count = 0
        self.opened = False
        self.woken = threading.Event()  # wake(): the scheme is shutting down, poll returns at once

    def open(self, deadline: Deadline) -> None:
        _mkdir(self.dir)
        claim = os.path.join(self.dir, "sender")
        tmp = os.path.join(self.dir, f".tmp-sender-{self.token}")
        try:
            with open(tmp, "xb") as f:
                f.write(self.me)
            for _ in range(2):
                try:
                    os.link(tmp, claim)  # atomic and exclusive, also on NFS
                    break
                except FileExistsError:
                    other = _read(claim, 256) or b""
                    if _alive(other):
                        raise TransportError(f"{self.dir} already has a sender ({other.decode(errors='replace')}); "
                                             f"if it is gone, remove {claim}") from None
                    _unlink(claim)
        except OSError as exc:
            raise TransportError(f"cannot claim {claim}: {exc}") from exc
        finally:
            _unlink(tmp)
        self.opened = True
        for name in _listdir(self.dir):  # leftovers of a sender that died (half-written ones too)
            if name.startswith(("to-", "payload-", "ack-", ".tmp-to-", ".tmp-payload-")):
                _unlink(os.path.join(self.dir, name))
        self.buffers = [Buffer(torch.empty(self.nbytes, dtype=torch.uint8), i) for i in range(2)]

    def acquire(self, deadline: Deadline) -> Buffer:
        _check_open(self)
        slot = 1 if self.latest == 0 else 0  # never the buffer published last
        self.written.pop(slot, None)
        return self.buffers[slot]

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        _check_open(self)
        slot = buffer.index  # 0 or 1: which of self.buffers
        name = self.written.get(slot)
        if name is None:
            self.count += 1
            name = f"payload-{self.token}-{self.count}.bin"
            # (numpy's stubs give an ndarray __buffer__ on Python 3.12+ only)
            _write(self.dir, name, memoryview(buffer.tensor.cpu().numpy()))  # type: ignore[arg-type]
            self.files.append(name)
            self.written[slot] = name
        self.latest = slot
        for w in workers:
            self.seq += 1
            _write(self.dir, f"to-{w}", f"{self.token} {self.seq} {name}\n".encode() + header)
            self.mailbox[w] = name
        keep = set(self.mailbox.values()) | set(self.files[-2:])  # a grace version for slow readers
        for old in [f for f in self.files if f not in keep]:
            _unlink(os.path.join(self.dir, old))
        self.files = [f for f in self.files if f in keep]

    def poll(self, deadline: Deadline) -> list[Event]:
        _check_open(self)
        return _poll(deadline, self._scan, self.woken) or []

    def wake(self) -> None:
        self.woken.set()

    def _scan(self) -> list[Event]:
        names = [name for name in _listdir(self.dir) if name not in self.refused]
        hellos: dict[int, bytes] = {}
        for name in names:
            if (m := _HELLO.fullmatch(name)) and (data := self._read_once(name, 256)) and _alive(data):
                w = int(m[1])
                why = index_refusal(w, self.num_workers)
                if why is None:
                    hellos[w] = data
                elif self.told.get(w) != data:  # told once per hello, so it stops waiting
                    _write(self.dir, f"to-{w}", b"refused " + why.encode())
                    self.told[w] = data
        events: list[Event] = [Joined(w) for w, data in hellos.items() if self.hellos.get(w) != data]
        for name in names:
            if m := _ACK.fullmatch(name):
                try:
                    data = self._read_once(name, MAX_ACK_BYTES)
                finally:  # an oversized ack raises once, then is gone
                    _unlink(os.path.join(self.dir, name))
                if data is not None:
                    events.append(Acked(int(m[1]), data))
        events += [Left(w, f"hello-{w} is gone or its process died ({data.decode(errors='replace')})")
                   for w, data in self.hellos.items() if w not in hellos]
        self.hellos = hellos
        return events

    def _read_once(self, name: str, limit: int) -> bytes | None:
        """``_read`` of an entry of the directory; one that raises is not read again (a FIFO or a
        directory named like a hello or an ack, which no removal can clear, raises once)."""
        try:
            return _read(os.path.join(self.dir, name), limit)
        except TransportError:
            self.refused.add(name)
            raise

    def close(self) -> None:
        if not self.opened:
            return
        self.opened = False
        for name in _listdir(self.dir, closing=True):
            path = os.path.join(self.dir, name)
            if _ACK.fullmatch(name):
                _unlink(path)
            elif _HELLO.fullmatch(name) and not _alive(_hello_owner(path)):
                _unlink(path)  # left by a worker that was killed
        for name in [*self.files, *(f"to-{w}" for w in [*self.mailbox, *self.told]), "sender"]:
            _unlink(os.path.join(self.dir, name))
        self.files, self.mailbox, self.buffers, self.written = [], {}, [], {}


class _Receiver(ReceiverEndpoint):
    def __init__(self, transport: FilesTransport, ctx: ReceiverContext) -> None:
        self.dir = transport.options["directory"]
        self.worker = ctx.worker_idx
        self.what = f"files worker {self.worker} on {self.dir}"
        self.nbytes = ctx.layout.nbytes
        self.me = f"{_HOST} {os.getpid()} {uuid.uuid4().hex[:12]}".encode()
        self.hello = os.path.join(self.dir, f"hello-{self.worker}")
        self.seen: bytes | None = None  # the mailbox line last taken
        self.acks = time.time_ns()  # ack sequence: rises across restarts of this worker
        self.free: list[torch.Tensor] = []
        self.opened = False
        self.woken = threading.Event()  # the scheme is shutting down: recv returns at once

    def open(self, deadline: Deadline) -> None:
        _mkdir(self.dir)
        other = _read(self.hello, 256)
        if other and _alive(other):
            raise TransportError(f"{self.dir} already has a worker {self.worker} "
                                 f"({other.decode(errors='replace')})")
        for name in _listdir(self.dir):  # a previous run's acks, and a mailbox the sender wrote for it
            if (m := _ACK.fullmatch(name)) and int(m[1]) == self.worker or name == f"to-{self.worker}":
                _unlink(os.path.join(self.dir, name))
        _write(self.dir, f"hello-{self.worker}", self.me)
        self.opened = True

    def recv(self, deadline: Deadline) -> Delivery | None:
        _check_open(self)
        return _poll(deadline, self._take, self.woken)

    def wake(self) -> None:
        self.woken.set()

    def _take(self) -> Delivery | None:
        data = _read(os.path.join(self.dir, f"to-{self.worker}"), MAX_HEADER_BYTES + 256)
        if data is None:
            return None
        line, _, header = data.partition(b"\n")
        if line.startswith(b"refused "):
            raise TransportError(f"{self.what}: the sender refused it: {line[8:308].decode(errors='replace')}")
        if line == self.seen:
            return None
        self.seen = line
        fields = line.split()
        name = fields[2].decode(errors="replace") if len(fields) == 3 else ""
        if not _PAYLOAD.fullmatch(name):
            raise TransportError(f"mailbox to-{self.worker} in {self.dir} is malformed: {line[:80]!r}")
        f = _open(os.path.join(self.dir, name))
        if f is None:  # replaced by a newer version: the mailbox names it now
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != self.nbytes:  # no memory: the core names the mismatch from the header
                return Delivery(header, torch.empty(size, dtype=torch.uint8, device="meta"))
            buf = self.free.pop() if self.free else torch.empty(self.nbytes, dtype=torch.uint8)
            # (numpy's stubs give an ndarray __buffer__ on Python 3.12+ only)
            view, got = memoryview(buf.numpy()), 0  # type: ignore[arg-type]
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    self.free.append(buf)
                    raise TransportError(f"{name} ended after {got} of {size} bytes")
                got += n
        return Delivery(header, buf, release=lambda: self.free.append(buf))

    def ack(self, data: bytes) -> None:
        _check_open(self)
        self.acks += 1
        _write(self.dir, f"ack-{self.worker}-{self.acks:020d}", data)

    def close(self) -> None:
        if not self.opened:
            return
        self.opened = False
        if _read(self.hello, 256) == self.me:
            _unlink(self.hello)
        if not os.path.exists(os.path.join(self.dir, "sender")):  # else the sender reads, then removes them
            for name in _listdir(self.dir, closing=True):
                if (m := _ACK.fullmatch(name)) and int(m[1]) == self.worker:
                    _unlink(os.path.join(self.dir, name))
        self.free = []


class FilesTransport(Transport):
    """Weights through files in ``directory``, a folder every side can reach; XXH3-64-checked by default."""

    name = "files"
    interface = 2
    capabilities = Capabilities(processes=True, async_send=True, subset_send=True, late_join=True,
                                sender_restart=True)

    def __init__(self, *, directory: str | os.PathLike[str] | None = None, checksum: bool = True) -> None:
        if directory is None:
            raise ValueError("the files transport needs directory=<a folder every side can reach>")
        super().__init__(directory=os.path.abspath(os.fspath(directory)),
                         checksum=flag("files option checksum", checksum))

    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        return _Sender(self, ctx)

    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        return _Receiver(self, ctx)
