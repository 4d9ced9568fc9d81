"""``shm``: snapshots in named shared memory, wake-ups and acks over a Unix socket, one host.

The sender owns a few *slots* (``/dev/shm/wsync-<name>-<token>-<i>``, see ``slot.py``), two in
the common case. The core writes each snapshot straight into a free slot (the one sender-side
copy); the sender then tells each target, over its socket, "slot i holds generation g" with
the header. A receiver takes a shared lock on slot i, checks the generation and hands the
core a private copy-on-write map of the slot, whose views become the model's tensors
(``zero_copy``: no receiver-side copy); the lock, and so the slot, stays taken until the
model moves on to a newer version. Otherwise the core copies a read-only view into the model
and releases the lock at once.

A slot is free for the next snapshot when it is not the latest, no worker has been told to
read it without having read it yet (its *mailbox*), and no reader holds its lock. A receiver
that finds a slot locked for writing, or holding another generation, was told about it
before a newer delivery, which is already on its way; it drops the old one.

Receivers find the sender by ``name`` alone (an abstract Unix socket), so a plain-pickled
scheme or one built independently with the same ``name`` connects. Slot files are unlinked
by the sender on close, by a small reaper process if the sender dies, and by receivers that
see the sender vanish.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import select
import selectors
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

import torch

from wsync_core import forked
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
    Wakeup,
    WorkerTimeoutError,
    zero_copy_for,
)
from wsync_core.transport import Event, flag, index_refusal, origin_refusal

from . import wire
from .wire import FRAMING, REASON_BYTES, Kind
from .slot import SHM_DIR, Slot

__all__ = ["ShmTransport"]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,80}\Z")
_TOKEN = re.compile(rb"[0-9a-f]{12}\Z")
_ACK_SEND_TIMEOUT = 30.0
_DRAIN_READS = 64  # reads of a restarted worker's old connection, at most, to reach its end
_CHUNK = 1 << 16  # a larger read buffer costs an mmap per call: 12 us at 1 MiB
_REDIAL_S = 0.02  # how often a worker whose sender is gone looks for one on the name while it waits
_LOOKING = ("; it connects to a sender started again on this name by itself (receive() returns None until "
            "one sends)")


def _slot_path(name: str, token: str, index: int) -> str:
    return f"{SHM_DIR}/wsync-{name}-{token}-{index}"


class _Conn:
    """A receiver's connection as the sender sees it."""

    __slots__ = ("sock", "worker", "reader", "out", "pid", "reading")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.worker: int | None = None
        self.reader = FRAMING.reader("a shm receiver", accept=[Kind.HELLO])
        self.out = bytearray()
        self.pid = wire.peer_pid(sock)
        self.reading = False  # its frames are being handled (a send that fails meanwhile reads no more)


