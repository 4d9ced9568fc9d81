"""ordered: a call out of order raises StateError and never half-happens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wsync_core import Deadline, StateError, WeightSyncScheme

from .. import resources
from ..context import Context, RawSender, Session
from ..guarantees import guarantee, violated
from ..models import build, fill_version, version_spec
from .base import SLACK_S, budget

__all__ = ["OrderedChecks"]


class OrderedChecks:
    """The ordered tests (a mixin of ``TransportSuite``)."""

    @guarantee("ordered")
    def test_ordered_sender(self, wsync: Context) -> None:
        """Every out-of-order sender call raises StateError and changes nothing."""
        spec = version_spec()
        workers = wsync.workers(1)
        scheme = wsync.scheme()
        model = build(spec, wsync.sender_device)

        def expect(call: str, fn: Callable[[], Any]) -> None:
            state, version = scheme.state, scheme.version
            try:
                fn()
            except StateError as exc:
                if not str(exc):
                    raise violated("ordered", f"{call}: StateError without a message") from exc
            else:
                raise violated("ordered", f"{call} in state {state!r} did not raise StateError")
            if (scheme.state, scheme.version) != (state, version):
                raise violated("ordered", f"{call} raised but moved the scheme from {state!r} v{version} to "
                                          f"{scheme.state!r} v{scheme.version}")

        expect("send() before init", lambda: scheme.send())
        expect("send_async() before init", lambda: scheme.send_async())
        expect("connect() before init", lambda: scheme.connect(timeout=wsync.short_timeout))
        expect("receive() before init", lambda: scheme.receive())
        scheme.init_on_sender(model=model, num_workers=1)
        expect("send() before connect", lambda: scheme.send())
        expect("receive() on a sender", lambda: scheme.receive())
        expect("init_on_sender() twice", lambda: scheme.init_on_sender(model=model, num_workers=1))
        expect("init_on_receiver() on a sender", lambda: scheme.init_on_receiver(model=model, worker_idx=0))
        s = Session(wsync, spec, workers, scheme=scheme, model=model)
        wsync.on_close(s.close)
        s.connect()
        expect("connect() twice", lambda: scheme.connect(timeout=wsync.short_timeout))
        expect("init_on_sender() after connect", lambda: scheme.init_on_sender(model=model, num_workers=1))
        expect("receive() on a connected sender", lambda: scheme.receive())
        fill_version(model, 1)
        s.check(s.send(), guarantee="ordered")
        scheme.shutdown()
        scheme.shutdown()  # idempotent
        expect("send() after shutdown", lambda: scheme.send())
        expect("connect() after shutdown", lambda: scheme.connect(timeout=wsync.short_timeout))
        expect("init_on_sender() after shutdown", lambda: scheme.init_on_sender(model=model, num_workers=1))

    @guarantee("ordered")
    def test_ordered_receiver(self, wsync: Context) -> None:
        """Every out-of-order receiver call raises StateError and changes nothing."""
        s = wsync.session(version_spec(), n=1, connect=False)
        w = s.workers[0]
        w.open(s.scheme, s.spec, wsync.device, 0, init=False)

        def expect(call: str, method: str, **kw: Any) -> None:
            reply = w.call(method, **kw)
            if reply.error != "StateError":
                raise violated("ordered", f"receiver {call} gave {reply.error or 'no error'}, expected StateError")

        expect("receive() before init", "receive", timeout=0)
        expect("connect() before init", "connect", timeout=wsync.short_timeout)
        w.call("init_on_receiver").raise_for_error("init_on_receiver()")
        expect("receive() before connect", "receive", timeout=0)
        expect("init_on_receiver() twice", "init_on_receiver")
        expect("init_on_sender() on a receiver", "init_on_sender")
        s.connect()
        expect("connect() twice", "connect", timeout=wsync.short_timeout)
        expect("send() on a receiver", "send")
        expect("init_on_receiver() after connect", "init_on_receiver")
        fill_version(s.model, 1)
        s.check(s.send(), guarantee="ordered")  # still works after every refused call
        w.call("shutdown").raise_for_error("receiver shutdown()")
        expect("receive() after shutdown", "receive", timeout=0)

    @guarantee("ordered")
    def test_ordered_init_on_sender_takes_nothing(self, wsync: Context) -> None:
        """init_on_sender() only prepares: it starts no thread and opens no socket, file, shared
        memory or channel (a transport takes its resources in open(), at connect()). A sender
        built earlier holds nothing a trainer restarted on the same options needs, and one that
        is never connected leaves nothing behind."""
        spec = version_spec()

        def build_sender() -> WeightSyncScheme:
            scheme = WeightSyncScheme(wsync.target.make(), timeout=wsync.timeout)
            scheme.init_on_sender(model=build(spec), num_workers=1)
            return scheme

        build_sender().shutdown()  # warm-up: what the first use loads once is not taken by init
        before = resources.snapshot()
        scheme = build_sender()
        try:
            taken = resources.leaks(before, resources.snapshot())
        finally:
            scheme.shutdown()
        if taken:
            raise violated("ordered", "init_on_sender() alone took resources (before connect()):\n  "
                           + "\n  ".join(taken))

    @guarantee("ordered")
    @budget(short_timeouts=1)
    def test_ordered_init_does_not_connect(self, wsync: Context) -> None:
        """init_on_receiver() only prepares: the sender sees no worker join before its connect()
        (a transport takes its resources and announces itself in open(), not when built)."""
        spec = version_spec()
        raw = RawSender(wsync, spec, 1)
        (w,) = wsync.workers(1)
        w.open(WeightSyncScheme(raw.transport, timeout=wsync.timeout), spec, wsync.device, 0)
        deadline = Deadline(wsync.short_timeout)
        while not deadline.expired():
            raw._pump(deadline)
        if 0 in raw.joined:
            raise violated("ordered", "worker 0 joined after init_on_receiver() alone: building the receiver "
                                      "connected it before connect() was called")
        w.call_async("connect", timeout=wsync.timeout)
        raw.wait_joined([0])
        fill_version(raw.model, 1)
        raw.publish(raw.header(1), [0])
        w.recv(wsync.timeout + SLACK_S).raise_for_error("receiver connect() after init_on_receiver()")
