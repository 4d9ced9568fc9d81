"""The trainer's side: one ROUTER socket; a small snapshot goes out in its header's frame, a large one
as a zero-copy frame of its own, to each worker.

Workers are known by their hello, not by their socket identity: the newest hello for a worker
wins, and only that connection's acks count. A worker gets a version only when it asked for one
(a want or a probe) and the socket has sent its previous one; until then the newest version waits
here, replacing an older waiting one. So a slow or silent worker holds at most one delivery on its
way and one waiting, and when it asks again it gets the newest.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread
from wsync_core import Acked, Buffer, Deadline, Event, Joined, Left, SenderBase, SenderContext, TransportError
from wsync_core import forked
from wsync_core.forked import close_inherited
from wsync_core.transport import claim_refusal, index_refusal, origin_refusal

from .sockets import Sockets, close_all, configure, log, monitor_events, rest_of, wrap
from .wire import (ACK, BYE, CURRENT, HELLO, MAX_PEER_FRAME, NEWER, PROBE, REPLACED, WANT, decode_peer,
                   encode_delivery, encode_refusal)

__all__ = ["ZmqSender"]

#: payloads up to this many bytes are copied into their header's frame (a zero-copy frame costs
#: more: pyzmq hands it back through its collector thread; and one frame is one libzmq call)
_COPY_BELOW = 64 * 1024
#: messages read from peers per poll at most (so a flood cannot starve the caller)
_MAX_READS = 1000
_POLLIN = int(zmq.POLLIN)
_MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass(eq=False)
class _Peer:
    rid: bytes
    fd: int
    fits: bool  # the worker's schema has the sender's digest: send it the payload
    wants: bool = True  # it asked for a version and has not been sent one since (a hello asks)
    sending: int = 0  # zero-copy payloads sent on this connection that libzmq still holds


class _AllowList:
    """ZAP callback: accepts the listed CURVE client keys, logs every refusal."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = {k.encode() for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        log.warning("zmq sender refused a peer: CURVE client key %s is not in curve_allowed_clients",
                    key.decode(errors="replace"))
        return False


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a frame came in on (-1 when libzmq no longer knows it)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return -1


def _is_hello(frames: Sequence[Any], extra: int) -> bool:
    """Whether a message that did not decode was meant as a hello (one frame, kind HELLO)."""
    return not extra and len(frames) == 1 and bytes(memoryview(frames[0]).cast("B")[:1]) == HELLO


