"""What crosses the store (events, control messages) and the links (bucketed broadcasts).

Receivers push events (join, ack, leave) onto one store queue the sender pops; the sender pushes
control messages onto each receiver's inbox queue, which the receiver handles in order:

- ``data`` (link, size, buckets, ``seq``): take part in a bucketed broadcast of the buffer
  contents numbered ``seq`` over the link (a process group of two ranks: the sender, rank 0, and
  this receiver, rank 1). If the core's header comes with it (the buffer was published
  before the broadcast began), deliver the bytes once all arrived; else wait for the commit.
  With no group it carries a header only (a receiver whose model does not fit), delivered at
  once so the core can reject it;
- ``commit`` (``seq``, the core's header): the bytes of ``seq`` are a published version: deliver
  them, if this receiver got all of them. Sent only after the sender's core published that
  buffer (as is a header inside ``data``), so a snapshot the core abandoned half-written is
  never delivered;
- ``abort`` (``seq``): drop the bytes of ``seq`` (the sender's core abandoned that snapshot);
- ``evict`` (the sender gave this receiver up: its link failed or its heartbeat went silent; the
  receiver joins again under a new inbox, so it gets the newest version once it is reachable);
- ``stop`` (wake up, the receiver is closing) and ``bye`` (the sender shut down);
- ``replaced`` (another receiver joined under this one's worker index and took its place: this
  one stops for good, instead of joining again and taking the index back);
- ``refused`` (the sender does not take this receiver's join: its worker index is out of range;
  the reason comes where a header would; this one stops for good).

Each receiver bumps its heartbeat counter in the store; the sender also sets an ``evict`` key for
an inbox it gave up, which the receiver's heartbeat thread reads (its receive thread may be stuck
in a broadcast on a link that was cut).

At each publish the sender writes, per worker, the ``seq`` of the newest version published to it
(``published_key``); a receiver whose ``receive()`` finds a version waiting reads it (the store
answers at once, even while the trainer's Python is busy) and waits for that version first.

Both directions are length-checked bytes and JSON; nothing is unpickled. Payload bytes travel
only through broadcasts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from wsync_core import Deadline, TransportError
from wsync_core.forked import socket_descriptors
from wsync_core.protocol import MAX_ACK_BYTES, decode_json

from .config import Config

if TYPE_CHECKING:
    # a link: what new_group makes, a ProcessGroupGloo or ProcessGroupNCCL, each a c10d Backend
    # (not a dist.ProcessGroup; dist.Backend is the class of backend names)
    from torch._C._distributed_c10d import Backend as Link

__all__ = [
    "EVENTS", "JOIN", "ACK", "LEAVE", "STOP", "MAX_EVENT_BYTES", "MAX_HEADER", "Control", "brief",
    "inbox_key", "heartbeat_key", "evict_key", "published_key", "encode_event", "decode_event", "from_inbox", "split_inbox", "encode_control", "decode_control",
    "POP_TIMEOUT", "listen", "connect", "clone", "watched", "abort", "settle", "new_group", "broadcast", "broadcast_part", "wait_works", "KINDS",
    "spans",
]

log = logging.getLogger("wsync.distributed")

EVENTS = "events"
JOIN, ACK, LEAVE, STOP = b"J", b"A", b"L", b"S"
MAX_EVENT_BYTES = 5 + 65 + MAX_ACK_BYTES  # (an ack: the inbox, a space, the core's ack)
#: the store refuses values much above 8 MiB, so headers (layouts of huge models) are capped here
MAX_CONTROL_BYTES = 8 * 1024 * 1024
MAX_HEADER = MAX_CONTROL_BYTES - 4 - 64 * 1024
#: how long a blocking queue pop waits before it simply tries again
POP_TIMEOUT = timedelta(hours=1)


def brief(exc: BaseException) -> str:
    """The first line of an error (torch appends C++ stack traces to some)."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def inbox_key(inbox: str) -> str:
    return f"inbox/{inbox}"


