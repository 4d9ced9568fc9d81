"""The suite's working parts: a per-test ``Context`` (transport, device, timeouts, receiver
runners) and a ``Session`` (one sender scheme, its model, and connected receivers)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from wsync_core import Capabilities, Deadline, Layout, WeightSyncScheme, WorkerTimeoutError, WsyncError
from wsync_core.protocol import Ack, Header, checksum
from wsync_core.transport import Acked, Joined, SenderContext
from wsync_core.weights import flatten

from . import harness, watchdog
from .guarantees import violated
from .models import ModelSpec, build, digests, fill
from .target import Target

__all__ = ["Context", "Session", "RawSender", "classify", "raw_receiver", "expect_serving_after_hostile", "send_expect_timeout"]


def classify(got: dict[str, str], expected: dict[int, dict[str, str]]) -> tuple[str, Any]:
    """Which version(s) a model's digests belong to.

    Returns ("match", v) when every key holds version v; ("mixed", {key: [versions]}) when keys
    hold content of different known versions; ("unknown", [keys]) when some keys hold content
    of no known version (and the rest agree on one).
    """
    owners = {k: sorted(v for v, e in expected.items() if e.get(k) == d) for k, d in got.items()}
    unknown = sorted(k for k, vs in owners.items() if not vs)
    known = {k: vs for k, vs in owners.items() if vs}
    common = set.intersection(*(set(vs) for vs in known.values())) if known else set()
    if known and not common:
        return "mixed", known
    if unknown:
        return "unknown", unknown
    return "match", max(common) if common else None


class Context:
    """Everything one test needs; cleans up every scheme and runner it handed out."""

    def __init__(self, target: Target, device: str, timeout: float, short_timeout: float) -> None:
        self.target = target
        self.caps: Capabilities = target.capabilities
        self.device = device
        self.sender_device = device
        self.timeout = timeout
        self.short_timeout = short_timeout
        self.process = self.caps.processes
        self._workers: list[harness.Worker] = []
        self._closers: list[Any] = []

    # -- capabilities ------------------------------------------------------------------------
    def require(self, capability: str) -> None:
        """Skip the test, saying why, unless the transport declares ``capability``."""
        if not getattr(self.caps, capability):
            pytest.skip(f"transport {self.target.name!r} does not declare the {capability!r} capability")

    # -- building ----------------------------------------------------------------------------
    def scheme(self, *, sync: bool = True, timeout: float | None = None) -> WeightSyncScheme:
        s = WeightSyncScheme(self.target.make(), sync=sync, timeout=self.timeout if timeout is None else timeout)
        self.on_close(s.shutdown)
        return s

    def workers(self, n: int) -> list[harness.Worker]:
        """``n`` receiver runners (processes, or threads for a transport without ``processes``);
        the time spent starting them does not count against the test's budget."""
        with watchdog.paused():
            taken = harness.acquire(n, self.process)
        self._workers.extend(taken)
        return taken

    def session(self, spec: ModelSpec, n: int = 2, *, sync: bool = True, connect: bool = True, init: bool = True,
                workers: list[harness.Worker] | None = None, receiver_device: str | None = None) -> Session:
        """A sender of ``spec`` and ``n`` receivers (connected unless ``connect=False``; receivers
        call ``init_on_receiver`` unless ``init=False``). A connect that fails is a ``live``
        violation, whatever the test checks: the test never got to its own question."""
        s = Session(self, spec, workers or self.workers(n), sync=sync, receiver_device=receiver_device, init=init)
        self.on_close(s.close)
        if connect:
            try:
                s.connect()
            except (WsyncError, harness.HarnessError) as exc:
                raise violated("live", f"setting up: the sender and {len(s.workers)} receivers did not connect "
                                       f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]})") from exc
        return s

    def on_close(self, closer: Callable[[], Any]) -> None:
        """Call ``closer`` when the test ends (after the ones registered later), as for the schemes
        and sessions handed out here."""
        self._closers.append(closer)

    def close(self) -> None:
        """Shut down every scheme and endpoint; return the runners to the pool (kill them if the
        test hung: they may be stuck in the transport)."""
        errors = []
        try:
            for closer in reversed(self._closers):
                try:
                    closer()
                except Exception as exc:  # keep closing the rest; reported below
                    errors.append(exc)
        finally:
            self._closers.clear()
            dog = watchdog.current()
            if dog is not None and dog.fired:
                for w in self._workers:
                    w.kill()
            else:
                harness.release(self._workers)
            self._workers.clear()
        if errors:
            raise errors[0]


