"""The trainer's side of ``mp``: a listening Unix socket and one I/O thread for every connection.

``publish`` only records, per worker, the newest (slot, header) to send and wakes the thread;
the thread sends notifications without ever blocking on a worker (non-blocking sockets), one
untaken at a time per worker (the next follows once its ``receive`` took that one, or probed),
newest wins meanwhile, and at most ``_OUTSTANDING`` unreleased: a stuck or frozen worker pins the
slot its model views, one untaken notification and one pending version, never slows the others,
and applies the newest version when it wakes. Slots a worker took and still views (its model, tensors it
kept, a child it forked) stay out of use until it releases them, however many.

A worker whose ``receive`` finds a notification that waited (it was away: a long rollout, a GC
pause, a frozen process) probes first; the sender answers right after notifying the newest
version it holds for that worker (at once if none is pending), so the worker never applies a
version that a newer one had replaced before it asked, even when this process was too busy to
write meanwhile. The probe is needed only when something newer is pending: ``publish`` first writes
its number into each target worker's word of a *board* (a sealed memfd of one 8-byte word per
worker, mapped read-only by each), then notifies, and every notification carries its number; a
worker whose waiting notification's number is its word's takes it without a probe.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import stat
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence

from wsync_core import forked
from wsync_core import Buffer, Deadline, TransportError, WorkerTimeoutError
from wsync_core.protocol import MAX_HEADER_BYTES
from wsync_core.transport import (Acked, Event, Joined, Left, SenderContext, SenderEndpoint, claim_refusal, index_refusal,
                                  origin_refusal)

from wsync_core.memory import Slot

from .wire import FLAG_FD, FRAMING, NONCE_BYTES, Kind, mac, make_socket, sockaddr

__all__ = ["MpSender"]

log = logging.getLogger("wsync.mp")

#: notifications a worker may hold unreleased: the one its model views until it acks a newer one,
#: the one its receive() took last, and one more (sent once that was taken, or on a probe), which
#: the worker's receive answers by releasing the older untaken one; so a worker that stops receiving pins
#: one untaken slot beyond its model's, and the pending newest follows its probe when it wakes
_OUTSTANDING = 3
_READ_CHUNK = 64 * 1024  # below malloc's mmap threshold: a larger buffer costs a syscall per read
#: events kept for poll(); a worker that floods past this is dropped
_MAX_EVENTS = 65536
#: frames queued for a worker that does not read them (answers to its probes, notifications):
#: one that probes past this without reading is dropped
_MAX_QUEUED = 64
#: connections that have not finished the handshake, at most (a flood of them drops the oldest:
#: a worker's own handshake takes one round trip on this host, and it connects again)
_MAX_HANDSHAKING = 64
#: how long a connection may take to finish the handshake before it is dropped (seconds)
_HANDSHAKE_S = 10.0


class _Conn:
    """One accepted connection: its handshake state, worker, output queue and held slots."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FRAMING.reader("an unauthenticated peer", frozenset({Kind.RESPONSE}))
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.since = time.monotonic()
        self.worker: int | None = None
        #: whether the model this worker said hello with has the sender's size
        self.fits = False
        self.out: deque[tuple[memoryview, list[int]]] = deque()
        self.has_fd: set[int] = set()        # slots whose descriptor this peer already got
        self.held: list[int] = []            # slots notified and not yet released, oldest first
        #: slots the worker took before its last ack and has not released: its tensors (or a child
        #: it forked) may view them for as long as it likes; they do not count against _OUTSTANDING
        self.pinned: list[int] = []
        self.pending: tuple[int, bytes, int] | None = None  # newest (slot, header, number) not yet notified
        self.unseen: int | None = None  # the slot of the notification sent and not yet taken
        self.probe: int | None = None   # a probe to answer once nothing is pending: its number

    def push(self, data: bytes, fds: list[int] | None = None) -> None:
        self.out.append((memoryview(data), fds or []))