def published_key(worker: int) -> str:
    """The ``seq`` (decimal) of the newest version the sender published to ``worker``."""
    return f"pub/{worker}"


def heartbeat_key(worker: int) -> str:
    return f"hb/{worker}"


def evict_key(inbox: str) -> str:
    """Set by the sender once it gave up the receiver reading ``inbox``."""
    return f"evict/{inbox}"


def encode_event(kind: bytes, worker: int, data: bytes = b"") -> bytes:
    return kind + struct.pack(">I", worker) + data


def from_inbox(inbox: str, data: bytes) -> bytes:
    """An ack's or a goodbye's data, naming the inbox it comes from: the sender takes it only from
    the receiver that holds the worker index now (not one another receiver took it from)."""
    return inbox.encode() + b" " + data


def split_inbox(data: bytes) -> tuple[str, bytes]:
    """(inbox, data) of what ``from_inbox`` made; raises TransportError if it names no inbox."""
    inbox, space, rest = data.partition(b" ")
    if not space or not 0 < len(inbox) <= 64 or not inbox.isalnum():
        raise TransportError(f"an event that names no inbox: {data[:80]!r}")
    return inbox.decode(), rest


def decode_event(raw: bytes) -> tuple[bytes, int, bytes]:
    """(kind, worker, data) of an event; raises TransportError if it is malformed or too large."""
    if not isinstance(raw, bytes) or not 5 <= len(raw) <= MAX_EVENT_BYTES:
        raise TransportError(f"event of {len(raw) if isinstance(raw, bytes) else '?'} bytes; expected 5 to "
                             f"{MAX_EVENT_BYTES}")
    kind = raw[:1]
    if kind not in (JOIN, ACK, LEAVE, STOP):
        raise TransportError(f"unknown event kind {kind!r}")
    return kind, struct.unpack(">I", raw[1:5])[0], raw[5:]


#: the kinds of control message (see the module's docstring)
KINDS = ("data", "commit", "abort", "evict", "stop", "bye", "replaced", "refused")


@dataclass(frozen=True)
class Control:
    """One message to one receiver: for ``data``, which link broadcasts the bytes numbered ``seq``
    (None: header only) and their size; for ``commit``/``abort``, which bytes it is about."""

    group: str | None = None
    nbytes: int = 0
    bucket: int = 1
    kind: str = "data"
    seq: int = 0
    first: int = 0  # the first bucket's size (0: ``bucket``), so a stream can start sending early

    def spans(self) -> list[tuple[int, int]]:
        """The [start, end) byte ranges broadcast one by one (both sides cut the buffer alike)."""
        return spans(self.nbytes, self.bucket, self.first)


