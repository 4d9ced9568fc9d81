"""Declared capabilities, each proved: ``auth`` and ``multi_host`` by tests the transport drives
through hooks it supplies on its ``TransportSuite`` subclass, ``zero_copy`` on the endpoints.

- ``auth_options(self, good: bool) -> dict``: with ``good=True``, options (merged over
  ``options``) for the sender and the receivers that authenticate; with ``good=False``, options
  that a peer without valid credentials uses (merged over the sender's own resolved options, so
  it reaches the same sender).
- ``multi_host_options(self, host_address: str) -> dict``: options (merged over ``options``)
  for a sender that listens on ``host_address``, the sender's address on a bridge to another
  network namespace (``wsync_conformance.netns``), where a receiver runs.

A transport that declares ``auth`` or ``multi_host`` without the hook fails the test, which
says what to supply.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
from wsync_core import Deadline, TransportError, WeightSyncScheme, WorkerTimeoutError
from wsync_core.transport import ZERO_COPY_MIN_BYTES

from .. import harness, netns, watchdog
from ..context import Context
from ..guarantees import capability, guarantee, violated
from ..models import build, digests, fill, many_spec, random_values, version_spec
from ..target import Target
from .base import SLACK_S, budget, transport_hook
from .endpoint import Endpoints

__all__ = ["CapabilityChecks"]


class CapabilityChecks:
    """Tests of the capabilities a transport declares (a mixin of ``TransportSuite``)."""

    @guarantee("safe")
    @capability("auth")
    @budget(short_timeouts=10)
    def test_capability_auth(self, wsync: Context) -> None:
        """A peer without valid credentials never joins, never gets a payload and never changes a
        model; authenticated workers are served as usual."""
        wsync.require("auth")
        hook = transport_hook(self, wsync, "auth_options", "auth", "(self, good: bool) -> dict",
                     "options for the sender and authenticated receivers (good=True) and for a peer without "
                     "valid credentials (good=False)")
        good, bad = dict(hook(True)), dict(hook(False))
        wsync.target = Target(wsync.target.transport, {**wsync.target.options, **good})
        wait = wsync.short_timeout * 3  # each wait below is waited out whole: the stranger never answers
        s = wsync.session(version_spec(), n=2, connect=False)
        t = s.scheme.transport
        stranger = WeightSyncScheme(type(t)(**{**t.options, **bad}), timeout=wait)
        s.workers[1].open(stranger, s.spec, wsync.device, 1)
        before = s.workers[1].snapshot()["digests"]
        s.fill(random_values(s.spec, 1))
        s.expected[0] = digests(s.model)
        s.workers[0].call_async("connect", timeout=wsync.timeout)
        s.workers[1].call_async("connect", timeout=wait)
        try:
            s.scheme.connect(timeout=wait)
        except WorkerTimeoutError as exc:
            if 1 not in exc.workers:
                raise violated("safe", f"connect() timed out for {exc.workers}, not for the unauthenticated peer") from exc
        else:
            raise violated("safe", "the sender's connect() completed with a peer that has no valid credentials")
        finally:
            replies = {i: s.workers[i].recv(wsync.timeout + SLACK_S, "answer to connect") for i in (0, 1)}
        replies[0].raise_for_error("the authenticated worker's connect()")
        if replies[1].error is None:
            raise violated("safe", f"a peer without valid credentials connected (version {replies[1].get('version')})")
        s.check(0, [0], guarantee="safe")
        s.fill(random_values(s.spec, 2))
        with s.following([0, 1]) as reports:
            try:
                s.scheme.send(timeout=wsync.short_timeout * 2)  # the authenticated worker is connected by now
            except WorkerTimeoutError as exc:
                if exc.workers != [1]:
                    raise violated("safe", f"send() names {exc.workers}, expected only the unauthenticated peer [1]") from exc
        if reports[1].get("applied"):
            raise violated("safe", f"the unauthenticated peer applied versions {reports[1]['applied']}")
        if s.workers[1].snapshot()["digests"] != before:
            raise violated("safe", "the unauthenticated peer's model changed")
        s.expected[1] = digests(s.model)
        s.check(1, [0], guarantee="safe")

    @guarantee("safe")
    @capability("auth")
    @budget(short_timeouts=6)
    def test_capability_auth_refuses_an_impostor_sender(self, wsync: Context) -> None:
        """A worker with valid credentials that reaches a sender without them (a guessed key, and
        no key at all) never connects, never applies its payload and keeps its model: a worker
        authenticates its sender too, or whoever takes the sender's address feeds it weights."""
        wsync.require("auth")
        hook = transport_hook(self, wsync, "auth_options", "auth", "(self, good: bool) -> dict",
                              "options for the sender and authenticated receivers (good=True) and for a peer "
                              "without valid credentials (good=False)")
        good, bad = dict(hook(True)), dict(hook(False))
        credentials = sorted(k for k in good if good[k] != bad.get(k))
        impostors = {"a sender with a guessed credential": {**good, **bad},
                     "a sender with no credential": {**good, **{k: None for k in credentials}}}
        wait = wsync.short_timeout * 2
        spec = version_spec()
        tried = []
        for what, options in impostors.items():
            try:
                impostor = WeightSyncScheme(Target(wsync.target.transport, {**wsync.target.options, **options}).make(),
                                            timeout=wait)
                model = build(spec)
                fill(model, random_values(spec, 7))
                impostor.init_on_sender(model=model, num_workers=1)  # resolves its address
            except (ValueError, TypeError):  # this transport cannot build such a sender: no such impostor
                continue
            tried.append(what)
            wsync.on_close(impostor.shutdown)
            t = impostor.transport
            worker = WeightSyncScheme(type(t)(**{**t.options, **good}), timeout=wait)
            w = wsync.workers(1)[0]
            w.open(worker, spec, wsync.device, 0)
            before = w.snapshot()["digests"]
            w.call_async("connect", timeout=wait)
            try:
                impostor.connect(timeout=wait)
            except (WorkerTimeoutError, TransportError):
                pass
            else:
                raise violated("safe", f"a worker with valid credentials connected to {what}")
            finally:
                reply = w.recv(wait + SLACK_S, "answer to connect()")
                impostor.shutdown()
            if reply.error is None:
                raise violated("safe", f"a worker with valid credentials took version {reply.get('version')} from "
                                       f"{what}: it must authenticate the sender, not only be authenticated by it")
            if w.snapshot()["digests"] != before:
                raise violated("safe", f"{what} changed the model of a worker with valid credentials")
        if not tried:
            pytest.skip(f"no sender could be built with auth_options(False) or without {credentials}")

    @guarantee("safe")
    @capability("auth")
    def test_capability_auth_secrets_never_shown(self, wsync: Context) -> None:
        """A transport that declares ``auth`` names its credentials in ``secret_options``, and
        neither ``repr`` of the transport nor of a scheme over it shows their values (they end up
        in logs, tracebacks and error reports)."""
        wsync.require("auth")
        hook = transport_hook(self, wsync, "auth_options", "auth", "(self, good: bool) -> dict",
                     "options for the sender and authenticated receivers (good=True) and for a peer without "
                     "valid credentials (good=False)")
        good, bad = dict(hook(True)), dict(hook(False))
        cls = wsync.target.cls
        secret = tuple(getattr(cls, "secret_options", ()))
        credentials = sorted(k for k in good if good[k] != bad.get(k))
        if not set(secret) & set(credentials):
            raise violated("safe", f"{cls.__name__} declares 'auth' but its secret_options {secret} names none of "
                                   f"the credentials that tell an authenticated peer from a stranger "
                                   f"({credentials}): repr() would show them")
        transport = Target(wsync.target.transport, {**wsync.target.options, **good}).make()
        scheme = WeightSyncScheme(transport)
        for key in secret:
            value = transport.options.get(key)
            if not isinstance(value, (str, bytes)) or len(value) < 4:
                continue
            shown = value if isinstance(value, str) else value.decode("latin-1")
            for what, text in (("repr(transport)", repr(transport)), ("repr(scheme)", repr(scheme))):
                if shown in text:
                    raise violated("safe", f"{what} shows the value of the secret option {key!r}")

    @guarantee("exact")
    @capability("multi_host")
    @budget(timeouts=2)
    def test_capability_multi_host(self, wsync: Context) -> None:
        """A receiver in another network namespace (another "host", joined by a bridge) connects
        to a sender listening on its bridge address and applies every version exactly. With the
        options a user gives across hosts, a CPU model's payloads are checksummed (``checksum``):
        TCP's own 16-bit checksum lets some damage through, which would be applied silently."""
        wsync.require("multi_host")
        hook = transport_hook(self, wsync, "multi_host_options", "multi_host", "(self, host_address: str) -> dict",
                     "options for a sender listening on host_address, reachable from another network namespace")
        if (reason := netns.available()) is not None:
            pytest.skip(f"multi_host is declared but cannot be tested here: {reason}")
        spec = version_spec()
        with netns.hosts(2, local=True) as (here, there), contextlib.ExitStack() as stack:
            # optional: a runtime the transport needs on every host (e.g. a Ray node on each), a
            # context manager given the hosts (this one first), yielding options merged over multi_host_options'
            setup = getattr(self, "multi_host_setup", None)
            with watchdog.paused():
                extra = dict(stack.enter_context(setup(here, there))) if setup is not None else {}
            target = Target(wsync.target.transport, {**wsync.target.options, **dict(hook(here.address)), **extra})
            if wsync.device == "cpu" and not (made := target.make()).checksum:
                raise violated("exact", f"across hosts ({made!r}), the transport does not checksum "
                                        f"payloads: damage that TCP's 16-bit checksum misses is applied silently; "
                                        f"a transport whose bytes cross a network checksums them by default")
            local = WeightSyncScheme(target.make(), timeout=wsync.timeout)
            local.init_on_sender(model=build(spec), num_workers=1)  # resolves the options receivers need
            copy = pickle.loads(pickle.dumps(local))
            local.shutdown()
            with watchdog.paused():
                started = [harness.Worker(kind="spawn", wait=False),
                           harness.Worker(kind="launched", prefix=there.prefix, wait=False)]
                for w in started:
                    w.wait_started()
            sender, receiver = started
            try:
                sender.open(copy, spec, wsync.device, 0, init=False)
                sender.call("init_on_sender", num_workers=1).raise_for_error("init_on_sender() in the sender runner")
                receiver.open(copy, spec, wsync.device, 0)
                expected = {0: sender.request("fill", seed=0).raise_for_error("fill")["digests"]}
                receiver.call_async("connect", timeout=wsync.timeout)
                sender.call("connect", timeout=wsync.timeout).raise_for_error("the sender's connect()")
                receiver.recv(wsync.timeout + SLACK_S).raise_for_error(f"the receiver's connect() from {there.name}")
                for v in (1, 2):
                    expected[v] = sender.request("fill", seed=v).raise_for_error("fill")["digests"]
                    receiver.follow()
                    try:
                        got = sender.call("send", timeout=wsync.timeout)
                    finally:
                        receiver.stop()
                    got.raise_for_error(f"send() of version {v} to a receiver on another host")
                    snap = receiver.snapshot()
                    if snap["version"] != v or snap["digests"] != expected[v]:
                        raise violated("exact", f"the receiver on another host holds version {snap['version']} "
                                                f"{'with other content' if snap['version'] == v else ''}, expected {v}")
            finally:
                for w in started:
                    w.exit()

    @guarantee("exact")
    @capability("zero_copy")
    def test_capability_zero_copy(self, wsync: Context) -> None:
        """For a CPU model of at least ZERO_COPY_MIN_BYTES, a receiver's delivery is the sender's
        buffer itself (a thread receiver) or memory shared with the sender (a process receiver):
        no other full copy in between."""
        wsync.require("zero_copy")
        if wsync.device != "cpu":
            pytest.skip("the zero-copy check runs on CPU models")
        e = Endpoints(wsync, 1, spec=many_spec("state_dict", ZERO_COPY_MIN_BYTES / (1 << 20) * 1.5, count=8))
        e.connect()
        buffer = e.publish(1, [0])
        deadline = Deadline(wsync.timeout)
        while not deadline.expired():
            reply = e.workers[0].request("ep_shared", wsync.timeout + SLACK_S, timeout=deadline.remaining(),
                                         pointer=buffer.tensor.data_ptr())
            reply.raise_for_error("recv() for the zero-copy check")
            if reply.get("version") == 1 or reply.get("version") is None:
                break
        if reply.get("version") != 1:
            raise violated("live", f"the receiver endpoint did not get version 1 ({reply})")
        if not reply.get("shared"):
            raise violated("exact", f"zero_copy is declared, but the delivery of a {e.nbytes}-byte payload is private "
                                    f"memory of the receiver ({reply.get('where')}): another full copy")
