"""A worker's side of ``mp``: connect, authenticate, then read the socket inside ``recv``.

There is no thread of its own: ``recv`` reads what waits on the socket and, if nothing does,
waits on it (and on an eventfd ``wake`` writes) until its deadline, so a notification wakes the
thread that applies it. Of the notifications read, the newest wins; an older one still untaken
is released at once. A ``recv`` that finds a notification waiting (it arrived before the call)
looks at its word of the sender's board, the number of the last publish to this worker: if the
notification carries that number, nothing newer was published and it is taken at once; otherwise
the newer one is still in the sender, which sends at most one untaken notification, and ``recv``
probes and reads on (until its deadline) until the sender's answer, which follows the newest
version the sender held. So a worker that was away never applies a version that something newer
had replaced before it asked, and pays a round trip to the sender only when something had. The sender sends a worker at most one notification it has
not taken (and one more after a probe), so a worker that stops calling ``receive`` pins at most
the slot its model views and one untaken. Payloads are private copy-on-write maps of the
sender's sealed slots, which the core adopts as the model's tensors (``zero_copy``) and releases
when the model moves on (one map per slot, kept across deliveries: ``wsync_core.memory.PrivateMap``
drops the pages the worker wrote before the slot goes back); or read-only maps it copies from.

The SEEN and RELEASE frames that taking and applying a delivery produce are held back and go out
with its ACK, in one send: the sender's I/O thread then wakes once per version and worker, not
three times. Held frames never wait on a worker that stops: they go out with the next frame sent
(an ack, a probe), before a ``recv`` waits, and at the latest at the second ``recv`` after the
delivery was taken if no ack came in between.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import select
import selectors
import socket
import threading
import time
from collections import deque

import torch
from wsync_core import forked
from wsync_core import Deadline, TransportError, Wakeup, WorkerTimeoutError
from wsync_core.memory import PrivateMap
from wsync_core.transport import Delivery, ReceiverContext, ReceiverEndpoint

from wsync_core.framing import PREFIX, Frame

from .wire import (FLAG_FD, FRAMING, MAX_FDS, MAX_SLOTS, NONCE_BYTES, Kind, mac, make_socket, map_board, map_slot,
                   slot_fits, sockaddr)

__all__ = ["MpReceiver"]

log = logging.getLogger("wsync.mp")

_READ_CHUNK = 64 * 1024  # below malloc's mmap threshold: a larger buffer costs a syscall per read
#: how long an ack or release may wait for room in the socket before the connection counts as dead
_SEND_TIMEOUT = 30.0
#: how often a worker whose sender is gone looks for a new one on the address while it waits
_REDIAL_S = 0.02
#: how long a handshake with a sender started again may take
_HANDSHAKE_S = 10.0
_EMPTY = torch.empty(0, dtype=torch.uint8)


class MpReceiver(ReceiverEndpoint):
    def __init__(self, address: str, authkey: bytes, ctx: ReceiverContext, zero_copy: bool) -> None:
        self.address = address
        self.authkey = authkey
        self.worker = ctx.worker_idx
        self.nbytes = ctx.layout.nbytes
        self.origin = ctx.origin
        self.peer = f"the mp sender at {address!r}"
        self.sock: socket.socket | None = None
        self.selector: selectors.DefaultSelector | None = None
        self.wakeup = Wakeup()          # wake(): the scheme is shutting down, recv returns at once
        self.send_lock = threading.Lock()  # (a release may come from another thread once the core closed)
        #: slot -> (mmap, tensor) to copy from; its PrivateMap (zero-copy: kept across deliveries);
        #: None if its size is not ours
        self.maps: dict[int, tuple | PrivateMap | None] = {}
        self.zero_copy = zero_copy
        self.fds: deque[int] = deque()
        self.board: mmap.mmap | None = None
        self.marks: memoryview | None = None  # the board's words (this worker's: the last publish to it)
        #: ended by the sender's refusal or a protocol violation (a sender still there): not tried again
        self.final = False
        self.connection = 0             # the connection's number: a delivery of an older one is not released to this
        #: a delivery was taken and neither acked nor released: its ack belongs to the sender it came from
        self.unanswered = False
        self.closing = False
        self._fresh()

    def _fresh(self) -> None:
        """What each connection starts with (the first, and one to a sender started again)."""
        self.reader = FRAMING.reader(self.peer, frozenset({Kind.NOTIFY, Kind.CLOSE, Kind.ANSWER, Kind.BOARD}))
        self.viewing: dict[int, int] = {}          # slot -> deliveries of it not released yet
        self.newest: tuple[int, bytes, int] | None = None  # (slot, header, publish number)
        self.ended: str | None = None   # why the connection ended
        self.failed = False             # ended by an error (raise) rather than a clean shutdown (None)
        self.reported = False           # recv raised once since the sender went
        self.drained = False            # the delivery just returned came from a read that emptied the socket
        self.probes = 0                 # the number of the last probe sent
        self.answered = 0               # the number of the last probe the sender answered
        #: SEEN/RELEASE frames held back (under send_lock) to go out with the next ack in one send
        self.held = bytearray()
        #: recv() calls that returned nothing since the last delivery taken while frames were held
        #: (-1: none held back since the last flush)
        self.idle_recvs = -1

    # -- ReceiverEndpoint --------------------------------------------------------------------
    def open(self, deadline: Deadline) -> None:
        self.sock = self._connect(deadline)
        if self.sock is None:  # woken while it looked for its sender: recv returns None
            return
        forked.watch(self)
        try:
            self._handshake(deadline)
        except socket.timeout:
            raise WorkerTimeoutError(f"worker {self.worker}: {self.peer} did not finish the handshake "
                                     f"within {deadline.timeout:g} s", []) from None
        except OSError as exc:
            raise TransportError(f"worker {self.worker}: handshake with {self.peer} failed: {exc}") from None
        self.sock.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.selector.register(self.wakeup.open(), selectors.EVENT_READ)

    def recv(self, deadline: Deadline) -> Delivery | None:
        """The newest notification's payload, waiting until the deadline; None if none came. If one
        waited when called, first probe and wait for the answer, so what this returns is never older
        than what the sender published before the call. Raises TransportError once the connection
        failed and nothing is left to deliver."""
        if self.sock is None and self.wakeup.is_set:  # woken while it looked for its sender
            return None
        if self.sock is None:
            raise TransportError(f"worker {self.worker}: the mp receiver is closed")
        if self.idle_recvs >= 1:  # a delivery was taken two calls ago and no ack followed: send what is held
            self._send(b"")
        # a poll while the delivery just returned is still held, whose read emptied the socket (the
        # core looking for a newer one before it applies it), would read nothing but a system
        # call's time: what arrives meanwhile the next call takes
        drained = self._read() if not (self.drained and deadline.expired()) else True
        self.drained = False
        if (self.newest is not None and self.ended is None and not self.wakeup.is_set and not deadline.expired()
                and (self.marks is None or self.marks[self.worker] != self.newest[2])):
            self.probes += 1  # it waited: the sender answers after the newest version it holds
            probe = self.probes
            self._send(FRAMING.encode(Kind.PROBE, arg=probe))  # (held frames go first)
            while (self.answered < probe and self.ended is None and not self.wakeup.is_set
                   and not deadline.expired()):
                drained = self._wait(deadline)
        if self.idle_recvs >= 0 and self.newest is None and not deadline.expired():
            self._send(b"")  # about to wait: the sender must not wait for what is held meanwhile
        while self.newest is None and self.ended is None and not self.wakeup.is_set and not deadline.expired():
            drained = self._wait(deadline)
        if self.newest is None and self.ended is not None and self._redial(deadline):
            return self.recv(deadline)  # the sender started again on the address: from its first notification
        if self.newest is None or self.wakeup.is_set:
            with self.send_lock:
                if self.idle_recvs >= 0:
                    self.idle_recvs += 1
            if self.failed and (self.final or not self.reported):  # said once (a final end: every time)
                self.reported = True
                raise TransportError(f"worker {self.worker}: {self.ended}; the model keeps the last version it "
                                     f"applied" + ("" if self.final else "; it connects to a sender started "
                                                   "again on the address by itself (receive() returns None "
                                                   "until one sends)"))
            return None
        index, header, _ = self.newest
        self.newest, self.unanswered = None, True
        self.drained = drained
        mapped, connection = self.maps.get(index), self.connection
        with self.send_lock:  # taken: the sender may notify the next one (held back until the ack, sent with it)
            self.held += FRAMING.encode(Kind.SEEN, arg=index)
            self.idle_recvs = 0
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.drained = self.unanswered = False
                if connection != self.connection:
                    return  # that sender is gone (its slot's map goes with the last view of it)
                with self.send_lock:
                    left = self.viewing.pop(index, 0) - 1
                    if left > 0:
                        self.viewing[index] = left
                if left == 0 and isinstance(kept := self.maps.get(index), PrivateMap):
                    kept.clean()  # nothing views it: the worker's writes go
                self._release(index)

        if mapped is None:
            return Delivery(header, _EMPTY, release)
        if isinstance(mapped, PrivateMap):
            payload, warm = mapped.view(0, self.nbytes)
            with self.send_lock:
                self.viewing[index] = self.viewing.get(index, 0) + 1
            return Delivery(header, payload, release, adoptable=True, warm=warm)
        return Delivery(header, mapped[1], release)

    def ack(self, data: bytes) -> None:
        """Send the ack, with the SEEN and RELEASE frames held back since the delivery was taken, in one send."""
        self.unanswered = False
        self._send(FRAMING.encode(Kind.ACK, data))

    def wake(self) -> None:
        self.wakeup.set()

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # the sender sees Left at once
            except OSError:
                pass
        if self.selector is not None:
            self.selector.close()
        self.wakeup.close()
        self._release_fds()
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

    # -- connection set-up --------------------------------------------------------------------
    def _socket(self) -> socket.socket:
        """The connection: open makes it first (a closed one stays, closed), and the core calls the
        rest only once open returned."""
        sock = self.sock
        assert sock is not None
        return sock

    def _live_selector(self) -> selectors.DefaultSelector:
        """The selector: open makes it once it shook hands; recv, its user, runs only once open returned."""
        selector = self.selector
        assert selector is not None
        return selector

    def _redial(self, deadline: Deadline) -> bool:
        """Once the sender is gone: connect to a sender started again on the address (a restarted
        trainer), in place of the old connection (whose maps go as the model stops viewing them),
        looking every 20 ms until ``deadline``, once ``recv`` has said the sender failed (a clean
        shutdown it does not say). Not after a refusal or a protocol violation (the sender is
        still there), nor while a delivery of the old sender waits for its ack. True if connected."""
        with contextlib.suppress(KeyError, ValueError):  # (its end of file would wake every select)
            self._live_selector().unregister(self._socket())
        if self.failed and not self.reported:
            return False  # recv says it first
        while not (self.final or self.unanswered or self.closing or self.wakeup.is_set):
            sock = make_socket()
            try:
                sock.connect(sockaddr(self.address))
            except OSError:  # none listens there (yet)
                sock.close()
            else:
                if self._reopen(sock):
                    return True
            if deadline.expired() or self.failed and not self.reported:  # (a handshake that failed)
                return False
            self._live_selector().select(deadline.slice(_REDIAL_S))  # (only the wake-up is watched)
        return False

    def _reopen(self, sock: socket.socket) -> bool:
        """Take ``sock``, connected to a new sender, in place of the old connection, and shake hands
        (within 10 s: a sender that accepted answers at once). False if that failed (then it
        ended too, saying why)."""
        self._release_fds()
        self.sock, self.connection = sock, self.connection + 1
        self._fresh()
        try:
            self._handshake(Deadline(_HANDSHAKE_S))
        except (OSError, TransportError) as exc:
            # before its challenge, a listener closing as its sender shuts down (it accepted, then
            # reset): none there yet, not an error; after it, a sender that refused or broke off
            self._end(f"the handshake with {self.peer}, started again, failed: {exc}", self.challenged)
            return False
        sock.setblocking(False)
        self._live_selector().register(sock, selectors.EVENT_READ)
        return True

    def _connect(self, deadline: Deadline) -> socket.socket | None:
        """A socket connected to the sender's address, trying until ``deadline``; None once woken
        (the scheme is shutting down). Raises WorkerTimeoutError at the deadline."""
        addr = sockaddr(self.address)
        while True:
            if self.wakeup.is_set:
                return None
            sock = make_socket()
            try:
                sock.connect(addr)
                return sock
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if deadline.expired():
                    raise WorkerTimeoutError(f"worker {self.worker} could not reach {self.peer} within "
                                             f"{deadline.timeout:g} s: {exc}", []) from None
                time.sleep(deadline.slice(0.02))
            except BaseException:
                sock.close()
                raise

    def _handshake(self, deadline: Deadline) -> None:
        self.challenged = False
        challenge = self._read_frame(Kind.CHALLENGE, deadline)
        self.challenged = True  # a sender answered
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._socket().sendall(FRAMING.encode(Kind.RESPONSE, mac(self.authkey, b"receiver", challenge.body) + nonce)
                          + FRAMING.encode(Kind.HELLO, self.origin.encode(), arg=self.worker, value=self.nbytes))
        proof = self._read_frame(Kind.PROOF, deadline)
        if not secrets.compare_digest(proof.body, mac(self.authkey, b"sender", nonce)):
            raise TransportError(f"worker {self.worker}: {self.peer} failed authentication (wrong authkey?)")

    def _read_frame(self, kind: Kind, deadline: Deadline) -> Frame:
        """Exactly one handshake frame (fixed size), read with the deadline."""
        size = PREFIX.size + NONCE_BYTES
        data = bytearray()
        sock = self._socket()
        while len(data) < size:
            left = deadline.seconds()  # (None: math.inf, which settimeout cannot take)
            sock.settimeout(None if left is None else max(left, 1e-3))
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise TransportError(f"worker {self.worker}: {self.peer} closed the connection during the "
                                     f"handshake (wrong authkey, or worker index out of range?)")
            data += chunk
        frames = list(FRAMING.reader(self.peer, frozenset({kind})).feed(bytes(data)))
        if len(frames) != 1 or len(frames[0].body) != NONCE_BYTES:
            raise TransportError(f"worker {self.worker}: {self.peer} sent a malformed {kind.name} frame")
        return frames[0]

    # -- reading (in recv) ------------------------------------------------------------------------
    def _wait(self, deadline: Deadline) -> bool:
        """Wait until the socket is readable, ``wake`` was called or the deadline passed, then read."""
        self._live_selector().select(deadline.seconds())
        return self._read()

    def _read(self) -> bool:
        """Take in every frame waiting on the socket; True if it was found empty at the end. A
        failed or closed connection sets ``ended`` (and ``failed`` unless it was a clean goodbye)."""
        sock = self._socket()
        while self.ended is None:
            try:
                data, fds, flags, _ = socket.recv_fds(sock, _READ_CHUNK, MAX_FDS)
            except BlockingIOError:
                return True
            except OSError as exc:
                self._end(f"connection to {self.peer} failed: {exc}", True)
                return False
            self.fds.extend(fds)
            try:
                if flags & socket.MSG_CTRUNC or len(self.fds) > MAX_FDS:
                    raise TransportError(f"{self.peer} sent more descriptors than it announced")
                if not data:
                    self._end(f"{self.peer} closed the connection without a goodbye (it exited or was killed)", True)
                    return False
                for frame in self.reader.feed(data):
                    if frame.kind is Kind.CLOSE:
                        reason = frame.body.decode("utf-8", "replace")
                        if reason:
                            self._end(f"{self.peer} refused this worker: {reason}", True)
                            self.final = True
                        else:
                            self._end(f"{self.peer} shut down", False)
                        return False
                    if frame.kind is Kind.ANSWER:
                        self.answered = max(self.answered, frame.arg)
                    elif frame.kind is Kind.BOARD:
                        self._board(frame)
                    else:
                        self._notify(frame)
            except TransportError as exc:  # the sender broke the protocol: it is still there
                self._end(f"connection to {self.peer} failed: {exc}", True)
                self.final = True
                return False
            if len(data) < _READ_CHUNK:  # drained (more may come: the next call reads it)
                return True
        return False

    def _end(self, why: str, failed: bool) -> None:
        if failed and not self.closing:
            log.warning("mp worker %d: %s", self.worker, why)
        self.ended, self.failed = why, failed

    def _board(self, frame: Frame) -> None:
        if self.board is not None or not frame.flags & FLAG_FD or not self.fds:
            raise TransportError(f"{self.peer} sent a second board, or one without its descriptor")
        fd = self.fds.popleft()
        try:
            self.board, self.marks = map_board(fd, self.worker, self.peer)
        finally:
            os.close(fd)

    def _notify(self, frame: Frame) -> None:
        index = frame.arg
        if index >= MAX_SLOTS:
            raise TransportError(f"{self.peer} named slot {index}, the limit is {MAX_SLOTS}")
        if frame.flags & FLAG_FD:
            if not self.fds:
                raise TransportError(f"{self.peer} announced a descriptor for slot {index} but sent none")
            fd = self.fds.popleft()
            try:
                if index in self.maps:
                    raise TransportError(f"{self.peer} sent a second descriptor for slot {index}")
                if not self.zero_copy:
                    self.maps[index] = map_slot(fd, self.nbytes, self.peer)
                elif slot_fits(fd, self.nbytes, self.peer):  # mapped privately only: no shared map
                    self.maps[index] = PrivateMap(fd, max(self.nbytes, 1))
                else:
                    self.maps[index] = None
            finally:
                if fd >= 0:
                    os.close(fd)
        elif index not in self.maps:
            raise TransportError(f"{self.peer} named slot {index} without sending its descriptor")
        older, self.newest = self.newest, (index, frame.body, frame.value)
        if older is not None:
            self._release(older[0])

    # -- helpers --------------------------------------------------------------------------------
    def _release(self, index: int) -> None:
        self._send(FRAMING.encode(Kind.RELEASE, arg=index), hold=True)

    def _send(self, data: bytes, hold: bool = False) -> None:
        """Send a small frame (after any held back), waiting at most _SEND_TIMEOUT for room; a dead
        sender is reported by recv. ``hold``: keep it back for the next send instead while a taken
        delivery waits for its ack (a SEEN, or a RELEASE then)."""
        with self.send_lock:
            if hold and self.idle_recvs >= 0:
                self.held += data
                return
            if self.held:
                data, self.held = bytes(self.held) + data, bytearray()
                self.idle_recvs = -1
            if not data:
                return
            view = memoryview(data)
            end = time.monotonic() + _SEND_TIMEOUT
            try:
                while view:
                    try:
                        view = view[self._socket().send(view, socket.MSG_DONTWAIT):]
                    except BlockingIOError:
                        left = end - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"no room to send for {_SEND_TIMEOUT:g} s") from None
                        select.select([], [self._socket()], [], min(left, 1.0))
            except OSError as exc:  # the next read sees the same failure and recv reports it
                log.debug("mp worker %d: send to the sender failed: %s", self.worker, exc)
                try:
                    self._socket().shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _release_fds(self) -> None:
        if self.sock is not None:
            self.sock.close()
        while self.fds:
            os.close(self.fds.popleft())
        if self.marks is not None:  # (the board's words: released before the board, set and cleared with it)
            self.marks.release()
            self.marks = None
        if self.board is not None:
            self.board.close()
            self.board = None
        maps = [mapped[0] for mapped in self.maps.values() if isinstance(mapped, tuple)]
        self.maps.clear()  # drops this endpoint's maps (private ones too), so only the core's views keep one alive
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # the core still holds a payload view; the map goes with it
                pass

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the descriptors, touch nothing else."""
        self.closing = True
        if self.sock is not None:
            self.sock.close()
        if self.selector is not None:
            self.selector.close()
        self.wakeup.forget_in_child()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