def spans(nbytes: int, bucket: int, first: int = 0) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``nbytes``: the first ``first`` bytes (if > 0), then ``bucket`` each."""
    out = []
    start = 0
    if 0 < first < nbytes:
        out.append((0, first))
        start = first
    for a in range(start, nbytes, bucket):
        out.append((a, min(a + bucket, nbytes)))
    return out


def encode_control(ctl: Control, header: bytes = b"") -> bytes:
    """The wire form of ``ctl`` followed by ``header`` (for ``commit`` and header-only ``data``)."""
    body = json.dumps({"k": ctl.kind, "g": ctl.group, "n": ctl.nbytes, "b": ctl.bucket, "s": ctl.seq,
                       "f": ctl.first}, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body + header


def decode_control(raw: bytes) -> tuple[Control, bytes]:
    """(control, header bytes); raises TransportError naming what is malformed."""
    if not isinstance(raw, bytes) or not 4 <= len(raw) <= MAX_CONTROL_BYTES:
        raise TransportError(f"control message of {len(raw) if isinstance(raw, bytes) else '?'} bytes")
    (n,) = struct.unpack(">I", raw[:4])
    if n > 64 * 1024 or 4 + n > len(raw):
        raise TransportError(f"control message claims a {n}-byte body")
    obj: Any = decode_json(raw[4:4 + n], "control message", 64 * 1024)
    try:
        ctl = Control(group=obj["g"], nbytes=obj["n"], bucket=obj["b"], kind=obj["k"], seq=obj["s"],
                      first=obj["f"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"malformed control message: {exc}") from None
    ok = (isinstance(ctl.kind, str) and ctl.kind in KINDS and (ctl.group is None or isinstance(ctl.group, str))
          and isinstance(ctl.seq, int) and not isinstance(ctl.seq, bool) and ctl.seq >= 0
          and isinstance(ctl.first, int) and not isinstance(ctl.first, bool) and ctl.first >= 0
          and isinstance(ctl.nbytes, int) and not isinstance(ctl.nbytes, bool) and ctl.nbytes >= 0
          and isinstance(ctl.bucket, int) and not isinstance(ctl.bucket, bool) and ctl.bucket > 0)
    if not ok:
        raise TransportError(f"malformed control message: {raw[4:4 + n][:200]!r}")
    return ctl, raw[4 + n:]


def listen(cfg: Config) -> tuple[dist.Store, socket.socket]:
    """Host the channel's store on ``cfg.host:cfg.port`` (that address only, not every interface)."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
        sock.listen(1024)
        store = dist.TCPStore(cfg.host, cfg.port, None, True, timedelta(seconds=cfg.timeout),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except (OSError, RuntimeError) as exc:
        sock.close()
        raise TransportError(f"distributed: cannot host the store at {cfg.host}:{cfg.port}: {brief(exc)} (each sender "
                             f"hosts a store of its own: another scheme of this job, or another job, listens there? "
                             f"give each scheme its own port=)") from exc
    return dist.PrefixStore(cfg.prefix, store), sock


def connect(cfg: Config, deadline: Deadline) -> dist.Store:
    """A client of the sender's store; retries until ``deadline``, then raises TransportError."""
    wait = max(deadline.remaining(), 0.05)
    try:
        store = dist.TCPStore(cfg.host, cfg.port, None, False, timedelta(seconds=min(wait, 86400.0)))
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"distributed: no sender store at {cfg.host}:{cfg.port} within {wait:g} s "
                             f"(is the sender connecting with the same host and port?): {brief(exc)}") from exc
    store.set_timeout(POP_TIMEOUT)
    return dist.PrefixStore(cfg.prefix, store)


def clone(store: dist.Store, timeout: timedelta = POP_TIMEOUT) -> dist.Store:
    """Another connection to the same store, for one more thread (a store client blocks while it
    waits); each of its calls waits at most ``timeout``. Raises RuntimeError if it cannot connect."""
    other = store.clone()  # type: ignore[attr-defined]  # (torch's stubs lack Store.clone)
    other.set_timeout(timeout)
    return other


_T = TypeVar("_T")


def watched(cfg: Config, make: Callable[[], _T]) -> _T:
    """``make()``, which opens clients of the sender's store, with their sockets set to fail once
    the link has been silent for about ``heartbeat_timeout`` (TCP keepalive, and TCP's user
    timeout for bytes left unacknowledged). A store call blocked on a cut link then raises instead
    of waiting for TCP to give up (many minutes; store timeouts bound waits for keys, not a dead
    socket), so a worker's threads end soon after it stops. (Another thread's new connection to
    the same store, opened meanwhile, is set the same way: no lock, so no connect waits on another.)"""
    before = socket_descriptors()  # (none without procfs: the sockets then keep TCP's own bounds)
    made = make()
    for fd in socket_descriptors() - before:
        _keep_alive(fd, cfg.port, cfg.heartbeat_timeout)
    return made


def _keep_alive(fd: int, port: int, seconds: float) -> None:
    """Make ``fd``, if it is a TCP connection to ``port``, fail after ``seconds`` of a silent link."""
    try:
        sock = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves the store's own
    except OSError:
        return
    with sock:
        try:
            if (sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6)
                    or sock.getpeername()[1] != port):
                return
            idle = max(1, round(seconds))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (idle + 3) * 1000)
        except OSError:
            return