class _Sender(SenderEndpoint):
    def __init__(self, transport: ShmTransport, ctx: SenderContext) -> None:
        self._name: str = transport.options["name"]
        self._nbytes = ctx.layout.nbytes
        # a GPU model's snapshots stay in GPU memory that workers open by its CUDA IPC handle
        self._device = ctx.device if ctx.device.type == "cuda" and transport.options["cuda_ipc"] else None
        self._num_workers = ctx.num_workers
        self._origin = ctx.origin
        self._token = secrets.token_hex(6)
        self._slots: list[Slot] = []
        self._buffers: list[Buffer] = []  # what acquire hands out: one per slot, its index is the slot's
        self._latest: int | None = None  # slot last published
        self._acquired: int | None = None  # slot handed out by acquire, not yet published
        self._gen = 0
        self._mailbox: dict[int, tuple[int, int]] = {}  # worker -> (slot, generation) last sent to it
        self._taken: dict[int, int] = {}  # worker -> newest generation it has taken
        self._conns: dict[int, _Conn] = {}  # worker -> its connection (after HELLO)
        self._events: list[Event] = []
        self._listener: socket.socket | None = None
        self._selector: selectors.DefaultSelector | None = None
        self._reaper: subprocess.Popen | None = None
        self._wakeup = Wakeup()  # wake(): the scheme is shutting down, waits end at once

    # -- set-up and tear-down ---------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(wire.address(self._name))
        except OSError as exc:
            listener.close()
            raise TransportError(f"shm channel {self._name!r} is already in use by another sender ({exc}); "
                                 f"give each sender its own name=") from None
        listener.listen(max(128, self._num_workers))
        listener.setblocking(False)
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wakeup.open(), selectors.EVENT_READ)
        forked.watch(self)
        reaper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")
        self._reaper = subprocess.Popen([sys.executable, "-I", "-S", reaper], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, start_new_session=True)
        for _ in range(2):
            self._new_slot()

    def _new_slot(self) -> int:
        index = len(self._slots)
        path = _slot_path(self._name, self._token, index)
        with contextlib.suppress(FileNotFoundError):  # this sender's own, left by a creation Ctrl-C cut short
            os.unlink(path)
        reaper = self._reaper
        assert reaper is not None and reaper.stdin is not None  # (open started it with stdin=PIPE; a closed
        # sender holds no slot, so acquire's _pump raises before it adds one)
        reaper.stdin.write(path.encode() + b"\n")  # before creating: a crash in between leaves nothing
        reaper.stdin.flush()
        self._slots.append(Slot.create(path, self._nbytes, self._device))
        self._buffers.append(Buffer(self._slots[index].payload, index))
        return index

    def wake(self) -> None:
        self._wakeup.set()

    def close(self) -> None:
        for slot in self._slots:
            slot.unlink()
            slot.close()
        self._slots = []
        self._buffers = []
        self._acquired = self._latest = None
        for conn in self._conns.values():  # a clean end, which the workers do not report as an error
            if conn.out:  # never into a half-sent frame: that worker sees end of file instead
                continue
            with contextlib.suppress(OSError):  # (so does a worker whose socket is full)
                conn.sock.send(FRAMING.encode(Kind.BYE))
        self._close_sockets()
        if self._reaper is not None:
            reaper, self._reaper = self._reaper, None
            assert reaper.stdin is not None  # (stdin=PIPE)
            try:
                reaper.stdin.write(b"\n")  # done: it ends without waiting for every copy of the pipe
                reaper.stdin.close()
            except OSError:  # it died: nothing left to tell it
                pass
            try:
                reaper.wait(10.0)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    def _close_sockets(self) -> None:
        """Close this process's copies of the workers' connections, the selector and the listener."""
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        if self._selector is not None:
            for key in list(self._selector.get_map().values()):
                peer: _Conn | None = key.data  # (a connection is registered with its own socket)
                if peer is not None:  # a connection (the listener and the wake-up close below)
                    peer.sock.close()
            self._selector.close()
            self._selector = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._wakeup.close()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the sender's socket, pipe and slot
        descriptors, so the parent's close is not kept waiting and its channel's name is free;
        unlink nothing, tell no worker, leave the parent's locks and the mappings."""
        for slot in self._slots:
            slot.forget_in_child()
        self._slots = []
        self._buffers = []
        self._wakeup.forget_in_child()
        self._close_sockets()
        if self._reaper is not None:
            reaper, self._reaper = self._reaper, None
            assert reaper.stdin is not None  # (stdin=PIPE)
            reaper.stdin.close()  # (empty: every write is flushed at once)
            reaper.returncode = 0  # not this process's child: never wait for it here

    # -- the core's calls -------------------------------------------------------------------
    def acquire(self, deadline: Deadline) -> Buffer:
        if self._acquired is not None:  # handed out before but never published: still ours
            return self._buffers[self._acquired]
        pumped = False  # (the core has just polled: most often a slot is free without another look)
        while True:
            order = sorted(range(len(self._slots)), key=lambda i: self._slots[i].gen)
            for i in order:
                if i != self._latest and not self._owed(i) and self._slots[i].try_lock(exclusive=True):
                    return self._hand_out(i)
            if not pumped:  # acks that came meanwhile may free one: take them in before adding a slot
                pumped = True
                self._pump(0.0)
                continue
            if len(self._slots) < 2 * self._num_workers + 2:  # owed and viewed per worker, the latest, a spare
                i = self._new_slot()
                self._slots[i].try_lock(exclusive=True)
                return self._hand_out(i)
            if self._wakeup.is_set:
                raise TransportError(f"the shm sender {self._name!r} is shutting down: no slot for a new version")
            if deadline.expired():
                owing = sorted(w for w, (i, g) in self._mailbox.items() if g > self._taken.get(w, -1))
                raise WorkerTimeoutError(
                    f"no shared-memory slot freed up within {deadline.timeout:g} s: all "
                    f"{len(self._slots)} are being read or owed to workers {owing}", owing)
            self._pump(deadline.slice(0.002))  # readers unlock without a message: look again soon

    def _owed(self, index: int) -> bool:
        """Whether some worker was told to read slot ``index`` and has not taken it yet."""
        return any(i == index and g > self._taken.get(w, -1) for w, (i, g) in self._mailbox.items())

    def _hand_out(self, index: int) -> Buffer:
        self._gen += 1
        self._slots[index].gen = self._gen
        self._acquired = index
        return self._buffers[index]

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        if self._selector is None:
            raise TransportError(f"the shm sender {self._name!r} is closed")
        index = buffer.index if isinstance(buffer, Buffer) else -1
        if not (0 <= index < len(self._buffers) and self._buffers[index] is buffer):
            raise TransportError("publish() got a buffer that acquire() did not return")
        if index == self._acquired:
            self._acquired = None
            if self._device is not None:  # the core's copy into a device slot may still be running
                torch.cuda.synchronize(self._device)
            self._slots[index].unlock()
            self._latest = index
        gen = self._slots[index].gen
        message = FRAMING.encode(Kind.DELIVER, header, arg=index, value=gen)
        conns = [(w, conn) for w in workers if (conn := self._conns.get(w)) is not None]
        for w, conn in conns:  # (conn.worker is w)
            self._mailbox[w] = (index, gen)
        for _, conn in conns:  # the sends, which wake the workers, back to back
            self._send(conn, message)

    def poll(self, deadline: Deadline) -> list[Event]:
        self._pump(0.0 if self._events else deadline.slice(3600.0))  # one select when it has to wait
        while not self._events and not deadline.expired() and not self._wakeup.is_set:
            self._pump(deadline.slice(3600.0))
        events, self._events = self._events, []
        return events

    # -- the socket side --------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle socket activity, waiting up to ``timeout`` seconds for some."""
        if self._selector is None:
            raise TransportError(f"the shm sender {self._name!r} is closed")
        for key, mask in self._selector.select(timeout):
            if key.fileobj is self._listener:
                self._accept()
                continue
            if key.data is None:  # the wake-up: left readable, so later waits end at once too
                continue
            conn: _Conn = key.data
            if mask & selectors.EVENT_READ:  # first: what a worker sent before a write to it fails
                self._read(conn)
            if mask & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                self._send(conn, b"")

    def _accept(self) -> None:
        listener, selector = self._listener, self._selector
        assert listener is not None and selector is not None  # (_pump, its caller, found the listener readable)
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            try:
                wire.check_peer(sock)
            except TransportError:  # another user's process: not a worker of ours, nothing to report
                sock.close()
                continue
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            return self._drop(conn, f"connection failed: {exc}")
        if not data:
            return self._drop(conn, "connection closed (the worker shut down or died)")
        conn.reading = True
        try:
            for frame in conn.reader.feed(data):
                if frame.kind == Kind.HELLO:
                    conn.reader.accept = frozenset([Kind.ACK])
                    self._hello(conn, frame.arg, frame.body.decode("ascii", "replace"))
                else:
                    w = conn.worker
                    if w is None:  # (as its reader says: it takes acks only after the hello that names the worker)
                        raise TransportError(f"{conn.reader.peer} sent an ack before its hello")
                    self._taken[w] = max(self._taken.get(w, -1), frame.value)
                    self._events.append(Acked(w, frame.body))
                if conn.sock.fileno() < 0:
                    return
        except TransportError as exc:
            return self._drop(conn, f"protocol violation: {exc}")
        finally:
            conn.reading = False

    def _hello(self, conn: _Conn, w: int, origin: str) -> None:
        why = index_refusal(w, self._num_workers) or origin_refusal(w, origin, self._origin)
        if why is not None:
            return self._refuse(conn, why)
        old = self._conns.get(w)
        if old is not None:  # a worker that restarted: its old connection may have closed already, behind acks not read yet
            self._read_rest(old)
        if self._conns.get(w) is not None:
            return self._refuse(conn, f"worker {w} is already connected (process {self._conns[w].pid})")
        conn.worker = w
        self._conns[w] = conn
        self._mailbox.pop(w, None)
        self._taken[w] = -1
        self._send(conn, FRAMING.encode(Kind.WELCOME, self._token.encode()))
        self._events.append(Joined(w))

    def _refuse(self, conn: _Conn, reason: str) -> None:
        try:
            conn.sock.send(FRAMING.encode(Kind.REFUSE, reason.encode()[:REASON_BYTES]))
        except OSError:
            pass
        self._drop(conn, reason)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.sock.fileno() < 0:
            return
        if data and not conn.out:  # the common case: the socket takes it all at once
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                return self._lost(conn, f"connection failed: {exc}")
            if sent == len(data):
                return
            data = data[sent:]
        had = bool(conn.out)
        conn.out += data
        try:
            wire.send_some(conn.sock, conn.out)
        except OSError as exc:
            return self._lost(conn, f"connection failed: {exc}")
        if bool(conn.out) != had:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            assert self._selector is not None  # (closing it closed every connection's socket: this one is open)
            self._selector.modify(conn.sock, events, conn)

    def _read_rest(self, conn: _Conn) -> None:
        """Read what ``conn`` holds, up to its end (at most ``_DRAIN_READS`` reads): acks a worker
        sent before its connection closed count before its Left."""
        for _ in range(_DRAIN_READS):
            if conn.sock.fileno() < 0 or not select.select([conn.sock], [], [], 0)[0]:
                return
            self._read(conn)

    def _lost(self, conn: _Conn, reason: str) -> None:
        """A send to ``conn`` failed (the worker closed, resetting the connection): read what it
        sent before (its last ack), then drop it."""
        if not conn.reading:
            self._read_rest(conn)
        self._drop(conn, reason)

    def _drop(self, conn: _Conn, reason: str) -> None:
        if conn.sock.fileno() < 0:
            return
        assert self._selector is not None  # (as in _send: the socket is open, so the selector is)
        self._selector.unregister(conn.sock)
        conn.sock.close()
        w = conn.worker
        if w is not None and self._conns.get(w) is conn:
            del self._conns[w]
            self._mailbox.pop(w, None)
            self._events.append(Left(w, reason))


