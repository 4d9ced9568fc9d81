"""A worker's side: one DEALER socket connected to the sender, saying hello on every (re)connection.

The worker asks for each version (its hello, each ack, or a want when it waits with nothing
asked for), so at most one delivery waits here while the worker is away (beyond the one it is
reading). One that did wait is checked on the next ``recv`` with a probe: the sender answers with
anything newer it holds, and only the newest is returned.

Frames larger than this worker's model and a generous header bound together are refused by
libzmq before it allocates them; everything else is checked by ``wire.decode_delivery`` before
the core sees it. The payload tensor reads the received frame in place. A payload that came in
a frame of its own (a large one) is this worker's to keep: libzmq allocated that frame for it
alone, and nothing else reads or reuses it. It is handed over as adoptable, so the model's tensors
become views of it instead of copies (the frame lives as long as a tensor views it).
"""

from __future__ import annotations

import math

import zmq
from wsync_core import Deadline, Delivery, ReceiverBase, ReceiverContext, TransportError, Wakeup

from .sockets import Sockets, close_all, configure, log, monitor_events, rest_of, wrap
from .wire import (ACK, BYE, CURRENT, DATA, DELIVERY_HEAD, HELLO, NEWER, PROBE, REFUSED, REPLACED, WANT, Hello,
                   decode_answer, decode_delivery, decode_refusal, header_limit, payload_tensor)

__all__ = ["ZmqReceiver"]

_POLLIN = int(zmq.POLLIN)
_ANSWERS = (CURRENT[0], NEWER[0])
_MONITORED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
#: how long a closing receiver waits to say goodbye to a connected sender (milliseconds)
_BYE_LINGER_MS = 500
#: handshakes in a row that a sender this worker met before may cut short (it died or restarts
#: mid-handshake) before the worker takes it for a refusal
_CUT_HANDSHAKES = 3


def _first_byte(frame: zmq.Frame) -> int:
    """The first byte of a frame that is not empty."""
    # (pyzmq's stubs hide Frame's buffer behind its __getattr__: they type it as no buffer)
    return memoryview(frame).cast("B")[0]  # type: ignore[arg-type]