class Session:
    """One sender scheme over ``spec`` and its receivers; ``expected[v]`` holds the digests
    of every version sent."""

    def __init__(self, ctx: Context, spec: ModelSpec, workers: list[harness.Worker], *, sync: bool = True,
                 receiver_device: str | None = None, scheme: WeightSyncScheme | None = None, model=None,
                 init: bool = True) -> None:
        self.ctx = ctx
        self.spec = spec
        self.workers = workers
        if scheme is None:
            self.model = build(spec, ctx.sender_device, sender=True)
            self.scheme = ctx.scheme(sync=sync)
            self.scheme.init_on_sender(model=self.model, num_workers=len(workers))
        else:  # a scheme the caller already initialised as the sender of ``model``
            self.model, self.scheme = model, scheme
        self.expected: dict[int, dict[str, str]] = {}
        self.receiver_device = receiver_device or ctx.device
        for i, w in enumerate(workers):
            w.open(self.scheme, spec, self.receiver_device, i, init=init)
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def connect(self, workers: list[int] | None = None, timeout: float | None = None) -> None:
        """Connect the sender and the receivers ``workers`` (default: all) at the same time."""
        idx = range(len(self.workers)) if workers is None else workers
        self.expected[0] = digests(self.model)
        for i in idx:
            self.workers[i].call_async("connect", timeout=self.ctx.timeout if timeout is None else timeout)
        try:
            self.scheme.connect(timeout=timeout)
        finally:
            replies = {i: self.workers[i].recv(self.ctx.timeout + 60, "answer to connect") for i in idx}
        for i, r in replies.items():
            r.raise_for_error(f"worker {i}: connect()")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            if w.alive():
                with contextlib.suppress(harness.HarnessError):
                    w.close_session()
        self.scheme.shutdown()

    # -- sending -----------------------------------------------------------------------------
    def fill(self, values: dict[str, torch.Tensor]) -> None:
        fill(self.model, values)

    @contextlib.contextmanager
    def following(self, workers: list[int] | None = None, record: bool = False) -> Iterator[dict[int, harness.Reply]]:
        """Receivers ``workers`` (default: all) call receive() in a loop inside the block; on exit
        the dict yielded holds each one's report (versions applied, errors, records)."""
        idx = list(range(len(self.workers)) if workers is None else workers)
        for i in idx:
            self.workers[i].follow(record=record)
        out: dict[int, harness.Reply] = {}
        try:
            yield out
        except BaseException as exc:
            for i in idx:
                with contextlib.suppress(Exception):  # the error in flight is the one to report
                    out[i] = self.workers[i].stop()
            errs = {i: r.get("errors") for i, r in out.items() if r.get("errors")}
            if errs and hasattr(exc, "add_note"):
                exc.add_note(f"receiver errors while following: {json.dumps(errs)[:3000]}")
            raise
        for i in idx:
            out[i] = self.workers[i].stop()

    def send(self, *, worker_ids: list[int] | None = None, weights=None, timeout: float | None = None,
             follow: list[int] | None = None) -> int:
        """``scheme.send(...)`` while the targets (or ``follow``) receive; records the expected
        digests, then checks that every target holds exactly that version (the suite's own digests,
        computed in each receiver) and that every reference a receiver holds kept its values."""
        expected = digests(weights if weights is not None else self.model)
        targets = follow if follow is not None else (worker_ids if worker_ids is not None else None)
        with self.following(targets) as reports:
            if self.scheme.sync:
                v = self.scheme.send(weights=weights, worker_ids=worker_ids, timeout=timeout)
            else:  # the followers must not stop before they applied it
                v = self.scheme.send_async(weights=weights, worker_ids=worker_ids, timeout=timeout).wait(timeout)
            self.expected[v] = expected
        for i, r in reports.items():
            if r.get("errors"):
                raise AssertionError(f"worker {i} raised while receiving version {v}: {r['errors'][0]['error']}: "
                                     f"{r['errors'][0]['message']}")
        reached = list(range(len(self.workers))) if worker_ids is None else list(worker_ids)
        self.check(v, reached)
        self.check_held()
        return v

    def hold(self, workers: list[int] | None = None) -> None:
        """Receivers ``workers`` (default: all) keep a reference to each tensor of their model."""
        for i in range(len(self.workers)) if workers is None else workers:
            self.workers[i].hold()

    def check_held(self, workers: list[int] | None = None) -> None:
        """Every reference a receiver keeps holds a version that was sent: the model's current
        content while it still backs the model, else the values of the last version it backed
        (a slot is never written while a tensor that views it is alive)."""
        for i in range(len(self.workers)) if workers is None else workers:
            check_held(i, self.workers[i].held(), self.expected)
    def check(self, version: int, workers: list[int] | None = None, guarantee: str = "exact") -> None:
        """Every receiver in ``workers`` holds ``version`` and its exact content."""
        for i in range(len(self.workers)) if workers is None else workers:
            snap = self.workers[i].snapshot()
            if snap["version"] != version:
                raise violated("versioned", f"worker {i} reports version {snap['version']}, expected {version}")
            want = self.expected[version]
            bad = sorted(k for k in want if snap["digests"].get(k) != want[k])
            if bad:
                kind, detail = classify(snap["digests"], self.expected)
                if kind == "match" and detail is not None and detail > version:  # memory written under it
                    raise violated("isolated", f"worker {i} reports version {version} but holds version {detail}, "
                                               f"which it never applied: memory it views was written")
                if kind == "match":  # a whole other version: the report and the content disagree
                    raise violated("versioned", f"worker {i} reports version {version} but holds exactly version "
                                                f"{detail}")
                if kind == "mixed":
                    raise violated("atomic", f"worker {i} at version {version} holds a mix of versions: {detail}")
                raise violated(guarantee, f"worker {i} at version {version}: keys {bad} differ from the sender's "
                                          f"snapshot (content of no version sent in {detail})")