class MpSender(SenderEndpoint):
    def __init__(self, address: str, authkey: bytes, ctx: SenderContext, max_slots: int) -> None:
        self.address = address
        self.authkey = authkey
        self.num_workers = ctx.num_workers
        self.nbytes = ctx.layout.nbytes
        self.origin = ctx.origin
        self.max_slots = max_slots
        self.slots: list[Slot] = []
        self.buffers: list[Buffer] = []  # what acquire hands out: one per slot, its index is the slot's
        self.latest: int | None = None
        self.published = 0  # the number of the last publish (what the board and notifications carry)
        self.board: Slot | None = None
        self.marks: memoryview | None = None  # the board's words: per worker, the last publish to it
        lock = threading.RLock()
        self.cond = threading.Condition(lock)  # guards shared state; poll() waits on it for events
        self.freed = threading.Condition(lock)  # acquire() waits on it for a slot
        self.events: list[Event] = []
        self.conns: dict[int, _Conn] = {}           # by worker, once it said hello
        self.listener: socket.socket | None = None
        self.selector: selectors.BaseSelector | None = None
        self.wake_r = self.wake_w = -1
        self.thread: threading.Thread | None = None
        self.closing = False
        self.woken = False  # wake(): the scheme is shutting down, waits end at once
        self.failure: str | None = None  # why the I/O thread died: every later call raises it
        self.bound_path: str | None = None

    # -- SenderEndpoint ----------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        listener = make_socket()
        try:
            self._bind(listener)
            listener.listen(64)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self.listener = listener
        board = self.board = Slot.memfd("wsync-mp-board", 8 * max(self.num_workers, 1))
        assert board.map is not None  # (a new slot: only its close() drops its map)
        self.marks = memoryview(board.map).cast("q")
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        forked.watch(self)
        self.thread = threading.Thread(target=self._run, name=f"wsync-mp-sender {self.address}", daemon=True)
        self.thread.start()

    def _check_alive(self) -> None:
        """Raise TransportError if the I/O thread died (nothing would reach a worker)."""
        if self.failure is not None:
            raise TransportError(f"mp: {self.failure}")

    def acquire(self, deadline: Deadline) -> Buffer:
        with self.cond:
            while True:
                self._check_alive()
                busy = {s for c in self.conns.values() for s in (*c.held, *c.pinned)}
                busy |= {c.pending[0] for c in self.conns.values() if c.pending is not None}
                for index, slot in enumerate(self.slots):
                    if index != self.latest and index not in busy:
                        return self.buffers[index]
                if len(self.slots) < self.max_slots:
                    slot = Slot.memfd(f"wsync-mp-slot{len(self.slots)}", self.nbytes)
                    assert slot.tensor is not None  # (a new slot: only its close() drops its tensor)
                    self.slots.append(slot)
                    self.buffers.append(Buffer(slot.tensor, len(self.buffers)))
                    return self.buffers[-1]
                if self.woken:
                    raise TransportError("mp: the sender is shutting down: no slot for a new version")
                if deadline.expired():
                    holders = sorted(w for w, c in self.conns.items() if c.held or c.pending)
                    raise WorkerTimeoutError(
                        f"mp: all {self.max_slots} payload slots are still being read by workers {holders} "
                        f"after {deadline.timeout:g} s (raise max_slots, or unblock those workers)", holders)
                self.freed.wait(deadline.slice(1.0))

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        index = buffer.index if isinstance(buffer, Buffer) else -1
        if not (0 <= index < len(self.buffers) and self.buffers[index] is buffer):
            raise TransportError("mp: publish() got a buffer that acquire() did not return")
        if len(header) > MAX_HEADER_BYTES:
            raise TransportError(f"mp: a header of {len(header)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
        with self.cond:
            self._check_alive()
            marks = self.marks
            assert marks is not None  # (open made it; a closed sender has no buffer to publish: refused above)
            self.latest = index
            self.published += 1
            conns = [(w, conn) for w in workers if (conn := self.conns.get(w)) is not None]
            for w, conn in conns:  # every frame made first: the writes, which wake workers, follow back to back
                marks[w] = self.published  # before the notification (conn.worker is w): see the module's docstring
                conn.pending = (index, header, self.published)
                self._pump(conn, from_io_thread=False, write=False)
            stuck = False
            for _, conn in conns:
                self._flush(conn, from_io_thread=False)  # most often written out right here
                stuck = stuck or bool(conn.out)
        if stuck:  # the I/O thread writes the rest when the socket has room
            self._wake()

    def poll(self, deadline: Deadline) -> list[Event]:
        with self.cond:
            while not (self.events or self.closing or self.woken or deadline.expired()):
                self.cond.wait(deadline.slice(1.0))
            events, self.events = self.events, []
            if not events:
                self._check_alive()
        return events

    def wake(self) -> None:
        with self.cond:
            self.woken = True
            self.cond.notify_all()
            self.freed.notify_all()

    def close(self) -> None:
        with self.cond:
            if self.closing:
                return
            self.closing = True
            self.cond.notify_all()
        if self.thread is not None:
            self._wake()
            self.thread.join(10.0)
        self._release_fds(goodbye=True)
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    # -- helpers -----------------------------------------------------------------------------
    def _bind(self, listener: socket.socket) -> None:
        addr = sockaddr(self.address)
        try:
            listener.bind(addr)
        except OSError as exc:
            if isinstance(addr, str) and _stale_socket(addr):
                os.unlink(addr)
                listener.bind(addr)
            else:
                raise TransportError(f"mp: cannot listen on {self.address!r}: {exc} "
                                     f"(is another sender using this address?)") from None
        if isinstance(addr, str):
            self.bound_path = addr
            os.chmod(addr, 0o600)

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):  # pipe full (a wake-up is pending anyway) or closed
            pass

    def _release_fds(self, goodbye: bool) -> None:
        """Close every socket, descriptor and slot (``goodbye``: tell workers first; else a forked child)."""
        for conn in list(self.conns.values()) + list(getattr(self, "_handshaking", {}).values()):
            if goodbye and not conn.out:  # never cut into a half-written frame
                try:
                    conn.sock.setblocking(False)
                    conn.sock.send(FRAMING.encode(Kind.CLOSE))
                except OSError:
                    pass
            conn.sock.close()
        self.conns.clear()
        if self.selector is not None:
            self.selector.close()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            if goodbye and self.bound_path and _stale_socket(self.bound_path, check_alive=False):
                os.unlink(self.bound_path)
        for fd in (self.wake_r, self.wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake_r = self.wake_w = -1
        if self.marks is not None:
            self.marks.release()
            self.marks = None
        if self.board is not None:
            self.board.close()
            self.board = None
        for slot in self.slots:
            slot.close()
        self.slots = []
        self.buffers = []

    def _emit(self, event: Event) -> None:
        self.events.append(event)
        self.cond.notify_all()

    # -- the I/O thread (everything below runs on it, under self.cond for shared state) -------
    def _io_selector(self) -> selectors.BaseSelector:
        """The selector: open makes it before it starts the I/O thread, its only user."""
        selector = self.selector
        assert selector is not None
        return selector

    def _run(self) -> None:
        self._handshaking: dict[int, _Conn] = {}
        try:
            while not self.closing:
                if self._handshaking:
                    self._expire_handshakes()
                for key, mask in self._io_selector().select(1.0):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj == self.wake_r:
                        _drain(self.wake_r)
                        with self.cond:
                            for conn in list(self.conns.values()):
                                self._pump(conn)
                                self._flush(conn)
                    else:
                        conn = key.data
                        try:
                            if mask & selectors.EVENT_READ:
                                self._read(conn)
                            if mask & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                                with self.cond:
                                    self._flush(conn)
                        except (OSError, TransportError) as exc:
                            self._drop(conn, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # the loop must never die silently: fail every worker and every later call
            log.exception("mp sender I/O thread failed")
            with self.cond:
                self.failure = f"the sender's I/O thread failed: {type(exc).__name__}: {exc}"
                for w in list(self.conns):
                    self._emit(Left(w, self.failure))
                self.freed.notify_all()

    def _accept(self) -> None:
        listener = self.listener
        assert listener is not None  # (called for the listener's key)
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors (EMFILE, ENFILE), say: make room, and go on serving
            log.warning("mp sender could not accept a connection: %s", exc)
            if self._handshaking:
                self._drop(next(iter(self._handshaking.values())), f"dropped to make room: {exc}")
            else:
                time.sleep(0.05)  # (the listener stays readable: no loop at full speed meanwhile)
            return
        sock.setblocking(False)
        if len(self._handshaking) >= _MAX_HANDSHAKING:
            self._drop(next(iter(self._handshaking.values())), "too many connections in the handshake")
        conn = _Conn(sock)
        self._handshaking[sock.fileno()] = conn
        conn.push(FRAMING.encode(Kind.CHALLENGE, conn.nonce))
        self._io_selector().register(sock, selectors.EVENT_READ, conn)
        with self.cond:
            self._flush(conn)

    def _expire_handshakes(self) -> None:
        """Drop the connections that have not finished the handshake within ``_HANDSHAKE_S``."""
        now = time.monotonic()
        for conn in [c for c in self._handshaking.values() if now - c.since > _HANDSHAKE_S]:
            self._drop(conn, f"no handshake within {_HANDSHAKE_S:g} s")

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(_READ_CHUNK)
        if not data:
            who = f"worker {conn.worker}" if conn.worker is not None else "a peer"
            raise TransportError(f"{who} closed the connection (it exited, was killed or shut down)")
        for frame in conn.reader.feed(data):
            if frame.kind is Kind.RESPONSE:
                if not secrets.compare_digest(frame.body[:NONCE_BYTES], mac(self.authkey, b"receiver", conn.nonce)):
                    raise TransportError("a peer failed authentication (wrong authkey?)")
                conn.push(FRAMING.encode(Kind.PROOF, mac(self.authkey, b"sender", frame.body[NONCE_BYTES:])))
                conn.reader.accept, conn.reader.peer = frozenset({Kind.HELLO}), "an authenticated peer"
            elif frame.kind is Kind.HELLO:
                self._hello(conn, frame.arg, frame.value, frame.body.decode("ascii", "replace"))
            elif frame.kind is Kind.RELEASE:
                with self.cond:
                    for taken in (conn.held, conn.pinned):
                        if frame.arg in taken:
                            taken.remove(frame.arg)
                            self.freed.notify_all()  # (not poll(): a release is no event)
                            break
                    self._pump(conn)
            elif frame.kind is Kind.SEEN:
                with self.cond:
                    if conn.unseen == frame.arg:
                        conn.unseen = None
                    self._pump(conn)
            elif frame.kind is Kind.PROBE:
                with self.cond:
                    if len(conn.out) >= _MAX_QUEUED:
                        raise TransportError(f"worker {conn.worker} probes without reading the answers "
                                             f"({len(conn.out)} frames queued)")
                    conn.probe, conn.unseen = frame.arg, None  # it takes whatever is newest next
                    self._pump(conn)
                    self._answer(conn)
            elif frame.kind is Kind.ACK:
                with self.cond:
                    w = conn.worker
                    if w is None:  # (as its reader says: it takes acks only after the hello that names the worker)
                        raise TransportError(f"{conn.reader.peer} sent an ack before its hello")
                    if len(self.events) >= _MAX_EVENTS:
                        raise TransportError(f"worker {w} sent {_MAX_EVENTS} acks the core has not "
                                             f"collected yet (one per delivery is expected)")
                    self._emit(Acked(w, frame.body))
                    # the worker acks after taking its newest notification: every older one it
                    # still holds was taken (the newest may be unread), so it no longer counts
                    conn.pinned += conn.held[:-1]
                    del conn.held[:-1]
                    self._pump(conn)
        with self.cond:
            self._flush(conn)

    def _hello(self, conn: _Conn, worker: int, nbytes: int, origin: str) -> None:
        """A receiver's hello as ``worker`` with a model of ``nbytes``, of a scheme of ``origin``: it
        takes the index (from a connection that held it: a restarted worker), unless the index is
        out of range, the scheme is another trainer's (``origin_refusal``), or a connection whose
        model fits holds it and this one's does not (``claim_refusal``)."""
        self._handshaking.pop(conn.sock.fileno(), None)
        why = index_refusal(worker, self.num_workers) or origin_refusal(worker, origin, self.origin)
        if why is None:
            with self.cond:
                held = self.conns.get(worker)
                if held is not None and held.fits and nbytes != self.nbytes:
                    why = claim_refusal(worker, f"a payload of {nbytes} bytes; this sender's has {self.nbytes}")
        if why is not None:
            conn.push(FRAMING.encode(Kind.CLOSE, why.encode()))
            with self.cond:
                self._flush(conn)
            raise TransportError(f"a peer that said it is worker {worker} was refused: {why}")
        conn.fits = nbytes == self.nbytes
        conn.reader.accept = frozenset({Kind.RELEASE, Kind.ACK, Kind.SEEN, Kind.PROBE})
        conn.reader.peer = f"worker {worker}"
        with self.cond:
            old = self.conns.pop(worker, None)
            if old is not None:  # a restarted worker: the new connection wins, quietly
                old.worker = None
                if not old.out:
                    old.push(FRAMING.encode(Kind.CLOSE, f"another connection joined as worker {worker}".encode()))
                    self._flush(old)
                self._close_conn(old)
            conn.worker = worker
            self.conns[worker] = conn
            board = self.board
            assert board is not None  # (open made it before it started this thread)
            conn.push(FRAMING.encode(Kind.BOARD, flags=FLAG_FD), [board.fd])
            self._emit(Joined(worker))

    def _pump(self, conn: _Conn, from_io_thread: bool = True, write: bool = True) -> None:
        """Queue the newest pending notification for ``conn`` if the last one was read and it holds
        fewer than _OUTSTANDING, and (``write``) write."""
        if conn.pending is None or conn.unseen is not None or len(conn.held) >= _OUTSTANDING:
            return
        index, header, number = conn.pending
        conn.pending = None
        if index in conn.has_fd:
            conn.push(FRAMING.encode(Kind.NOTIFY, header, arg=index, value=number))
        else:
            conn.push(FRAMING.encode(Kind.NOTIFY, header, arg=index, value=number, flags=FLAG_FD),
                      [self.slots[index].fd])
            conn.has_fd.add(index)
        conn.held.append(index)
        conn.unseen = index
        self._answer(conn)
        if write:
            self._flush(conn, from_io_thread)

    def _answer(self, conn: _Conn) -> None:
        """Queue the answer to ``conn``'s probe once no version waits for it: the answer then follows
        the notification of the newest version published before the probe came."""
        if conn.probe is not None and conn.pending is None:
            conn.push(FRAMING.encode(Kind.ANSWER, arg=conn.probe))
            conn.probe = None

    def _flush(self, conn: _Conn, from_io_thread: bool = True) -> None:
        """Write what the socket takes now; the I/O thread also watches for writability while something is left."""
        if conn.sock.fileno() < 0:
            return
        try:
            while conn.out:
                data, fds = conn.out[0]
                if fds:
                    n = conn.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))])
                    fds.clear()
                else:
                    n = conn.sock.send(data)
                if n < len(data):
                    conn.out[0] = (data[n:], fds)
                else:
                    conn.out.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:  # a dead peer: the read side reports it as EOF or reset
            log.debug("mp: write to worker %s failed: %s", conn.worker, exc)
            conn.out.clear()
        if not from_io_thread:  # only the I/O thread touches its selector
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        selector = self._io_selector()
        try:
            if selector.get_key(conn.sock).events != want:
                selector.modify(conn.sock, want, conn)
        except (KeyError, ValueError):
            pass

    def _drop(self, conn: _Conn, reason: str) -> None:
        self._handshaking.pop(conn.sock.fileno(), None)
        with self.cond:
            if conn.worker is not None and self.conns.get(conn.worker) is conn:
                del self.conns[conn.worker]
                log.info("mp: worker %d left: %s", conn.worker, reason)  # the core warns about it
                self._emit(Left(conn.worker, reason))
            else:
                log.info("mp: dropped a connection: %s", reason)
            self._close_conn(conn)

    def _close_conn(self, conn: _Conn) -> None:
        try:
            self._io_selector().unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.held.clear()
        conn.pinned.clear()
        conn.pending = None
        self.cond.notify_all()
        self.freed.notify_all()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the sender's descriptors, touch nothing else."""
        self.closing = True
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.freed = threading.Condition(lock)
        self.thread = None
        self._release_fds(goodbye=False)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _stale_socket(path: str, check_alive: bool = True) -> bool:
    """True if ``path`` is a Unix socket (and, with ``check_alive``, nobody listens on it)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    if not check_alive:
        return True
    probe = make_socket()
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False