class ZmqSender(Sockets, SenderBase):
    """The base carries the lifecycle, the events and the buffer pool; this class the sockets,
    read and written in the caller's thread (``publish`` and ``poll``; the core serializes them)."""

    def __init__(self, options: dict, ctx: SenderContext) -> None:
        super().__init__("zmq sender", ctx)
        self._options = options
        self._context: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._poller = zmq.Poller()
        self._peers: dict[int, _Peer] = {}
        self._workers: dict[bytes, int] = {}  # routing id -> worker
        self._waiting: dict[int, tuple[Buffer, bytes]] = {}  # worker -> the newest version it has not asked for yet
        #: descriptor -> disconnect events still to come for connections no longer in ``_peers`` (each
        #: removed without its own event: a goodbye, a replacement); the next ones on that descriptor are
        #: theirs, not those of a newer connection the kernel gave the same number
        self._owed: dict[int, int] = {}
        self._local: int | str | None = None  # the TCP port or ipc path it listens on

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (after ``open``)."""
        return self._socket().getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, deadline: Deadline) -> None:
        opts = self._options
        self._poller = zmq.Poller()
        self._peers, self._workers, self._owed = {}, {}, {}  # (a sender opened again knows no one yet)
        self._context = zmq.Context()
        sock = self._sock = self._context.socket(zmq.ROUTER)
        configure(sock, opts, MAX_PEER_FRAME, rcvhwm=100, sndhwm=8, receives_payloads=False)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if opts["curve_server_key"]:
            sock.curve_server = True
            sock.curve_secretkey = opts["curve_server_secret"].encode()
            if opts["curve_allowed_clients"] is not None:
                self._auth = zmq.auth.thread.ThreadAuthenticator(self._context, log=log.getChild("zap"))
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowList(opts["curve_allowed_clients"]))
        self._monitor = sock.get_monitor_socket(_MONITORED)
        where = opts["bind"] or opts["address"]
        try:
            sock.bind(where)
        except zmq.ZMQError as exc:
            raise TransportError(f"zmq sender cannot bind {where}: {exc}; is another sender using this "
                                 f"address? pass address='tcp://HOST:PORT' with a free port") from exc
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        bound = self.endpoint
        self._local = int(bound.rsplit(":", 1)[1]) if bound.startswith("tcp://") else bound[len("ipc://"):]
        forked.watch(self)

    # -- sending ------------------------------------------------------------------------------
    prefix_publish = True  # a delivery sends ``buffer.payload``, the first ``used`` bytes

    def deliver(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        """Each worker gets ``buffer`` when it asks; until then it waits, held, replacing an older one."""
        self._read_monitor()  # before peers, as in poll: a connection's end is reported before a new hello
        self._read_peers()  # the wants that came in since the last poll
        for w in workers:
            if w not in self._peers:
                log.debug("zmq sender: worker %d is not connected; it gets the latest version when it joins", w)
                continue
            self.hold(buffer, w)
            self._forget(w)
            self._waiting[w] = (buffer, header)
            self._flush(w)

    def _forget(self, w: int) -> None:
        """Drop the version waiting for worker ``w``, if any."""
        older = self._waiting.pop(w, None)
        if older is not None:
            self.let_go(older[0], w)

    def _flush(self, w: int) -> None:
        """Send worker ``w`` its waiting version if it asked for one and its previous one left."""
        peer = self._peers.get(w)
        if peer is None or not peer.wants or peer.sending or w not in self._waiting:
            return
        buffer, header = self._waiting[w]
        sock = self._socket()
        try:
            sock.send(peer.rid, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            return  # its queue is full: it stays waiting
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._drop(w, "its connection is gone")
                return
            raise wrap(exc, f"sending to worker {w}") from exc
        del self._waiting[w]
        peer.wants = False
        payload = buffer.payload
        if not peer.fits or payload.numel() <= _COPY_BELOW:
            # small: one frame, header and a copy of the payload; a worker whose schema differs gets
            # the header alone, which lets its core name the mismatch
            # (numpy's stubs give an ndarray __buffer__ on Python 3.12+ only)
            message = encode_delivery(header, payload.numpy() if peer.fits else b"")  # type: ignore[arg-type]
            sock.send(message, copy=True)
            self.let_go(buffer, w)
            return
        sock.send(encode_delivery(header), zmq.SNDMORE)
        view = payload.numpy()  # libzmq holds it until the bytes left: then the buffer is free again
        with self.cond:
            peer.sending += 1
        weakref.finalize(view, self._sent, buffer, w, peer).atexit = False
        sock.send(view, copy=False)  # type: ignore[call-overload]  # (numpy's ndarray __buffer__, as above)

    def _sent(self, buffer: Buffer, w: int, peer: _Peer) -> None:
        """libzmq let go of a payload (from pyzmq's collector thread, or any thread)."""
        with self.cond:
            peer.sending -= 1
            self.let_go(buffer, w)

    # -- events -------------------------------------------------------------------------------
    def poll(self, deadline: Deadline) -> list[Event]:
        self.check_open()
        self._drain()
        while not self._events and not deadline.expired() and not self._woken:
            owed = any(self._peers[w].wants for w in self._waiting if w in self._peers)
            self._poller.poll(int(deadline.slice(0.02 if owed else 1.0) * 1000))
            self._drain()
        return super().poll(Deadline(0.0))

    def _drain(self) -> None:
        for w in list(self._waiting):
            self._flush(w)
        self._read_monitor()  # before peers: a connection's end is reported before a new hello
        self._read_peers()

    def _read_monitor(self) -> None:
        for event in monitor_events(self._monitor_socket()):
            kind = event["event"]
            log.debug("zmq sender: socket event %s (%s)", zmq.Event(kind).name, event["value"])
            if kind == zmq.EVENT_DISCONNECTED:
                fd = event["value"]
                if self._owed.get(fd):  # the end of a connection already let go of
                    self._owed[fd] -= 1
                    if not self._owed[fd]:
                        del self._owed[fd]
                    continue
                gone = [(w, peer.rid) for w, peer in self._peers.items() if peer.fd == fd]
                if gone:
                    self._read_peers()  # what it sent before it left (its last ack) counts first
                for w, rid in gone:
                    peer = self._peers.get(w)
                    if peer is not None and peer.rid == rid:  # (a new connection's hello keeps it)
                        self._drop(w, "its connection closed (peer exit, or no heartbeat within "
                                      f"{self._options['heartbeat']:g} s)", ended=True)
            else:
                log.warning("zmq sender refused a peer on %s: handshake failed (%s, errno %s)",
                            event["endpoint"].decode(errors="replace"), zmq.Event(kind).name, event["value"])

    def _read_peers(self) -> None:
        sock = self._socket()
        for _ in range(_MAX_READS):
            # (pyzmq's stubs give get() the type of any option's value: EVENTS' is an int)
            if not sock.get(zmq.EVENTS) & _POLLIN:  # type: ignore[operator]  # cheaper than raising zmq.Again
                return
            try:
                rid_frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid, fd = rid_frame.bytes, _source_fd(rid_frame)
            frames, extra = rest_of(sock, rid_frame, 1)
            try:
                msg = decode_peer(frames, extra)
            except TransportError as exc:
                log.warning("zmq sender ignored a message from peer %s: %s", rid.hex(), exc)
                if rid not in self._workers and _is_hello(frames, extra):  # a receiver waiting in connect(): tell it
                    self._tell(rid, encode_refusal(f"the sender cannot read its hello: {exc}"), f"peer {rid.hex()}")
                continue
            self._handle(rid, fd, msg)

    def _handle(self, rid: bytes, fd: int, msg) -> None:
        if msg.kind == HELLO:
            hello = msg.hello
            w = hello.worker
            why = index_refusal(w, self.ctx.num_workers) or origin_refusal(w, hello.origin, self.ctx.origin)
            if why is not None:
                log.warning("zmq sender refused a hello from peer %s: %s", rid.hex(), why)
                self._tell(rid, encode_refusal(why), f"peer {rid.hex()}")
                return
            old = self._peers.get(w)
            layout = self.ctx.layout
            fits = hello.digest == layout.digest and hello.nbytes == layout.nbytes and hello.model_id == self.ctx.model_id
            if old is not None and old.rid != rid and old.fits and not fits:
                why = claim_refusal(w, f"model {hello.model_id!r}, layout {hello.digest[:12]} of {hello.nbytes} bytes; "
                                       f"this sender's {self.ctx.model_id!r}, {layout.digest[:12]} of {layout.nbytes}")
                log.warning("zmq sender refused a hello from peer %s: %s", rid.hex(), why)
                self._tell(rid, encode_refusal(why), f"peer {rid.hex()}")
                return
            if old is not None and old.rid != rid:
                log.warning("zmq sender: worker %d announced itself from a new connection; the old one is "
                            "dropped", w)
                self._workers.pop(old.rid, None)
                self._owe(old.fd)
                self._tell(old.rid, REPLACED, f"worker {w}'s old connection")  # if a process still reads it
            stale = self._workers.get(rid)
            if stale is not None and stale != w:
                self._drop(stale, f"its connection now claims worker {w}", ended=True)  # (and lives on)
            self._forget(w)
            self._peers[w] = _Peer(rid, fd, fits)
            self._workers[rid] = w
            self.emit(Joined(w))
            return
        w = self._workers.get(rid)
        if w is None and msg.kind == BYE:  # (also after its connection's end was already seen)
            log.debug("zmq sender ignored a goodbye from peer %s, which is not a known worker", rid.hex())
        elif w is None:
            log.warning("zmq sender ignored an ack from peer %s, which has not said hello", rid.hex())
        elif msg.kind == ACK:  # an ack also asks for the next version
            self.emit(Acked(w, msg.data))
            self._peers[w].wants = True
            self._flush(w)
        elif msg.kind in (WANT, PROBE):
            self._peers[w].wants = True
            if msg.kind == PROBE:
                self._answer(w, NEWER if w in self._waiting else CURRENT, msg.seq)
            self._flush(w)
        elif msg.kind == BYE:
            self._drop(w, "receiver shut down")

    def _answer(self, w: int, kind: bytes, seq: bytes) -> None:
        """Tell worker ``w`` whether a newer version follows (NEWER) or not (CURRENT)."""
        self._tell(self._peers[w].rid, kind + seq, f"worker {w}")

    def _tell(self, rid: bytes, message: bytes, whom: str) -> None:
        """Send ``message`` to connection ``rid`` if its queue has room and it is still there."""
        try:
            self._socket().send_multipart([rid, message], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("zmq sender: the queue of %s is full; %r goes unsent", whom, message[:1])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise wrap(exc, f"writing to {whom}") from exc

    def _drop(self, w: int, reason: str, ended: bool = False) -> None:
        """Report worker ``w`` gone; unless ``ended`` (its connection's end was read, or the
        connection lives on as another worker), its disconnect event is still to come."""
        peer = self._peers.pop(w, None)
        if peer is not None:
            self._workers.pop(peer.rid, None)
            if not ended:
                self._owe(peer.fd)
        self._forget(w)
        self.emit(Left(w, reason))

    def _owe(self, fd: int) -> None:
        """A connection on ``fd`` was let go of before its disconnect event: skip that event."""
        if fd >= 0:
            self._owed[fd] = self._owed.get(fd, 0) + 1

    def forget_in_child(self) -> None:
        """A forked child never uses its parent's zmq sockets: it lets go of its copies of the
        listening and accepted ones, so the parent's address is free as soon as the parent closes."""
        local = self._local
        close_inherited(ports=[local] if isinstance(local, int) else [], paths=[local] if isinstance(local, str) else [])

    def stop(self) -> None:
        sock, monitor, context, auth = self._sock, self._monitor, self._context, self._auth
        self._sock = self._monitor = self._context = self._auth = None
        if context is not None:
            if sock is not None and monitor is not None:  # (start makes the monitor after the socket)
                sock.disable_monitor()
            if auth is not None:
                auth.stop()
            close_all(context, monitor, sock)
        self._waiting.clear()
        forked.unwatch(self)  # last: a child forked while it closed lets go of what was still open