class RawSender:
    """A sender endpoint driven directly, to play a hostile or broken peer."""

    def __init__(self, ctx: Context, spec: ModelSpec, num_workers: int) -> None:
        self.ctx = ctx
        self.transport = ctx.target.make()
        self.model = build(spec, ctx.sender_device)
        self.layout = Layout.of(flatten(self.model))
        self.endpoint = self.transport.sender(SenderContext(num_workers, self.layout, "policy",
                                                            torch.device(ctx.sender_device)))
        self.endpoint.open(Deadline(ctx.timeout))
        ctx._closers.append(self.endpoint.close)
        self.acks: list[Ack] = []
        self.joined: set[int] = set()

    def header(self, version: int, **changes: Any) -> bytes:
        """A good header of ``version`` for the model as it is now (its checksums and seal too where the
        transport checksums, as the core's), with ``changes``."""
        sums = None
        if self.transport.checksum:
            payload = torch.empty(self.layout.nbytes, dtype=torch.uint8)
            self.layout.pack(flatten(self.model), payload)
            sums = checksum(payload)
        h = {"version": version, "model_id": "policy", "digest": self.layout.digest, "nbytes": self.layout.nbytes,
             "checksum": sums, "layout": json.loads(self.layout.to_json()), **changes}
        return Header(**h).encode(self.transport.checksum)

    def wait_joined(self, workers: list[int]) -> None:
        deadline = Deadline(self.ctx.timeout)
        while not set(workers) <= self.joined and not deadline.expired():
            self._pump(deadline)
        if not set(workers) <= self.joined:
            raise violated("live", f"workers {sorted(set(workers) - self.joined)} never joined within {deadline.timeout} s")

    def _pump(self, deadline: Deadline) -> None:
        for event in self.endpoint.poll(Deadline(deadline.slice(0.2))):
            if isinstance(event, Joined):
                self.joined.add(event.worker)
            elif isinstance(event, Acked):
                self.acks.append(Ack.decode(event.data, self.transport.checksum))

    def call(self, w: harness.Worker, method: str, **kwargs: Any) -> harness.Reply:
        """``w.call(method, **kwargs)`` while this sender polls its endpoint, as the core does while
        it waits for acks (a transport may answer a receiver's request only when polled)."""
        w.call_async(method, **kwargs)
        deadline = Deadline(float(kwargs.get("timeout") or 0.0) + 60.0)
        while not w.conn.poll(0) and not deadline.expired():
            self._pump(Deadline(0.02))
        return w.recv(deadline.remaining(), f"answer to {method!r}")

    def publish(self, header: bytes, workers: list[int]) -> None:
        """Publish the current model's bytes under ``header`` (any bytes at all)."""
        buffer = self.endpoint.acquire(Deadline(self.ctx.timeout))
        self.layout.pack(flatten(self.model), buffer.tensor)
        buffer.used = buffer.tensor.numel()
        self.endpoint.publish(buffer, header, workers)


