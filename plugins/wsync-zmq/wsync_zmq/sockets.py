"""What both endpoints do to their sockets: heartbeats, size bounds, CURVE, and a clean close."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.utils.garbage
from zmq.utils.monitor import recv_monitor_message
from wsync_core import TransportError

__all__ = ["log", "Sockets", "configure", "monitor_events", "rest_of", "close_all", "wrap"]

log = logging.getLogger("wsync.zmq")
_POLLIN = int(zmq.POLLIN)
#: a heartbeat timeout that never ends a connection (the largest ZMQ takes)
_NEVER_MS = 2**31 - 1
#: how long a connection may take over ZMTP's handshake: ``heartbeat``, within these bounds (ms)
_HANDSHAKE_MIN_MS, _HANDSHAKE_MAX_MS = 2000, 10000



class Sockets:
    """An endpoint's socket and its monitor, which ``start`` makes and ``stop`` closes (None before
    and after): the accessors are for calls made while the endpoint is open, as every caller checks."""

    _sock: zmq.Socket | None
    _monitor: zmq.Socket | None

    def _socket(self) -> zmq.Socket:
        sock = self._sock
        assert sock is not None
        return sock

    def _monitor_socket(self) -> zmq.Socket:
        monitor = self._monitor
        assert monitor is not None
        return monitor

def configure(sock: zmq.Socket, options: dict[str, Any], max_frame: int, rcvhwm: int, sndhwm: int, *,
              receives_payloads: bool) -> None:
    """Set linger, liveness checks (a silent peer's connection is closed: a cut link sends no
    reset), the largest frame accepted and the messages queued per peer each way.

    Both sides ping every ``heartbeat / 4`` seconds (at most 1 s), and give up a connection whose
    bytes stay unacknowledged for ``heartbeat`` seconds (TCP's user timeout). ZMQ's heartbeat
    timeouts count only whole messages as traffic, so only the sender, which the worker's pings
    reach while it writes a payload, times its peer out with them; the worker (``receives_payloads``)
    does not, and the sender's pings carry no time-to-live: either would close the connection in
    the middle of every payload that takes longer than ``heartbeat`` to cross (a large model on a
    slow link), and no version would ever arrive."""
    timeout_ms = max(100, int(math.ceil(options["heartbeat"] * 1000)))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, min(1000, max(50, timeout_ms // 4)))
    sock.setsockopt(zmq.TCP_MAXRT, timeout_ms)
    # a connection that has not finished ZMTP's handshake (its greeting, CURVE) by then is closed:
    # libzmq's 30 s let a local flood of silent connections hold every descriptor of the process
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(_HANDSHAKE_MIN_MS, min(timeout_ms, _HANDSHAKE_MAX_MS)))
    if receives_payloads:  # the sender's side times this worker out: its pings ask for it
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _NEVER_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(timeout_ms, 6_553_500) // 100 * 100)
    else:
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)


def monitor_events(monitor: zmq.Socket) -> list[Mapping[str, Any]]:
    """Every socket-monitor event waiting on ``monitor``, without blocking."""
    events: list[Mapping[str, Any]] = []
    # (pyzmq's stubs give get() the type of any option's value: EVENTS' is an int)
    while monitor.get(zmq.EVENTS) & _POLLIN:  # type: ignore[operator]  # (an int: no enum to build on this hot path)
        events.append(recv_monitor_message(monitor))
    return events


def rest_of(sock: zmq.Socket, first: zmq.Frame, keep: int) -> tuple[list[zmq.Frame], int]:
    """The frames of ``first``'s message after it: the first ``keep``, and how many more were discarded."""
    frames: list[zmq.Frame] = []
    extra, more = 0, first.more
    while more:
        part = sock.recv(copy=False)
        more = part.more
        if len(frames) < keep:
            frames.append(part)
        else:
            extra += 1
    return frames, extra


def wrap(exc: zmq.ZMQError, what: str) -> TransportError:
    """A TransportError saying what failed, for a native zmq error."""
    return TransportError(f"zmq transport: {what} failed: {exc} (errno {exc.errno})")


def close_all(context: zmq.Context | None, *sockets: zmq.Socket | None) -> None:
    """Close ``sockets`` (dropping unsent messages) and end ``context``; then, if no zero-copy
    frame is still held anywhere in this process, stop pyzmq's garbage-collector thread."""
    for sock in sockets:
        if sock is not None and not sock.closed:
            sock.close(linger=0)
    if context is not None:
        context.term()
    gc = zmq.utils.garbage.gc
    end = time.monotonic() + 1.0
    while gc.refs and time.monotonic() < end:  # frees of dropped frames reach the gc thread asynchronously
        time.sleep(0.005)
    if not gc.refs:
        gc.stop()