class _Receiver(ReceiverEndpoint):
    def __init__(self, transport: ShmTransport, ctx: ReceiverContext) -> None:
        self._name: str = transport.options["name"]
        self._worker = ctx.worker_idx
        self._origin = ctx.origin
        self._sock: socket.socket | None = None
        self._selector: selectors.DefaultSelector | None = None
        self._slots: dict[int, Slot] = {}
        self._refused = False  # the sender refused this worker: it is not tried again
        self._unanswered = False  # a delivery was taken and neither acked nor released: its ack is the old sender's
        self._zero_copy = zero_copy_for(transport.options["zero_copy"], ctx)
        self._wakeup = Wakeup()  # wake(): the scheme is shutting down, recv returns at once
        self._drained = False  # the delivery just returned came from a read that emptied the socket
        self._fresh()

    def _fresh(self) -> None:
        """What each connection starts with (the first, and one to a sender started again)."""
        self._reader = FRAMING.reader("the shm sender", accept=[Kind.WELCOME, Kind.REFUSE, Kind.BYE])
        self._token: str | None = None
        self._newest: tuple[int, int, bytes] | None = None  # (slot, generation, header) not yet taken
        self._taken = 0
        self._closed_by: str | None = None  # why the sender's side of the socket is gone
        self._reported = False  # receive() raised once since the sender went

    def open(self, deadline: Deadline) -> None:
        while (sock := self._dial()) is None:
            if self._wakeup.is_set:  # shutting down: recv returns None, the core's connect() raises StateError
                return
            if deadline.expired():
                raise WorkerTimeoutError(
                    f"worker {self._worker} found no shm sender named {self._name!r} within "
                    f"{deadline.timeout:g} s; is the sender connected with the same name= option?", [])
            time.sleep(deadline.slice(0.01))
        self._sock = sock
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wakeup.open(), selectors.EVENT_READ)
        forked.watch(self)  # a child forked from here on lets go of its copy of the connection

    def _dial(self) -> socket.socket | None:
        """A connection to the sender on this name, hello said; None if none listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            try:
                sock.connect(wire.address(self._name))
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                return None
            wire.check_peer(sock)
            sock.sendall(FRAMING.encode(Kind.HELLO, self._origin.encode(), arg=self._worker))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _redial(self) -> bool:
        """Once the sender is gone: connect to a sender started again on this name (a restarted
        trainer), in place of the old connection. Not after a refusal, nor while a delivery of the
        old sender waits for its ack. True if connected. (``recv`` raises TransportError the first
        time it finds the sender gone, then looks for a new one, every 20 ms while it waits.)"""
        if self._refused or self._unanswered:
            return False
        sock = self._dial()
        if sock is None:
            return False
        assert self._sock is not None and self._selector is not None  # (recv, its caller, found it open)
        self._sock.close()
        for slot in self._slots.values():  # the old sender's (a version the model views keeps its map)
            slot.close()
        self._slots.clear()
        self._sock = sock
        self._fresh()
        self._reported = True  # until its welcome: a listener closing as its sender shuts down accepts, then resets
        self._selector.register(sock, selectors.EVENT_READ)
        return True

    def wake(self) -> None:
        self._wakeup.set()

    def recv(self, deadline: Deadline) -> Delivery | None:
        selector = self._selector
        if self._sock is None and self._wakeup.is_set:  # woken while it looked for its sender
            return None
        if self._sock is None or selector is None:  # (open sets both, closing clears both)
            raise TransportError(f"worker {self._worker}: the shm receiver is closed")
        # a poll while the delivery just returned is still held, whose read emptied the socket (the
        # core looking for a newer one before it applies it) would read nothing but a system call's
        # time: what arrives meanwhile the next call takes
        read, self._drained = not (self._drained and deadline.expired()), False
        while True:
            if self._wakeup.is_set:
                return None
            drained = self._read() if read else False
            read = True
            if self._newest is not None:
                delivery = self._take()
                if delivery is not None:
                    self._drained = drained
                    return delivery
                continue  # it was stale; a newer one is on its way
            if self._closed_by is not None:
                if self._refused or not self._reported:  # said once, first (a refusal: every time)
                    self._reported = True
                    raise TransportError(f"worker {self._worker}: {self._closed_by}; it keeps the version it holds"
                                         + ("" if self._refused else _LOOKING))
                if self._redial():
                    continue
                if deadline.expired():
                    return None
                selector.select(deadline.slice(_REDIAL_S))  # (only the wake-up is watched)
                continue
            if deadline.expired():
                return None
            left = deadline.remaining()
            selector.select(None if left == float("inf") else left)

    def _read(self) -> bool:
        """Take in every frame waiting on the socket; remember only the newest delivery. True if
        the socket was found empty at the end."""
        sock = self._sock
        assert sock is not None  # (recv, its caller, found it open)
        while self._closed_by is None:
            try:
                data = sock.recv(_CHUNK)
            except BlockingIOError:
                return True
            except OSError as exc:
                self._sender_gone(f"the connection to the shm sender failed ({exc})")
                return False
            if not data:
                self._sender_gone(f"the shm sender {self._name!r} closed the connection (it shut down or died)")
                return False
            for frame in self._reader.feed(data):
                if frame.kind == Kind.DELIVER:
                    self._newest = (frame.arg, frame.value, frame.body)
                elif frame.kind == Kind.WELCOME and _TOKEN.match(frame.body):
                    self._token = frame.body.decode()
                    self._reader.accept = frozenset([Kind.DELIVER, Kind.REFUSE, Kind.BYE])
                    self._reported = False  # this sender's end is said (a redial's, until now, was not)
                elif frame.kind == Kind.BYE:
                    self._sender_gone(f"the shm sender {self._name!r} shut down")
                    self._reported = True  # a clean end: not an error
                    return False
                elif frame.kind == Kind.REFUSE:
                    self._closed_by = f"the shm sender refused this worker: {frame.body.decode(errors='replace')}"
                    self._refused = True
                    return False
                else:
                    raise TransportError(f"worker {self._worker}: the shm sender sent a malformed "
                                         f"welcome {frame.body[:12]!r}")
            if len(data) < _CHUNK:  # drained (more may come: the next call reads it)
                return True
        return False

    def _take(self) -> Delivery | None:
        """Lock and check the newest delivery's slot; None if the sender has reused it since."""
        assert self._newest is not None  # (recv, its caller, found one)
        index, gen, header = self._newest
        self._newest = None
        slot = self._slots.get(index)
        if slot is None:
            if index >= 4096:
                raise TransportError(f"worker {self._worker}: the shm sender named slot {index}")
            assert self._token is not None  # (its reader takes a delivery only after the welcome that gave it)
            slot = self._slots[index] = Slot.open(_slot_path(self._name, self._token, index),
                                                  shared_payload=not self._zero_copy)
        if not slot.try_lock(exclusive=False):
            return None
        if slot.gen != gen:
            slot.unlock()
            return None
        self._taken, self._unanswered = gen, True
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._drained = self._unanswered = False
                slot.unlock()

        if self._zero_copy and not slot.on_device:
            payload, warm = slot.private_payload()
            return Delivery(header, payload, release, adoptable=True, warm=warm)
        return Delivery(header, slot.payload, release)

    def _sender_gone(self, why: str) -> None:
        self._closed_by = why
        if self._selector is not None and self._sock is not None:
            with contextlib.suppress(KeyError, ValueError):  # (its end of file would wake every select)
                self._selector.unregister(self._sock)
        if self._token is not None:  # a sender that died leaves its files; a clean one already removed them
            prefix = f"wsync-{self._name}-{self._token}-"
            for entry in os.listdir(SHM_DIR):
                if entry.startswith(prefix) and entry[len(prefix):].isdigit():
                    try:
                        os.unlink(os.path.join(SHM_DIR, entry))
                    except FileNotFoundError:
                        pass

    def ack(self, data: bytes) -> None:
        self._unanswered = False
        if self._closed_by is not None or self._sock is None:
            return
        frame = FRAMING.encode(Kind.ACK, data, value=self._taken)
        try:
            sent = self._sock.send(frame)  # the common case: all of it at once
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            return self._sender_gone(f"the connection to the shm sender failed ({exc})")
        if sent == len(frame):
            return
        out = bytearray(frame[sent:])
        deadline = Deadline(_ACK_SEND_TIMEOUT)
        try:
            wire.send_some(self._sock, out)
            while out:
                with selectors.DefaultSelector() as sel:
                    sel.register(self._sock, selectors.EVENT_WRITE)
                    if not sel.select(deadline.remaining()):
                        raise TransportError(f"worker {self._worker}: the shm sender took no ack for "
                                             f"{_ACK_SEND_TIMEOUT:g} s")
                wire.send_some(self._sock, out)
        except OSError as exc:
            self._sender_gone(f"the connection to the shm sender failed ({exc})")

    def close(self) -> None:
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()
        self._wakeup.close()
        self._hang_up()
        forked.unwatch(self)

    def forget_in_child(self) -> None:
        """In a forked child (an env pool, a DataLoader worker): close this process's copies of
        the connection, the selector and the wake-up, so the sender sees the worker's end when the
        worker closes (and takes it back under its index). The slots stay: a child that views a
        version keeps it pinned (their locks go with the last copy)."""
        self._wakeup.forget_in_child()
        self._hang_up()

    def _hang_up(self) -> None:
        """Close the selector and the connection (this process's copies)."""
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ShmTransport(Transport):
    """Shared memory on one host. ``name`` is the channel (default: unique); receivers built
    independently with the same ``name`` find the sender.

    With ``zero_copy``, a CPU receiver's tensors become private copy-on-write mappings of the
    slot instead of copies: one memcpy per update whatever the number of workers, and workers
    share the slot's memory. The slot stays pinned until the worker moves on; the worker's own
    writes to its tensors stay its own. ``zero_copy=False`` copies into the tensors the model
    already has (for code that holds tensors across ``receive()``). The default, None, maps
    models of 1 MiB and more and copies smaller ones (cheaper than mapping them).

    With ``cuda_ipc=True``, a sender whose model is on a GPU keeps its snapshots in that GPU's
    memory, which workers open by its CUDA IPC handle and copy from device to device into their
    own models (isolated as always: no worker views the sender's memory after its receive); a
    worker that cannot open it gets a TransportError. By default a GPU model's snapshots are
    staged in host memory, which any worker can read.
    """

    name = "shm"
    interface = 2
    capabilities = Capabilities(processes=True, zero_copy=True, async_send=True, subset_send=True,
                                late_join=True, cuda=True, sender_restart=True)

    def __init__(self, *, name: str | None = None, checksum: bool = False,
                 zero_copy: bool | None = None, cuda_ipc: bool = False) -> None:
        name = uuid.uuid4().hex[:16] if name is None else name
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"shm name must be 1-80 characters of letters, digits, '_', '.', '-', got {name!r}")
        super().__init__(name=name, checksum=flag("shm option checksum", checksum),
                         zero_copy=flag("shm option zero_copy", zero_copy, optional=True),
                         cuda_ipc=flag("shm option cuda_ipc", cuda_ipc))

    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        return _Sender(self, ctx)

    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        return _Receiver(self, ctx)
