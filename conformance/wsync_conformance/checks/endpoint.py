"""The transport interface itself, on its endpoints (``Transport.sender(ctx)``/``receiver(ctx)``,
no scheme): the rules of ``wsync_core.transport`` a transport keeps, each checked directly.

- what ``acquire`` may return: a ``Buffer`` of ``layout.nbytes`` bytes, never the last published
  one, never one a receiver still reads (also one a subset send skipped);
- what ``publish`` delivers: a buffer's first ``used`` bytes, exactly (with ``prefix_publish``);
- newest wins: a newer publish is never dropped in favour of an older queued one;
- ``Joined``/``Acked``/``Left``: Left when a receiver closes or its process dies;
- reconnect under the same index: a restarted worker is served;
- events in order for each worker: its acks before its Left, its Left before its new Joined;
- a sender whose workers keep up does not grow (resident memory);
- size checks: a payload of the wrong size never reaches the core as a valid delivery;
- deadlines: ``open``/``acquire``/``poll``/``recv`` return by their deadline, ``publish`` at once;
- ``close`` from any state: before open, after open, twice, mid-stream.

Receiver endpoints run in the harness's runners (their own processes for a process transport),
driven by JSON commands; payload digests are computed there by the suite (SHA-256).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from wsync_core import Buffer, Deadline, Layout, TransportError, WorkerTimeoutError
from wsync_core.layout import ALIGN
from wsync_core.protocol import MAX_ACK_BYTES, Ack, Header
from wsync_core.transport import Acked, Event, Joined, Left, SenderContext, SenderEndpoint
from wsync_core.weights import flatten

from .. import harness
from ..resources import busiest_threads, demand_by_thread, demand_s
from ..context import Context
from ..guarantees import GuaranteeViolation, capability, guarantee, violated
from ..models import ModelSpec, TensorSpec, build, version_spec
from .base import SLACK_S, budget
from .faults import rss_bytes

__all__ = ["EndpointChecks", "Endpoints"]


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` bytes that differ for every seed (a ramp offset by it)."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed * 31) % 251).to(torch.uint8)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


#: how soon a poll must return once wake() was called (seconds)
_WOKEN_S = 5.0
#: a wait of this many seconds with nothing to come may run (or wait to run: ``resources.demand_s``)
#: this long; a spinning one asks for the whole wait, however loaded the machine
_SPIN_WAIT_S, _SPIN_CPU_S = 1.0, 0.15
#: waits test_endpoint_waits_sleep measures at most of each kind: it fails only if every one asked
#: for more than ``_SPIN_CPU_S`` (a spinning wait does each time; another thread of a loaded
#: process, once)
_SPIN_TRIES = 2


class Endpoints:
    """A bare sender endpoint in this process and bare receiver endpoints in harness runners."""

    def __init__(self, wsync: Context, n: int, spec: ModelSpec | None = None) -> None:
        self.ctx = wsync
        self.spec = spec or version_spec(side=32)
        self.layout = Layout.of(flatten(build(self.spec)))
        self.nbytes = self.layout.nbytes
        self.transport = wsync.target.make()
        self.sender: SenderEndpoint = self.transport.sender(
            SenderContext(n, self.layout, "policy", torch.device(wsync.sender_device)))
        wsync.on_close(self.sender.close)
        self.blob = base64.b64encode(pickle.dumps(self.transport)).decode()  # after sender(): options may be resolved
        self.workers = wsync.workers(n)
        self.receiver_specs: dict[int, ModelSpec] = {}  # a worker's own model, where it differs from the sender's
        self.events: list[Event] = []
        self.log: list[Event] = []  # every event polled, in order (``events`` is pruned by wait_for)
        self.published: dict[int, str] = {}  # version -> payload digest
        self.last: Buffer | None = None

    # -- receivers -----------------------------------------------------------------------------
    def start_receiver(self, i: int, worker: harness.Worker | None = None, *, timeout: float | None = None,
                       opened: bool = True) -> None:
        w = worker or self.workers[i]
        w.send("ep_open", transport=self.blob, spec=self.receiver_specs.get(i, self.spec).to_json(), device=self.ctx.device, worker_idx=i,
               timeout=self.ctx.timeout if timeout is None else timeout, open=opened)

    def finish_receiver(self, i: int, worker: harness.Worker | None = None) -> harness.Reply:
        w = worker or self.workers[i]
        return w.recv(self.ctx.timeout + SLACK_S, "answer to the receiver endpoint's open()")

    def connect(self, workers: list[int] | None = None) -> None:
        """Open the receivers ``workers`` (default: all) and the sender together; wait for Joined."""
        idx = list(range(len(self.workers))) if workers is None else workers
        for i in idx:
            self.start_receiver(i)
        self.sender.open(Deadline(self.ctx.timeout))
        for i in idx:
            self.finish_receiver(i).raise_for_error(f"receiver endpoint {i}: open()")
        self.wait_for(lambda e: isinstance(e, Joined), idx, "Joined", pump=True)

    def recv(self, i: int, timeout: float, keep: bool = False, ack: bool = True) -> dict[str, Any]:
        """Receiver ``i``'s recv(); it acks what it gets (as the core does) unless ``ack=False``,
        and the sender keeps polling meanwhile (as the core's service thread does)."""
        w = self.workers[i]
        w.send("ep_recv", timeout=timeout, keep=keep, ack=ack)
        deadline = Deadline(timeout + SLACK_S + 30)
        while not w.conn.poll(0) and not deadline.expired():
            self.poll(0.02)
        reply = w.recv(deadline.remaining(), "answer to recv()")
        reply.raise_for_error(f"receiver endpoint {i}: recv()")
        return reply

    def recv_version(self, i: int, version: int) -> dict[str, Any]:
        """Receiver ``i``'s recv() until version ``version`` arrives, within the timeout: its
        delivery as ``recv`` describes it. Raises a ``live`` violation if it does not arrive."""
        got, d = None, None
        deadline = Deadline(self.ctx.timeout)
        while got != version and not deadline.expired():
            d = self.recv(i, deadline.slice(2.0))["delivery"]
            got = _version_of(d) if d is not None else got
        if got != version:
            raise violated("live", f"receiver endpoint {i} did not get version {version} within {self.ctx.timeout:g} s "
                                   f"(the last it got: {got})")
        assert d is not None  # (got is the version of the delivery that ended the loop)
        return d

    # -- the sender ----------------------------------------------------------------------------
    def header(self, version: int, nbytes: int | None = None) -> bytes:
        return Header(version, "policy", self.layout.digest, self.nbytes if nbytes is None else nbytes, None).encode()

    def publish(self, version: int, workers: list[int], used: int | None = None) -> Buffer:
        """acquire(), write version ``version``'s pattern over the whole buffer, publish its first
        ``used`` bytes (default: all); returns the buffer."""
        buffer = self.sender.acquire(Deadline(self.ctx.timeout))
        check_buffer(buffer, self.nbytes, self.last)
        data = _pattern(self.nbytes, version)
        buffer.tensor.copy_(data.to(buffer.tensor.device))
        buffer.used = self.nbytes if used is None else used
        self.published[version] = _sha(data[:buffer.used])
        self.sender.publish(buffer, self.header(version, buffer.used), workers)
        self.last = buffer
        return buffer

    def poll(self, timeout: float) -> list[Event]:
        t0 = time.monotonic()
        got = self.sender.poll(Deadline(timeout))
        took = time.monotonic() - t0
        if took > timeout + SLACK_S:
            raise violated("live", f"SenderEndpoint.poll(deadline of {timeout:g} s) returned after {took:.1f} s")
        self.events.extend(got)
        self.log.extend(got)
        return got

    def wait_for(self, match: Callable[[Event], bool], workers: list[int], what: str,
                 timeout: float | None = None, pump: bool = False) -> None:
        """Poll until an event ``match``-ing names each of ``workers``; raises under "live" if not.
        With ``pump`` those receivers keep calling recv() meanwhile (a receiver may announce itself
        from there, once its connection is up, as the core's connect() would let it)."""
        deadline = Deadline(self.ctx.timeout if timeout is None else timeout)
        seen: set[int] = set()
        pumping: set[int] = set()
        try:
            while True:
                seen |= {e.worker for e in self.events if match(e)}
                if set(workers) <= seen:
                    self.events = [e for e in self.events if not (match(e) and e.worker in workers)]
                    return
                if deadline.expired():
                    raise violated("live", f"the sender endpoint never reported {what} for workers "
                                           f"{sorted(set(workers) - seen)} within {deadline.timeout:g} s "
                                           f"(events seen: {self.events[-8:]})")
                if pump:
                    for i in set(workers) - seen - pumping:
                        self.workers[i].send("ep_recv", timeout=0.5, keep=False)
                        pumping.add(i)
                self.poll(deadline.slice(0.5))
                for i in list(pumping):
                    if self.workers[i].conn.poll(0):
                        self.workers[i].recv(1.0).raise_for_error(f"receiver endpoint {i}: recv()")
                        pumping.discard(i)
        finally:
            for i in pumping:
                self.workers[i].recv(SLACK_S + 30, "answer to recv()")


def check_buffer(buffer: Any, nbytes: int, last: Buffer | None) -> None:
    """What ``acquire`` returned: a ``Buffer`` whose tensor is contiguous uint8 of ``nbytes`` at an
    address that is a multiple of ``ALIGN``, not the last published one nor overlapping its memory."""
    if not isinstance(buffer, Buffer):
        raise violated("exact", f"acquire() returned {type(buffer).__name__}, expected a wsync_core.Buffer "
                                f"(transport interface 2)")
    tensor = buffer.tensor
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1 \
            or tensor.numel() != nbytes or not tensor.is_contiguous():
        raise violated("exact", f"acquire() returned a Buffer whose tensor is {type(tensor).__name__} "
                                f"{getattr(tensor, 'dtype', '')} {tuple(getattr(tensor, 'shape', ()))}, expected a "
                                f"contiguous uint8 tensor of {nbytes} bytes")
    if nbytes and tensor.data_ptr() % ALIGN:
        raise violated("exact", f"acquire() returned a Buffer at address {tensor.data_ptr():#x}, not a multiple of "
                                f"{ALIGN}: the core packs tensors at multiples of {ALIGN} bytes from its start, and a "
                                f"typed copy to a misaligned address can crash the process (the core refuses it)")
    if last is not None and buffer is last:
        raise violated("isolated", "acquire() returned the Buffer of the last publish: the core would overwrite a "
                                   "payload that receivers may still read")
    if last is not None and last.tensor.device == tensor.device and nbytes:
        a0, b0 = tensor.data_ptr(), last.tensor.data_ptr()
        if a0 < b0 + last.tensor.numel() and b0 < a0 + tensor.numel():
            raise violated("isolated", "acquire() returned the buffer of the last publish (or memory overlapping it): "
                                       "the core would overwrite a payload that receivers may still read")


def _resident() -> int | None:
    """This process's resident memory (``faults.rss_bytes``), after handing the C allocator's free
    memory back to the system where it can (glibc's ``malloc_trim``): what is counted is memory in
    use, not free memory an earlier temporary left resident (which a growing sender would fill
    first, unseen)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)
    return rss_bytes()


_malloc_trim: Any = None


def _version_of(delivery: dict[str, Any]) -> int:
    return Header.decode(base64.b64decode(delivery["header"])).version


#: subset sends that skip a worker holding one delivery with another waiting for it (more than
#: any small ring of buffers)
SUBSET_SENDS = 6
#: the memory check: model size (MiB), sends before the measure starts, sends measured, and the
#: growth allowed (model sizes: the sender's pool of buffers, 2 * num_workers + 2 at most, plus
#: allocator slack; a sender keeping every buffer grows by one model size per send)
MEMORY_MIB, MEMORY_WARMUP, MEMORY_SENDS, MEMORY_BOUND = 2.0, 6, 40, 10


def _no_left_after_joined(e: Endpoints, mark: int, what: str) -> None:
    """Raise under "live" if worker 0's events since ``e.log[mark]`` have a Left after their last Joined."""
    seq = [ev for ev in e.log[mark:] if ev.worker == 0 and not isinstance(ev, Acked)]
    last = max(k for k, ev in enumerate(seq) if isinstance(ev, Joined))
    if any(isinstance(ev, Left) for ev in seq[last:]):
        raise violated("live", f"{what}: the sender endpoint reported {_names(seq)}: a Left after the new Joined "
                               f"(the core takes the worker for gone, and every later send to it fails)")


def _receive(e: Endpoints, i: int, version: int, *, check: bool = True, keep: bool = False) -> dict[str, Any]:
    """Receiver ``i`` receives (releasing and acking each delivery; with ``keep``, holding the one
    of ``version``) until it gets ``version``; each delivery holds the bytes published under its
    header (``check``: else the caller checks ``version``'s). Raises under "live" if ``version``
    does not come within a timeout."""
    deadline = Deadline(e.ctx.timeout)
    got = None
    while not deadline.expired():
        d = e.recv(i, deadline.remaining(), keep=keep)["delivery"]
        if d is None:
            break
        got = _version_of(d)
        if (check or got != version) and d["digest"] != e.published.get(got):
            raise violated("isolated", f"worker {i}'s delivery of version {got} does not hold the bytes published "
                                       f"under it")
        if got == version:
            return d
        if keep:
            e.workers[i].request("ep_release").raise_for_error("ep_release")
    raise violated("live", f"receiver endpoint {i} got {got} instead of version {version} within {e.ctx.timeout:g} s")


class EndpointChecks:
    """The transport interface's rules, on the endpoints (a mixin of ``TransportSuite``)."""

    @guarantee("isolated")
    def test_endpoint_acquire_never_returns_a_buffer_in_use(self, wsync: Context) -> None:
        """Each acquire() returns a buffer that is neither the last one published nor one a
        receiver still holds: the receiver's held delivery keeps its bytes while the next version
        is written. Then (with subset_send) worker 0 keeps version 7 and leaves version 8 unread
        while six versions go to worker 1 alone: both still hold their own bytes (a ring of buffers
        that ignores who holds them hands one out again)."""
        e = Endpoints(wsync, 2)
        e.connect()
        held: dict[int, str] = {}
        for v in range(1, 7):
            e.publish(v, [0])  # acquire + write: the held delivery of v - 1 must not change
            if held:
                now = e.workers[0].request("ep_held").raise_for_error("ep_held")["digests"]
                if now != list(held.values()):
                    raise violated("isolated", f"writing version {v} into the buffer acquire() returned changed the "
                                               f"payload of version {list(held)} that the receiver still holds")
                e.workers[0].request("ep_release").raise_for_error("ep_release")
                held.clear()
            held[v] = _receive(e, 0, v, keep=True)["digest"]
        e.workers[0].request("ep_release").raise_for_error("ep_release")
        if not wsync.caps.subset_send:
            return
        # subset sends skip worker 0 while it holds version 7 and version 8 waits unread for it:
        # neither buffer may come back from acquire() for the versions that go to worker 1 alone
        e.publish(7, [0, 1])
        d = e.recv(0, wsync.timeout, keep=True)["delivery"]
        if d is None or _version_of(d) != 7 or d["digest"] != e.published[7]:
            raise violated("isolated", f"worker 0 did not get version 7 with its bytes: "
                                       f"{None if d is None else _version_of(d)}")
        _receive(e, 1, 7)
        e.publish(8, [0, 1])  # worker 0 leaves it unread
        _receive(e, 1, 8)
        for v in range(9, 9 + SUBSET_SENDS):
            e.publish(v, [1])
            _receive(e, 1, v)
        now = e.workers[0].request("ep_held").raise_for_error("ep_held")["digests"]
        if now != [e.published[7]]:
            raise violated("isolated", f"versions 9..{8 + SUBSET_SENDS} went to worker 1 alone and changed the payload "
                                       f"of version 7 that worker 0 still holds: acquire() returned its buffer")
        e.workers[0].request("ep_release").raise_for_error("ep_release")
        got = _receive(e, 0, 8, check=False)
        if got["digest"] != e.published[8]:
            raise violated("isolated", f"worker 0's delivery of version 8 (waiting unread while versions "
                                       f"9..{8 + SUBSET_SENDS} went to worker 1 alone) holds other bytes: acquire() "
                                       f"returned a buffer still on its way to a worker the subset sends skipped")

    @guarantee("exact")
    def test_endpoint_publish_delivers_used_bytes(self, wsync: Context) -> None:
        """With ``prefix_publish``, publish() delivers a Buffer's first ``used`` bytes, no more and no
        fewer: versions with used = half, a third, then all of the buffer (each written in full)
        arrive with that many bytes, those bytes."""
        e = Endpoints(wsync, 1)
        if not getattr(e.sender, "prefix_publish", False):
            pytest.skip("the sender endpoint does not set prefix_publish: the core always publishes whole buffers")
        e.connect()
        for v, used in ((1, max(1, e.nbytes // 2)), (2, max(1, e.nbytes // 3)), (3, e.nbytes)):
            e.publish(v, [0], used=used)
            d = e.recv_version(0, v)
            if d["size"] != used:
                raise violated("exact", f"publish() of a Buffer with used={used} of its {e.nbytes} bytes delivered "
                                        f"{d['size']} bytes: with prefix_publish it must deliver exactly the first "
                                        f"used bytes")
            if d["digest"] != e.published[v]:
                raise violated("exact", f"publish() of a Buffer with used={used} delivered {used} bytes that are not "
                                        f"its first {used} bytes")

    @guarantee("exact")
    def test_endpoint_a_large_payload_arrives_whole(self, wsync: Context) -> None:
        """The payload of a model of 20 MiB and 76 bytes (a size no chunk of a power of two divides, larger than
        the 16 MiB a transport's chunks or checksum blocks often hold) arrives byte for byte, twice
        (the second into buffers the first one used)."""
        spec = ModelSpec("state_dict", (TensorSpec("w", ((20 << 20) // 4 + 19,), "float32"),))
        e = Endpoints(wsync, 1, spec)
        e.connect()
        for v in (1, 2):
            e.publish(v, [0])
            d = e.recv_version(0, v)
            if d["size"] != e.nbytes or d["digest"] != e.published[v]:
                raise violated("exact", f"a payload of {e.nbytes} bytes arrived as {d['size']} bytes"
                                        + (" that differ from those published" if d["size"] == e.nbytes else ""))

    @guarantee("versioned")
    def test_endpoint_newest_wins(self, wsync: Context) -> None:
        """Five publishes to a receiver that is not reading: it gets deliveries in rising order,
        each with its own bytes, and the newest one always arrives (an older queued publish never
        displaces a newer one)."""
        e = Endpoints(wsync, 1)
        e.connect()
        for v in range(1, 6):
            e.publish(v, [0])
        got: list[int] = []
        deadline = Deadline(wsync.timeout)
        while (not got or got[-1] != 5) and not deadline.expired():
            d = e.recv(0, deadline.slice(2.0))["delivery"]
            if d is None:
                continue
            v = _version_of(d)
            if d["digest"] != e.published.get(v):
                raise violated("versioned", f"the delivery under version {v}'s header holds other bytes")
            got.append(v)
            if len(got) > 1 and got[-1] <= got[-2]:
                raise violated("versioned", f"deliveries came out of order: {got}")
        if not got or got[-1] != 5:
            raise violated("versioned", f"after publishes of versions 1..5 the receiver got only {got}: the newest "
                                        f"publish was dropped")

    @guarantee("targeted")
    def test_endpoint_five_workers(self, wsync: Context) -> None:
        """Five receivers (the other checks use at most three): all five join before the sender
        polls and each is reported, each gets a version sent to all and its ack is reported, and
        a version sent to workers 1 and 4 reaches them and no one else (a transport that keeps
        four of anything, mailboxes or queued events, fails here)."""
        n = 5
        e = Endpoints(wsync, n)
        e.connect()
        e.publish(1, list(range(n)))
        for i in range(n):
            e.recv_version(i, 1)
        e.wait_for(lambda ev: isinstance(ev, Acked) and _ack_version(ev.data) == 1, list(range(n)),
                   "the ack of version 1")
        targets = [1, 4]
        e.publish(2, targets)
        for i in sorted(set(range(n)) - set(targets)):
            d = e.recv(i, 0.2, ack=False)["delivery"]
            if d is not None and _version_of(d) == 2:
                raise violated("targeted", f"version 2 was published to workers {targets} only, but worker {i} "
                                           f"received it")
        for i in targets:
            d = e.recv_version(i, 2)
            if d["digest"] != e.published[2]:
                raise violated("exact", f"worker {i} got version 2 with other bytes")

    @guarantee("live")
    @budget(timeouts=2)
    @capability("processes")
    def test_endpoint_joined_acked_left(self, wsync: Context) -> None:
        """Joined when a receiver opens; Acked with exactly the bytes it sent; Left when it closes
        and (with the processes capability) when its process dies, by the time the sender has kept
        publishing to it for a timeout."""
        e = Endpoints(wsync, 2)
        e.connect()
        data = b'{"ack": "opaque bytes \\u00e9", "n": 1}'
        e.workers[0].request("ep_ack", data=base64.b64encode(data).decode()).raise_for_error("ack()")
        e.wait_for(lambda ev: isinstance(ev, Acked) and ev.data == data, [0], "Acked(0, <the bytes sent>)")
        bad = [ev for ev in e.events if isinstance(ev, Acked) and ev.data != data]
        if bad:
            raise violated("live", f"the sender saw {bad[0]!r}, not the bytes the receiver sent")
        e.workers[0].request("ep_close", 30.0).raise_for_error("receiver close()")
        e.wait_for(lambda ev: isinstance(ev, Left), [0], "Left after the receiver closed")
        if wsync.process:  # a transport may learn of a death only when it next sends there: it sends
            e.workers[1].kill()
            deadline = Deadline(wsync.timeout)
            for v in range(10, 10_000):
                e.publish(v, [1])
                try:
                    e.wait_for(lambda ev: isinstance(ev, Left), [1], "Left after the receiver's process died",
                               timeout=min(3.0, deadline.remaining()))
                    break
                except GuaranteeViolation:
                    if deadline.expired():
                        raise

    @guarantee("live")
    def test_endpoint_publish_skips_a_gone_worker(self, wsync: Context) -> None:
        """A target that closed since the sender last polled is no error of publish(): it returns,
        the live target gets the version, and the gone one is reported Left (a publish that raised
        would fail the send for everyone). One whose process died is published to in
        ``test_endpoint_joined_acked_left``."""
        e = Endpoints(wsync, 2)
        e.connect()
        e.workers[0].request("ep_close", 30.0).raise_for_error("receiver close()")
        try:
            e.publish(1, [0, 1])  # no poll since it went
        except Exception as exc:  # whatever it raised: the rule is that it raises nothing
            raise violated("live", f"publish() to workers [0, 1] raised {type(exc).__name__} ({exc}) after worker "
                                   f"0 closed: a target gone since the last poll is to be skipped and reported "
                                   f"Left, never an error of publish") from exc
        d = e.recv(1, wsync.timeout)["delivery"]
        if d is None or _version_of(d) != 1 or d["digest"] != e.published[1]:
            raise violated("live", f"worker 1 did not get version 1, published to it beside worker 0 that closed, "
                                   f"within {wsync.timeout:g} s")
        e.wait_for(lambda ev: isinstance(ev, Left), [0], "Left after the receiver closed")

    @guarantee("live")
    @budget(timeouts=2)
    @capability("late_join")
    def test_endpoint_reconnect_same_index(self, wsync: Context) -> None:
        """A worker that goes away (closes, or its process is killed) and comes back under the same
        index is seen to join again, is served, and its ack of what it got reaches the sender."""
        wsync.require("late_join")
        e = Endpoints(wsync, 1)
        e.connect()
        e.publish(1, [0])
        d = e.recv(0, wsync.timeout)["delivery"]
        if d is None or _version_of(d) != 1:
            raise violated("live", f"the receiver endpoint did not get version 1 ({d})")
        for how, version in (("closed", 2), ("killed", 3)):
            if how == "closed" or not wsync.process:
                e.workers[0].request("ep_close", 30.0).raise_for_error("receiver close()")
            else:
                e.workers[0].kill()
                e.workers[0] = wsync.workers(1)[0]
            e.events.clear()
            e.start_receiver(0)
            e.finish_receiver(0).raise_for_error(f"the restarted receiver endpoint 0 ({how}): open()")
            e.wait_for(lambda ev: isinstance(ev, Joined), [0], f"Joined for worker 0 back after it {how}", pump=True)
            e.publish(version, [0])
            got = None
            deadline = Deadline(wsync.timeout)
            while got != version and not deadline.expired():
                d = e.recv(0, deadline.slice(2.0))["delivery"]
                if d is not None:
                    got = _version_of(d)
                    if d["digest"] != e.published.get(got):
                        raise violated("live", f"the restarted worker got version {got} with other bytes")
            if got != version:
                raise violated("live", f"a worker restarted under the same index ({how}) was not served version "
                                       f"{version} (got {got})")
            e.wait_for(lambda ev: isinstance(ev, Acked) and _ack_version(ev.data) == version, [0],
                       f"the ack of version {version} from worker 0 back after it {how}")

    @guarantee("live")
    @budget(timeouts=3)
    def test_endpoint_events_in_order(self, wsync: Context) -> None:
        """Events come in the order they happened for each worker: two acks then a close (no poll
        in between) give Acked, Acked, Left, the acks unchanged and before the Left (an ack sent
        just before closing is not lost). With late_join, a close then a reopen under the same index
        give Left (or nothing) before the new Joined, never a Left after it (the core would take
        the worker back for gone: every later send to it fails); the worker back is served."""
        e = Endpoints(wsync, 1)
        e.connect()
        e.events.clear()
        acks = [b'{"order": 1}', b'{"order": 2}']
        mark = len(e.log)
        for data in acks:
            e.workers[0].request("ep_ack", data=base64.b64encode(data).decode()).raise_for_error("ack()")
        e.workers[0].request("ep_close", 30.0).raise_for_error("receiver close()")
        e.wait_for(lambda ev: isinstance(ev, Left), [0], "Left after the receiver acked twice and closed")
        seq = [ev for ev in e.log[mark:] if ev.worker == 0]
        left = next(k for k, ev in enumerate(seq) if isinstance(ev, Left))
        before = [ev.data for ev in seq[:left] if isinstance(ev, Acked)]
        if any(isinstance(ev, Acked) for ev in seq[left:]):
            raise violated("live", f"worker 0 acked twice, then closed: the sender endpoint reported its Left before "
                                   f"an ack ({_names(seq)}): a worker's acks come before its Left, in the order sent")
        if before != acks:
            raise violated("live", f"worker 0 acked {acks}, then closed: before its Left the sender endpoint reported "
                                   f"the acks {before} ({_names(seq)}): an ack sent just before closing is lost")
        if not wsync.caps.late_join:
            return
        e.start_receiver(0)
        e.finish_receiver(0).raise_for_error("the reopened receiver endpoint 0: open()")
        e.wait_for(lambda ev: isinstance(ev, Joined), [0], "Joined for worker 0 back after it closed", pump=True)
        mark = len(e.log)
        e.workers[0].request("ep_close", 30.0).raise_for_error("receiver close()")
        e.start_receiver(0)
        e.finish_receiver(0).raise_for_error("the reopened receiver endpoint 0: open()")
        e.wait_for(lambda ev: isinstance(ev, Joined), [0], "Joined for worker 0 closed and reopened at once",
                   pump=True)
        e.publish(1, [0])
        _receive(e, 0, 1)  # the sender polls meanwhile: a Left of the old connection would show by now
        e.poll(0.2)
        _no_left_after_joined(e, mark, "worker 0 closed and opened again under its index")
        # again, with a publish before any poll: the sender first meets the new connection in
        # publish(), and the old one's end after it (a transport that matched ends to
        # connections by descriptor took the new one, which the kernel had given the same number)
        mark = len(e.log)
        e.workers[0].request("ep_close", 30.0).raise_for_error("receiver close()")
        e.start_receiver(0)
        e.finish_receiver(0).raise_for_error("the reopened receiver endpoint 0: open()")
        # the receiver's own recv() (the sender does not poll meanwhile): it announces itself
        e.workers[0].request("ep_recv", 30.0, timeout=0.3, keep=False).raise_for_error("recv()")
        e.publish(2, [0])
        e.events.clear()
        e.wait_for(lambda ev: isinstance(ev, Joined), [0], "Joined for worker 0 back after a publish", pump=True)
        what = "worker 0 closed and opened again under its index, then the sender published before it polled"
        e.poll(0.2)
        _no_left_after_joined(e, mark, what)
        e.publish(3, [0])
        _receive(e, 0, 3)
        e.poll(0.2)
        _no_left_after_joined(e, mark, what)

    @guarantee("live")
    def test_endpoint_ack_then_close_while_publishing(self, wsync: Context) -> None:
        """A worker that acks and closes at once while the sender publishes to it still has its ack
        reported before its Left: once with a payload of 20 MiB being written to it (the close
        resets a connection with bytes unread, so the sender's next write fails), once with a
        publish to it after it closed and before the sender polled. A sender that drops a worker
        when a write fails, without reading what it sent first, loses the ack: the worker applied
        the version, and the send waiting for it fails."""
        spec = ModelSpec("state_dict", (TensorSpec("w", ((20 << 20) // 4,), "float32"),))
        for round_, first in enumerate(("a payload being written to it", "a publish after it closed")):
            e = Endpoints(wsync, 1, spec)
            e.connect()
            e.events.clear()
            mark = len(e.log)
            ack = json.dumps({"round": round_}).encode()
            if round_ == 0:
                e.publish(1, [0])
            e.workers[0].request("ep_close", 30.0, ack=base64.b64encode(ack).decode()).raise_for_error(
                "receiver ack() then close()")
            if round_ == 1:
                e.publish(1, [0])
            e.wait_for(lambda ev: isinstance(ev, Left), [0], f"Left after the receiver acked and closed ({first})")
            seq = [ev for ev in e.log[mark:] if ev.worker == 0]
            left = next(k for k, ev in enumerate(seq) if isinstance(ev, Left))
            if ack not in [ev.data for ev in seq[:left] if isinstance(ev, Acked)]:
                raise violated("live", f"worker 0 acked {ack!r} and closed at once, with {first}: the sender "
                                       f"endpoint reported {_names(seq)} without that ack before its Left: an ack "
                                       f"sent just before closing is lost when a write to the worker fails")
            e.sender.close()

    @guarantee("live")
    def test_endpoint_sender_memory_bounded(self, wsync: Context) -> None:
        """A sender whose worker keeps up does not grow: over 40 sends of a 2 MiB model, each
        received, released and acked, this process (the sender endpoint's, and the thread
        receiver's for a transport without processes) grows by at most 10 model sizes (a pool of
        buffers, 2 * num_workers + 2 at most, and allocator slack), measured as resident memory
        (the C allocator's free memory handed back first) from the 6th send on. A sender keeping
        every buffer until close grows by one model size per send, 80 MiB here."""
        numel = int(MEMORY_MIB * (1 << 20)) // 4
        e = Endpoints(wsync, 1, spec=ModelSpec("state_dict", (TensorSpec("w", (numel,), "float32"),)))
        e.connect()
        patterns = [_pattern(e.nbytes, seed) for seed in range(4)]
        digests = [_sha(p) for p in patterns]
        base = peak = None
        for v in range(1, 1 + MEMORY_WARMUP + MEMORY_SENDS):
            buffer = e.sender.acquire(Deadline(wsync.timeout))
            check_buffer(buffer, e.nbytes, e.last)
            buffer.tensor.copy_(patterns[v % len(patterns)].to(buffer.tensor.device))
            buffer.used = e.nbytes
            e.published[v] = digests[v % len(patterns)]
            e.sender.publish(buffer, e.header(v), [0])
            e.last = buffer
            _receive(e, 0, v)
            e.events.clear()
            now = _resident()
            if now is None:
                pytest.skip("resident memory is not known here (no /proc)")
            if v == MEMORY_WARMUP:
                base = peak = now
            elif peak is not None:  # (set with base)
                peak = max(peak, now)
        assert base is not None and peak is not None  # (set at the warm-up's last send, within the loop)
        grown = peak - base
        if os.environ.get("WSYNC_CONFORMANCE_DEBUG"):
            print(f"sender memory: grew {grown / e.nbytes:.2f} model sizes over {MEMORY_SENDS} sends")
        if grown > MEMORY_BOUND * e.nbytes:
            raise violated("live", f"over {MEMORY_SENDS} sends of a {e.nbytes >> 20} MiB model, each received and "
                                   f"acked by its worker, the sender process grew by {grown / (1 << 20):.0f} MiB "
                                   f"({grown / e.nbytes:.1f} model sizes, at most {MEMORY_BOUND} allowed): acquire() "
                                   f"must reuse or free the buffers workers are done with")

    @guarantee("exact")
    def test_endpoint_headers_and_acks_arrive_whole(self, wsync: Context) -> None:
        """Headers and acks are opaque bytes, carried byte for byte: headers of 64 KiB + 1 and 1 MiB
        + 3 bytes (a first header carries the sender's layout: 0.7 MiB for 4,600 tensors) and acks
        of 1 KiB + 1 and ``MAX_ACK_BYTES`` (a rejection quotes the worker's error, and a schema
        error names every key that differs). A transport may refuse headers larger than its
        worker's layout allows (zmq: 1 MiB and four times the layout's JSON), not smaller."""
        e = Endpoints(wsync, 1)
        e.connect()
        for size in (65_537, (1 << 20) + 3):
            header = (bytes(range(251)) * (size // 251 + 1))[:size]
            buffer = e.sender.acquire(Deadline(wsync.timeout))
            buffer.used = e.nbytes
            e.sender.publish(buffer, header, [0])
            e.last = buffer
            got = e.recv(0, wsync.timeout, ack=False)["delivery"]
            if got is None:
                raise violated("live", f"a delivery with a header of {size} bytes did not arrive within "
                                       f"{wsync.timeout:g} s")
            arrived = base64.b64decode(got["header"])
            if arrived != header:
                raise violated("exact", f"a header of {size} bytes arrived as {len(arrived)} bytes"
                                        + (", changed" if len(arrived) == size else "")
                                        + ": a header of up to 1 MiB and its worker's layout travels whole")
        for size in (1025, MAX_ACK_BYTES):
            data = (b"ack " + bytes(range(256)) * (size // 256 + 1))[:size]
            e.workers[0].request("ep_ack", data=base64.b64encode(data).decode()).raise_for_error(f"ack() of {size} bytes")
            e.wait_for(lambda ev: isinstance(ev, Acked), [0], f"Acked after an ack of {size} bytes")
            acked = [ev.data for ev in e.log if isinstance(ev, Acked) and ev.worker == 0][-1]
            if acked != data:
                raise violated("exact", f"an ack of {size} bytes arrived as {len(acked)} bytes"
                                        + (", changed" if len(acked) == size else "")
                                        + f": acks up to MAX_ACK_BYTES ({MAX_ACK_BYTES}) travel whole")

    @guarantee("safe")
    def test_endpoint_size_checks(self, wsync: Context) -> None:
        """Receivers whose model is larger (worker 0) or smaller (worker 1) than the sender's get
        the sender's payload: recv() refuses it, returns nothing, or returns it at the size it was
        sent, never as a delivery of the receiver's own size (the core would take it for valid)."""
        e = Endpoints(wsync, 2)
        sizes = {0: version_spec(side=33), 1: version_spec(side=31)}
        e.receiver_specs = sizes
        e.connect()
        e.publish(1, [0, 1])
        for i in sizes:  # both receivers wait for the payload at once
            e.workers[i].send("ep_recv", timeout=3.0, keep=False)
        for i, spec in sizes.items():
            mine = Layout.of(flatten(build(spec))).nbytes
            reply = e.workers[i].recv(3.0 + SLACK_S + 30, "answer to 'ep_recv'")
            if reply.error in ("TransportError", "SchemaMismatchError"):
                continue
            if reply.error:
                raise violated("safe", f"a payload of {e.nbytes} bytes for a {mine}-byte receiver: recv() raised "
                                       f"{reply.error}: {reply.get('message')}")
            d = reply["delivery"]
            if d is None:
                continue
            if d["size"] == mine:
                raise violated("safe", f"a payload of {e.nbytes} bytes came out of recv() as a delivery of the "
                                       f"receiver's own {mine} bytes: the core would apply it as valid")
            if d["size"] == e.nbytes and d["digest"] not in ("meta", e.published.get(_version_of(d))):
                raise violated("exact", "a payload delivered at its own size holds other bytes than were sent")

    @guarantee("live")
    @budget(short_timeouts=12)
    def test_endpoint_calls_honour_deadlines(self, wsync: Context) -> None:
        """open() without a peer, poll() and recv() with nothing to get, and acquire() while the
        receiver keeps its newest delivery return (or raise WorkerTimeoutError) by their deadline;
        publish() returns without waiting for the receiver."""
        short = wsync.short_timeout
        # a receiver endpoint whose sender never comes
        lonely = Endpoints(wsync, 1)
        t0 = time.monotonic()
        lonely.start_receiver(0, timeout=short)
        reply = lonely.finish_receiver(0)
        took = time.monotonic() - t0
        if took > short + SLACK_S:
            raise violated("live", f"ReceiverEndpoint.open(deadline of {short:g} s) without a sender took {took:.1f} s")
        if reply.error not in (None, "WorkerTimeoutError", "TransportError"):
            raise violated("live", f"ReceiverEndpoint.open() without a sender raised {reply.error}: "
                                   f"{reply.get('message')}")
        lonely.workers[0].close_session(30.0)
        e = Endpoints(wsync, 1)
        e.connect()
        if e.poll(short):
            e.events.clear()
        received = e.recv(0, short)
        if received["delivery"] is not None:
            raise violated("live", "recv() returned a delivery although nothing was published")
        if received["took"] > short + SLACK_S:
            raise violated("live", f"ReceiverEndpoint.recv(deadline of {short:g} s) took {received['took']:.1f} s")
        held: dict[int, str] = {}
        for v in range(1, 9):  # the receiver keeps deliveries: buffers may run out, acquire must still return
            t0 = time.monotonic()
            try:
                buffer = e.sender.acquire(Deadline(short))
            except WorkerTimeoutError:
                took = time.monotonic() - t0
                if took > short + SLACK_S:
                    raise violated("live", f"acquire(deadline of {short:g} s) raised after {took:.1f} s") from None
                break
            took = time.monotonic() - t0
            if took > short + SLACK_S:
                raise violated("live", f"SenderEndpoint.acquire(deadline of {short:g} s) took {took:.1f} s")
            check_buffer(buffer, e.nbytes, e.last)
            buffer.tensor.copy_(_pattern(e.nbytes, v).to(buffer.tensor.device))
            buffer.used = e.nbytes
            if held:
                now = e.workers[0].request("ep_held").raise_for_error("ep_held")["digests"]
                if now != list(held.values()):
                    raise violated("isolated", f"acquire() returned a buffer the receiver still holds (versions "
                                               f"{list(held)}): writing version {v} changed it")
            e.published[v] = _sha(_pattern(e.nbytes, v))
            t0 = time.monotonic()
            e.sender.publish(buffer, e.header(v), [0])
            took = time.monotonic() - t0
            if took > wsync.timeout:
                raise violated("live", f"SenderEndpoint.publish() took {took:.1f} s: it must not wait for receivers")
            e.last = buffer
            d = e.recv(0, wsync.timeout, keep=True)["delivery"]
            if d is None:
                raise violated("live", f"version {v} was published but recv() got nothing in {wsync.timeout} s")
            held[_version_of(d)] = d["digest"]
            if len(held) > 1:  # as the core: it keeps the delivery its model views once it applied the next
                e.workers[0].request("ep_release", keep_last=1).raise_for_error("ep_release")
                del held[min(held)]
        e.workers[0].request("ep_release").raise_for_error("ep_release")

    @guarantee("live")
    def test_endpoint_waits_sleep(self, wsync: Context) -> None:
        """A poll() or recv() with nothing to come waits without spinning: over a second of polls
        (called again whenever one returns early, as the core's waits do) the sender's process
        runs, or waits to run, at most ``_SPIN_CPU_S`` (``resources.demand_s``: a busy loop asks
        for the whole second however loaded the cores), and so does the receiver's over a recv()
        of a second. On shared cores a spinning wait takes the time workers and the trainer need.
        A second is measured again once if it asked for more (another thread of the process, not
        the wait's, may have been busy, on a loaded machine): it fails if both did, naming the
        threads that ran."""
        e = Endpoints(wsync, 1)
        e.connect()
        e.events.clear()
        for _ in range(_SPIN_TRIES):
            deadline = Deadline(_SPIN_WAIT_S)
            c0, threads0 = demand_s(), demand_by_thread()
            while not deadline.expired():
                e.sender.poll(Deadline(deadline.remaining()))
            cpu = demand_s() - c0
            if cpu <= _SPIN_CPU_S:
                break
        else:
            raise violated("live", f"{_SPIN_WAIT_S:g} s of SenderEndpoint.poll() with nothing to come ran or waited to "
                                   f"run {cpu:.2f} s (at most {_SPIN_CPU_S:g} allowed; measured {_SPIN_TRIES} times; "
                                   f"the threads that ran most: {busiest_threads(threads0, demand_by_thread())}): "
                                   f"poll must sleep until an event or its deadline, not spin or return early")
        for _ in range(_SPIN_TRIES):
            reply = e.workers[0].request("ep_recv", 30.0, timeout=_SPIN_WAIT_S, keep=False).raise_for_error("recv()")
            if reply["delivery"] is not None or reply.get("cpu", 0.0) <= _SPIN_CPU_S:
                break
        else:
            raise violated("live", f"a ReceiverEndpoint.recv() of {_SPIN_WAIT_S:g} s with nothing to come ran or waited "
                                   f"to run {reply['cpu']:.2f} s in the receiver's process (at most {_SPIN_CPU_S:g} "
                                   f"allowed; measured {_SPIN_TRIES} times; the threads that ran most: "
                                   f"{reply.get('busiest')}): recv must sleep until a delivery or its deadline, not spin")

    @guarantee("live")
    def test_endpoint_wake_ends_a_waiting_poll(self, wsync: Context) -> None:
        """wake() from another thread ends a poll() waiting there with nothing to come, and makes
        every later poll() return at once (the scheme is shutting down)."""
        e = Endpoints(wsync, 1)
        e.connect()
        e.events.clear()
        waiting = threading.Thread(target=e.sender.poll, args=(Deadline(30.0),), name="conformance-poll", daemon=True)
        waiting.start()
        time.sleep(0.1)  # it waits now
        e.sender.wake()
        waiting.join(_WOKEN_S)
        if waiting.is_alive():
            raise violated("live", f"SenderEndpoint.wake() from another thread did not end a poll(30 s) waiting "
                                   f"there within {_WOKEN_S:g} s: a shutdown() would wait out the core's poll")
        t0 = time.monotonic()
        e.sender.poll(Deadline(30.0))
        if time.monotonic() - t0 > _WOKEN_S:
            raise violated("live", "a poll(30 s) after wake() waited: after wake() every poll returns at once")

    @guarantee("live")
    def test_endpoint_expired_deadline_still_looks(self, wsync: Context) -> None:
        """recv() and poll() given an expired deadline (``Deadline(0.0)``) still return what has
        arrived: the core collects that way (``receive(timeout=0)`` in a polling worker, the
        sender's service thread between sends), so an endpoint that gives up without looking
        leaves a polling worker on its old version and acks unread."""
        e = Endpoints(wsync, 1)
        e.connect()
        e.events.clear()
        e.publish(1, [0])
        deadline = Deadline(wsync.timeout)
        while e.recv(0, 0.0, ack=False)["delivery"] is None:
            if deadline.expired():
                raise violated("live", f"version 1 was published, but recv(an expired deadline) returned None for "
                                       f"{wsync.timeout:g} s, called every 20 ms: an expired deadline must still "
                                       f"look once (the core's receive(timeout=0) calls it so)")
            time.sleep(0.02)
        data = b"an ack, read with an expired deadline"
        e.workers[0].request("ep_ack", data=base64.b64encode(data).decode()).raise_for_error("ep_ack")
        deadline = Deadline(wsync.timeout)
        while not any(isinstance(ev, Acked) and ev.data == data for ev in e.sender.poll(Deadline(0.0))):
            if deadline.expired():
                raise violated("live", f"worker 0 acked, but SenderEndpoint.poll(an expired deadline) returned no "
                                       f"Acked for {wsync.timeout:g} s, called every 20 ms: an expired deadline "
                                       f"must still look once (the core's service thread polls so between sends)")
            time.sleep(0.02)

    @guarantee("clean")
    def test_endpoint_close_from_any_state(self, wsync: Context) -> None:
        """close() works (returns, raises nothing) before open, after open, twice, and mid-stream:
        with a delivery held by the receiver, with the sender gone first, and after ready() without
        a publish."""
        layout = Layout.of(flatten(build(version_spec(side=32))))
        transport = wsync.target.make()
        ctx = SenderContext(1, layout, "policy", torch.device(wsync.sender_device))
        for label, endpoint in (("an unopened sender", transport.sender(ctx)),):
            _closes(label, endpoint.close)
            _closes(f"{label}, a second time", endpoint.close)
        e = Endpoints(wsync, 1)
        e.start_receiver(0, opened=False)
        e.finish_receiver(0).raise_for_error("receiver endpoint construction")
        reply = e.workers[0].request("ep_close", 60.0)
        if reply.error:
            raise violated("clean", f"close() of an unopened receiver endpoint raised {reply.error}: {reply.get('message')}")
        e.connect()
        e.publish(1, [0])
        d = e.recv(0, wsync.timeout, keep=True)["delivery"]
        if d is None:
            raise violated("live", "the receiver endpoint did not get version 1")
        if e.sender.stream_bytes > 0:
            buffer = e.sender.acquire(Deadline(wsync.timeout))
            e.sender.ready(buffer, min(e.nbytes, e.sender.stream_bytes), [0])
        _closes("the sender, while a receiver holds a delivery (and mid-stream for a streaming one)", e.sender.close)
        _closes("the sender, a second time", e.sender.close)
        reply = e.workers[0].request("ep_close", 60.0, keep=True)
        if reply.error:
            raise violated("clean", f"close() of a receiver holding a delivery, after its sender closed, raised "
                                    f"{reply.error}: {reply.get('message')}")


def _ack_version(data: bytes) -> int | None:
    """The version an ack names, or None for bytes that are no ack."""
    try:
        return Ack.decode(data).version
    except TransportError:
        return None


def _names(events: Sequence[Event]) -> str:
    return ", ".join(type(ev).__name__ for ev in events) or "nothing"


def _closes(label: str, close: Callable[[], None]) -> None:
    t0 = time.monotonic()
    try:
        close()
    except Exception as exc:  # reported as the violation it is
        raise violated("clean", f"close() of {label} raised {type(exc).__name__}: {exc}") from exc
    if time.monotonic() - t0 > SLACK_S:
        raise violated("clean", f"close() of {label} took {time.monotonic() - t0:.1f} s")