def send_expect_timeout(session: Session, missing: list[int], **kw: Any) -> tuple[WorkerTimeoutError, float]:
    """Run ``session.scheme.send(**kw)`` that must raise WorkerTimeoutError; return it and the seconds taken."""
    t0 = time.monotonic()
    try:
        session.scheme.send(**kw)
    except WorkerTimeoutError as exc:
        return exc, time.monotonic() - t0
    raise violated("live", f"send() returned although workers {missing} never received")


def raw_receiver(wsync: Context) -> tuple[RawSender, harness.Worker, dict]:
    """One receiver connected to a raw sender (which can publish anything) and holding its version
    0; returns the sender, the receiver and the receiver's digests."""
    from wsync_core import WeightSyncScheme

    from .models import fill_version, version_spec

    spec = version_spec()
    raw = RawSender(wsync, spec, 1)
    (w,) = wsync.workers(1)
    w.open(WeightSyncScheme(raw.transport, timeout=wsync.timeout), spec, wsync.device, 0)
    w.call_async("connect", timeout=wsync.timeout)
    raw.wait_joined([0])
    fill_version(raw.model, 3)
    raw.publish(raw.header(0), [0])
    deadline = Deadline(wsync.timeout + 60)
    while not w.conn.poll(0) and not deadline.expired():
        raw._pump(Deadline(0.02))
    w.recv(deadline.remaining()).raise_for_error("receiver connect() to a raw sender")
    return raw, w, w.snapshot()["digests"]


def expect_serving_after_hostile(raw: RawSender, w: harness.Worker, wsync: Context) -> None:
    """After hostile headers, a good version 5 from ``raw`` must be applied by ``w`` (a hostile one
    still in flight may surface first, as TransportError); raises a ``safe`` violation otherwise."""
    from .models import fill_version

    fill_version(raw.model, 4)
    raw.publish(raw.header(5), [0])
    for _ in range(3):
        reply = raw.call(w, "receive", timeout=wsync.timeout)
        if reply.error != "TransportError":
            break
    if reply.get("result") != 5:
        raise violated("safe", f"after hostile headers a good delivery gave {reply.error or reply.get('result')}: "
                               f"{reply.get('message', '')}")


def check_held(worker: int, held: list[dict[str, Any]], expected: dict[int, dict[str, str]]) -> None:
    """Raise under "isolated" if a reference worker ``worker`` keeps (``Worker.held()``) and that
    no longer backs its model changed after the model moved on."""
    for hold in held:
        for key, (digest, backs, last) in hold["keys"].items():
            if backs or last not in expected or key not in expected[last]:
                continue
            if digest != expected[last][key]:
                owners = sorted(v for v, e in expected.items() if e.get(key) == digest)
                now = f"the content of version {owners}" if owners else "content of no version sent"
                raise violated("isolated", f"worker {worker}: a tensor it kept since version {hold['taken']} "
                                           f"({key!r}, last backing the model at version {last}) was written after "
                                           f"the model moved on: it now holds {now}")
