"""The trainer's side: one ROUTER socket; the snapshot goes out as a zero-copy frame to each worker.

Workers are known by their hello, not by their socket identity: the newest hello for a worker
wins, and only that connection's acks count. A worker gets a version only when it asked for one
(a want or a probe) and the socket has sent its previous one; until then the newest version waits
here, replacing an older waiting one. So a slow or silent worker holds at most one delivery on its
way and one waiting, and when it asks again it gets the newest.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq
import zmq.auth.thread
from wsync_core import Buffer, TransportError
from wsync_core.deadline import Deadline
from wsync_core.endpoints import EndpointBase
from wsync_core.forked import close_inherited
from wsync_core.transport import Acked, Event, Joined, Left, SenderContext, SenderEndpoint

from .sockets import close_all, configure, log, monitor_events, wrap
from .wire import ACK, BYE, CURRENT, DATA, HELLO, MAX_PEER_FRAME, NEWER, PROBE, WANT, decode_peer

__all__ = ["ZmqSender"]

#: payloads up to this many bytes are copied into their frame (tracking a zero-copy frame costs more)
_COPY_BELOW = 64 * 1024
#: messages read from peers per poll at most (so a flood cannot starve the caller)
_MAX_READS = 1000
_MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass(eq=False)
class _Slot(Buffer):
    """A buffer with the trackers of the zero-copy frames still sending it."""

    trackers: list[zmq.MessageTracker] = field(default_factory=list)

    def sending(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return bool(self.trackers)


@dataclass
class _Peer:
    rid: bytes
    fd: int
    fits: bool  # the worker's schema has the sender's digest: send it the payload
    wants: bool = False  # it asked for a version and has not been sent one since


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


class ZmqSender(EndpointBase, SenderEndpoint):
    """The base carries the lifecycle (``open``/``close`` once, a closed guard) and ``wake``."""

    def __init__(self, options: dict, ctx: SenderContext) -> None:
        super().__init__("zmq sender")
        self._options = options
        self._num_workers = ctx.num_workers
        self._nbytes = ctx.layout.nbytes
        self._digest = ctx.layout.digest
        self._context: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._poller = zmq.Poller()
        self._slots: list[_Slot] = []
        self._made = 0  # slots made so far (numbers them)
        self._latest: _Slot | None = None
        self._peers: dict[int, _Peer] = {}
        self._workers: dict[bytes, int] = {}  # routing id -> worker
        self._inflight: dict[int, zmq.MessageTracker] = {}
        self._waiting: dict[int, tuple[_Slot, bytes]] = {}
        self._events: list[Event] = []
        self._local: int | str | None = None  # the TCP port or ipc path it listens on

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (after ``open``)."""
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, deadline: Deadline) -> None:
        opts = self._options
        self._poller = zmq.Poller()
        self._context = zmq.Context()
        sock = self._sock = self._context.socket(zmq.ROUTER)
        configure(sock, opts, MAX_PEER_FRAME, rcvhwm=100, sndhwm=8)
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
        _live.add(self)

    # -- buffers ------------------------------------------------------------------------------
    def acquire(self, deadline: Deadline) -> Buffer:
        self.check_open()
        busy = {slot for slot, _ in self._waiting.values()}
        if self._latest is not None:
            busy.add(self._latest)
        free = [s for s in self._slots if s not in busy and not s.sending()]
        if free:
            for extra in free[1:]:  # keep one spare; the rest were only needed while peers lagged
                self._slots.remove(extra)
            return free[0]
        self._made += 1
        slot = _Slot(torch.empty(self._nbytes, dtype=torch.uint8), self._made)
        self._slots.append(slot)
        return slot

    #: publish() sends only the first ``buffer.used`` bytes (the core's deltas and wire dtypes)
    prefix_publish = True

    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        self.check_open()
        if not isinstance(buffer, _Slot):
            raise TransportError("zmq: publish() got a buffer that acquire() did not return")
        self._read_peers()  # the wants that came in since the last poll
        self._latest = buffer
        for w in workers:
            if w not in self._peers:
                log.debug("zmq sender: worker %d is not connected; it gets the latest version when it joins", w)
                continue
            self._waiting[w] = (buffer, header)  # replaces an older version waiting for it
            self._flush(w)

    def _flush(self, w: int) -> None:
        """Send worker ``w`` its waiting version if it asked for one and its previous one left."""
        peer = self._peers.get(w)
        tracker = self._inflight.get(w)
        if peer is None or not peer.wants or w not in self._waiting or tracker is not None and not tracker.done:
            return
        buffer, header = self._waiting.pop(w)
        self._send(w, buffer, header)

    def _send(self, w: int, slot: _Slot, header: bytes) -> None:
        peer = self._peers[w]
        sock = self._sock
        try:
            sock.send(peer.rid, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            self._waiting[w] = (slot, header)
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._drop(w, "its connection is gone")
                return
            raise wrap(exc, f"sending to worker {w}") from exc
        sock.send(DATA, zmq.SNDMORE)
        sock.send(header, zmq.SNDMORE)
        peer.wants = False
        buffer = slot.payload
        if peer.fits and buffer.numel() <= _COPY_BELOW:  # small: a copy is cheaper than tracking a frame
            sock.send(buffer.numpy(), copy=True)
            self._inflight.pop(w, None)
            return
        if peer.fits:
            frame = zmq.Frame(buffer.numpy(), copy=False, track=True)
        else:  # the worker's schema differs: the header alone lets its core name the mismatch
            frame = zmq.Frame(b"", copy=False, track=True)
        tracker = sock.send(frame, copy=False, track=True)
        del frame  # the frame's own reference would keep its tracker pending
        self._inflight[w] = tracker
        slot.trackers.append(tracker)

    # -- events -------------------------------------------------------------------------------
    def poll(self, deadline: Deadline) -> list[Event]:
        self.check_open()
        events = self._drain()
        while not events and not deadline.expired() and not self._woken:
            owed = any(self._peers[w].wants for w in self._waiting if w in self._peers)
            self._poller.poll(int(deadline.slice(0.02 if owed else 1.0) * 1000))
            events = self._drain()
        return events

    def _drain(self) -> list[Event]:
        for w in list(self._waiting):
            self._flush(w)
        self._read_monitor()  # before peers: a connection's end is reported before a new hello
        self._read_peers()
        events, self._events = self._events, []
        return events

    def _read_monitor(self) -> None:
        for event in monitor_events(self._monitor):
            kind = event["event"]
            log.debug("zmq sender: socket event %s (%s)", zmq.Event(kind).name, event["value"])
            if kind == zmq.EVENT_DISCONNECTED:
                gone = [(w, peer.rid) for w, peer in self._peers.items() if peer.fd == event["value"]]
                if gone:
                    self._read_peers()  # what it sent before it left (its last ack) counts first
                for w, rid in gone:
                    peer = self._peers.get(w)
                    if peer is not None and peer.rid == rid:  # (a new connection's hello keeps it)
                        self._drop(w, "its connection closed (peer exit, or no heartbeat within "
                                      f"{self._options['heartbeat']:g} s)")
            else:
                log.warning("zmq sender refused a peer on %s: handshake failed (%s, errno %s)",
                            event["endpoint"].decode(errors="replace"), zmq.Event(kind).name, event["value"])

    def _read_peers(self) -> None:
        sock = self._sock
        for _ in range(_MAX_READS):
            try:
                rid_frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid, fd = rid_frame.bytes, _source_fd(rid_frame)
            frames: list[bytes] = []
            extra = 0
            more = rid_frame.more
            while more:
                part = sock.recv(copy=False)
                more = part.more
                if len(frames) < 3:
                    frames.append(part.bytes)
                else:
                    extra += 1
            try:
                msg = decode_peer(frames, extra)
            except TransportError as exc:
                log.warning("zmq sender ignored a message from peer %s: %s", rid.hex(), exc)
                continue
            self._handle(rid, fd, msg)

    def _handle(self, rid: bytes, fd: int, msg) -> None:
        if msg.kind == HELLO:
            hello = msg.hello
            w = hello.worker
            if not w < self._num_workers:
                log.warning("zmq sender ignored a hello from peer %s claiming worker %d (num_workers=%d)",
                            rid.hex(), w, self._num_workers)
                return
            old = self._peers.get(w)
            if old is not None and old.rid != rid:
                log.warning("zmq sender: worker %d announced itself from a new connection; the old one is "
                            "dropped", w)
                self._workers.pop(old.rid, None)
            stale = self._workers.get(rid)
            if stale is not None and stale != w:
                self._drop(stale, f"its connection now claims worker {w}")
            self._inflight.pop(w, None)
            self._waiting.pop(w, None)
            # a hello asks for the current version
            self._peers[w] = _Peer(rid, fd, hello.digest == self._digest and hello.nbytes == self._nbytes, True)
            self._workers[rid] = w
            self._events.append(Joined(w))
            return
        w = self._workers.get(rid)
        if w is None and msg.kind == BYE:  # (also after its connection's end was already seen)
            log.debug("zmq sender ignored a goodbye from peer %s, which is not a known worker", rid.hex())
        elif w is None:
            log.warning("zmq sender ignored an ack from peer %s, which has not said hello", rid.hex())
        elif msg.kind == ACK:  # an ack also asks for the next version
            self._events.append(Acked(w, msg.data))
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
        try:
            self._sock.send_multipart([self._peers[w].rid, kind, seq], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("zmq sender: worker %d's queue is full; its probe goes unanswered", w)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise wrap(exc, f"answering worker {w}") from exc

    def _drop(self, w: int, reason: str) -> None:
        peer = self._peers.pop(w, None)
        if peer is not None:
            self._workers.pop(peer.rid, None)
        self._inflight.pop(w, None)
        self._waiting.pop(w, None)
        self._events.append(Left(w, reason))

    def stop(self) -> None:
        _live.discard(self)
        sock, monitor, context, auth = self._sock, self._monitor, self._context, self._auth
        self._sock = self._monitor = self._context = self._auth = None
        if context is None:
            return
        if monitor is not None:
            sock.disable_monitor()
        if auth is not None:
            auth.stop()
        close_all(context, monitor, sock)
        self._slots.clear()
        self._latest = None
        self._waiting.clear()
        self._inflight.clear()


_live: weakref.WeakSet[ZmqSender] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child never uses its parent's zmq sockets: it lets go of its copies of their
    listening and accepted sockets, so the parent's address is free as soon as the parent closes."""
    local = [s._local for s in list(_live) if s._local is not None]
    _live.clear()
    close_inherited(ports=[p for p in local if isinstance(p, int)], paths=[p for p in local if isinstance(p, str)])


os.register_at_fork(after_in_child=_after_fork_in_child)