class ZmqReceiver(Sockets, ReceiverBase):
    """The base carries the lifecycle, ``wake`` and the newest-only mailbox; this class the socket,
    read in the caller's ``recv``, which ``put``s each delivery."""

    def __init__(self, options: dict, ctx: ReceiverContext) -> None:
        super().__init__(f"zmq receiver of worker {ctx.worker_idx}", ctx)
        self._options = options
        self._worker = ctx.worker_idx
        self._nbytes = ctx.layout.nbytes
        self._max_header = header_limit(ctx.layout)
        self._hello = Hello(ctx.worker_idx, ctx.model_id, ctx.layout.digest, ctx.layout.nbytes, ctx.origin).encode()
        self._context: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._connected = False
        self._wanted = False  # a want or probe is out and no delivery answered it yet
        self._probe = 0  # the number of the last probe sent
        self._answer: bytes | None = None  # to that probe: CURRENT, NEWER, then DATA once a delivery came
        self._wakeup = Wakeup()  # its eventfd, in the poller, ends a wait at once (the base keeps the flag)
        #: why the sender serves this connection no more (it took another one for this worker index,
        #: or refused this one's hello), raised by every call from then on
        self._told: str | None = None
        self._met = False  # a handshake with the sender succeeded once
        self._cut = 0  # handshakes cut short since the last one that succeeded

    def start(self, deadline: Deadline) -> None:
        opts = self._options
        self._poller = zmq.Poller()
        self._connected = self._wanted = False
        self._context = zmq.Context()
        sock = self._sock = self._context.socket(zmq.DEALER)
        configure(sock, opts, DELIVERY_HEAD + self._max_header + self._nbytes, rcvhwm=4, sndhwm=64,
                  receives_payloads=True)
        if opts["curve_server_key"]:
            sock.curve_serverkey = opts["curve_server_key"].encode()
            if opts["curve_client_key"]:
                public, secret = opts["curve_client_key"].encode(), opts["curve_client_secret"].encode()
            else:
                public, secret = zmq.curve_keypair()
            sock.curve_publickey, sock.curve_secretkey = public, secret
        self._monitor = sock.get_monitor_socket(_MONITORED)
        try:
            sock.connect(opts["address"])
        except zmq.ZMQError as exc:
            raise wrap(exc, f"worker {self._worker} connecting to {opts['address']}") from exc
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._wakeup.open(), zmq.POLLIN)

    def recv(self, deadline: Deadline) -> Delivery | None:
        self.check_open()
        if self._woken:
            return None
        self._check_told()
        self._pump()
        if self._mail is not None and self._connected and not deadline.expired():
            # it waited here while the worker was away: newer versions may wait at the sender; with
            # no time to ask (receive(timeout=0) at a safe point), what arrived is the answer
            self._probe += 1
            self._send(PROBE + str(self._probe).encode(), "probe")
            self._wanted, self._answer = True, None
            # until the deadline: a sender busy in Python (its GIL held) answers late, never wrongly
            self._wait(deadline, lambda: self._answer is not None)
            if self._answer == NEWER:  # on its way: wait for it
                self._wait(deadline, lambda: self._answer == DATA)
        else:
            self._wait(deadline, lambda: self._mail is not None)
        return super().recv(Deadline(0.0))

    def _wait(self, deadline: Deadline, done) -> None:
        """Read until ``done()``, the deadline or ``wake``."""
        while True:
            if done() or self._woken or deadline.expired():
                return
            if self._mail is None:  # about to block: make sure the sender knows this worker waits
                self._want()
            self._poller.poll(max(1, math.ceil(deadline.slice(1.0) * 1000)))
            self._pump()

    def _pump(self) -> None:
        """Read the monitor and every message waiting; the newest delivery replaces an older one."""
        self._read_monitor()
        while self._read():
            pass

    def _want(self) -> None:
        if self._connected and not self._wanted and self._sock is not None:
            self._send(WANT, "want")
            self._wanted = True

    def wake(self) -> None:
        super().wake()
        self._wakeup.set()

    def _read_monitor(self) -> None:
        for event in monitor_events(self._monitor_socket()):
            kind = event["event"]
            log.debug("worker %d: socket event %s", self._worker, zmq.Event(kind).name)
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = self._met = True
                self._cut = 0
                self._send(HELLO + self._hello, "hello")
                self._wanted = True  # a hello asks for the current version
            elif kind == zmq.EVENT_DISCONNECTED or (
                    kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._met and self._cut < _CUT_HANDSHAKES):
                if kind != zmq.EVENT_DISCONNECTED:  # a sender met before, going or coming back: not a refusal
                    self._cut += 1
                    log.info("worker %d: a handshake with %s was cut short; connecting again", self._worker,
                             self._options["address"])
                self._connected = False
                self._wanted = False
                self._reconnect()
            else:
                curve = " (is curve_server_key the sender's public key, and is this worker's key allowed?)" \
                    if self._options["curve_server_key"] else \
                    " (does the sender require CURVE? then give this worker curve_server_key=<its public key>)"
                raise TransportError(f"worker {self._worker}: the sender at {self._options['address']} refused "
                                     f"the connection: {zmq.Event(kind).name}{curve}")

    def _reconnect(self) -> None:
        """Connect afresh: libzmq gives up on a connection that broke its bounds (an oversized
        frame), and anything unread from a lost connection is sent again after the next hello."""
        address = self._options["address"]
        sock = self._socket()
        try:
            sock.disconnect(address)
        except zmq.ZMQError:
            pass  # libzmq already dropped the endpoint
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            raise wrap(exc, f"worker {self._worker} reconnecting to {address}") from exc

    def _read(self) -> bool:
        """Read one message if one waits; False if none did. Raises TransportError if it is malformed."""
        sock = self._socket()
        # (pyzmq's stubs give get() the type of any option's value: EVENTS' is an int)
        if not sock.get(zmq.EVENTS) & _POLLIN:  # type: ignore[operator]  # cheaper than raising zmq.Again
            return False
        try:
            first = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        rest, extra = rest_of(sock, first, 1)
        frames = [first, *rest]
        if len(frames) == 1 and len(first) == 1 and not extra and _first_byte(first) == REPLACED[0]:
            self._told = (f"another connection to the sender said hello as worker {self._worker} and took its place "
                          f"(a process started again under the same worker_idx while this one runs?); this one gets "
                          f"no more versions and keeps the one it holds")
            self._check_told()
        if len(frames) == 1 and len(first) and not extra and _first_byte(first) == REFUSED[0]:
            self._told = f"the sender refused it: {decode_refusal(first)}"
            self._check_told()
        if len(frames) == 1 and len(first) and _first_byte(first) in _ANSWERS:
            kind, seq = decode_answer(frames, extra)
            if seq == str(self._probe).encode() and self._answer is None:
                self._answer = kind
            return True
        self._wanted = False  # the sender spent this worker's want on it, even if it is malformed
        try:
            header, payload = decode_delivery(frames, extra, self._nbytes, self._max_header)
        except TransportError:
            self._want()  # no ack follows: ask for the next version now
            raise
        # a frame of its own (len(frames) == 2) is exclusively this worker's: the model may adopt it
        self.put(Delivery(header, payload_tensor(payload), adoptable=len(frames) == 2))
        self._answer = DATA
        return True

    def _check_told(self) -> None:
        if self._told is not None:
            raise TransportError(f"worker {self._worker}: {self._told}")

    def ack(self, data: bytes) -> None:
        """Send an ack, which also asks for the next version."""
        self.check_open()
        self._send(ACK + data, "ack")
        self._wanted = self._connected

    def _send(self, message: bytes, what: str) -> None:
        try:
            self._socket().send(message, zmq.NOBLOCK)
        except zmq.Again:
            raise TransportError(f"worker {self._worker} could not queue its {what}: the sender is not "
                                 f"reading (send queue full)") from None
        except zmq.ZMQError as exc:
            raise wrap(exc, f"worker {self._worker} sending its {what}") from exc

    def stop(self) -> None:
        sock, monitor, context = self._sock, self._monitor, self._context
        self._sock = self._monitor = self._context = None
        if self._wakeup.fd >= 0:
            self._poller.unregister(self._wakeup.fd)
            self._wakeup.close()
        if context is None:
            return
        if sock is not None and monitor is not None:  # (a start that failed before its monitor said no hello)
            try:
                self._read_monitor_quietly(monitor)
                if self._connected:
                    sock.send(BYE, zmq.NOBLOCK)
                    sock.setsockopt(zmq.LINGER, _BYE_LINGER_MS)
            except zmq.ZMQError as exc:
                log.debug("worker %d could not say goodbye: %s", self._worker, exc)
            sock.disable_monitor()
            if not sock.closed and self._connected:
                sock.close(linger=_BYE_LINGER_MS)
        close_all(context, monitor, sock)

    def _read_monitor_quietly(self, monitor: zmq.Socket) -> None:
        for event in monitor_events(monitor):
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._connected = False