def abort(group: Link | None) -> None:
    """Abort ``group`` (a link): its connections close, its pending works end with an error."""
    if group is None:
        return
    try:
        group.abort()
    except RuntimeError as exc:
        log.debug("distributed: aborting a link: %s", brief(exc))


def settle(works: Sequence[Any], timeout: float) -> None:
    """Wait (at most ``timeout`` s) until every work has ended, whether it failed or not: gloo may
    read or write a work's tensors until then. (Dropping the last reference to a work that has not
    ended waits for it too: an aborted link's works end at gloo's timeout, ``collective_timeout``.)"""
    end = time.monotonic() + timeout
    for work in works:
        while not work.is_completed() and time.monotonic() < end:
            time.sleep(0.005)


def new_group(cfg: Config, store: dist.Store, name: str, rank: int, size: int = 2) -> Link:
    """A private process group ``name`` of ``size`` ranks (a link: 2), rendezvous through ``store``;
    never the default group. Raises RuntimeError if a rank does not show up in time."""
    prefixed = dist.PrefixStore(f"pg/{name}/", store)
    timeout = timedelta(seconds=cfg.timeout)
    if cfg.backend == "gloo":  # connecting gets a shorter bound: a dead member must not stall set-up for long
        connect_s = min(cfg.timeout, max(5.0, 2 * cfg.heartbeat_timeout))
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (private: torch's stubs lack it)
        opts._timeout = timedelta(seconds=connect_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=cfg.bind) for _ in range(cfg.devices)]
        opts._threads = max(2, cfg.devices)
        group = dist.ProcessGroupGloo(prefixed, rank, size, opts)
        group._set_default_timeout(timeout)
        return group
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, size, opts)


def broadcast_part(group: Link, part: torch.Tensor) -> Any:
    """Start broadcasting ``part`` (a contiguous slice) from rank 0; returns the work handle."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([part], opts)  # type: ignore[attr-defined]  # (torch's stubs give a Backend no collectives)


def broadcast(group: Link, buffer: torch.Tensor, parts: Sequence[tuple[int, int]]) -> list[Any]:
    """Start broadcasting ``buffer`` from rank 0, one work per [start, end) range of ``parts``."""
    return [broadcast_part(group, buffer[start:end]) for start, end in parts]


def wait_works(works: Sequence[Any], deadline: Deadline, what: str, stop: Callable[[], bool],
               cuda: bool = False) -> None:
    """Wait for every work; raises TransportError on a failure, at ``deadline`` or once ``stop()``
    (the group is then unusable).

    Gloo works wake this thread from their completion callbacks (no polling delay); with ``cuda``
    (NCCL) works are polled, since only ``is_completed`` says the device has finished.
    """
    works = list(works)
    if not works:
        return
    if not cuda:
        _wait_callbacks(works, deadline, what, stop)
    pause = 0.0002
    for work in works:
        while not work.is_completed():
            if deadline.expired():
                raise TransportError(f"{what}: not finished within {deadline.timeout:g} s")
            if stop():
                raise TransportError(f"{what}: stopped, the endpoint is closing")
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        try:
            work.wait()
        except RuntimeError as exc:
            raise TransportError(f"{what}: {brief(exc)}") from exc


def _wait_callbacks(works: list[Any], deadline: Deadline, what: str, stop: Callable[[], bool]) -> None:
    """Block until every work's future has completed (successfully or not), the deadline or ``stop()``."""
    done = threading.Event()
    lock = threading.Lock()
    left = [len(works)]

    def finished(_: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    for work in works:
        work.get_future().add_done_callback(finished)
    while not done.wait(deadline.slice(0.05)):
        if deadline.expired():
            raise TransportError(f"{what}: not finished within {deadline.timeout:g} s")
        if stop():
            raise TransportError(f"{what}: stopped, the endpoint is closing")
