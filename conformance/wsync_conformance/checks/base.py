"""What every check mixin relies on: the transport under test, its timeouts, and the per-test
``wsync`` fixture (a ``Context``) under a budget."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from wsync_core import Transport, WorkerTimeoutError

from .. import harness
from ..context import Context
from ..guarantees import violated
from ..models import digests, fill_version
from ..target import Target
from ..watchdog import Watchdog

__all__ = ["SuiteBase", "SLACK_S", "BUDGET_SLACK_S", "option", "budget", "thorough", "expect_connect_refused",
           "transport_hook"]

#: slack on top of a timeout before a call counts as not honouring it (the machine may be busy)
SLACK_S = 20.0
#: a test's budget: the timeouts it waits out (``budget(...)``) plus this much for its work
#: (``WSYNC_CONFORMANCE_WORK`` seconds: a run that expects hangs can find them sooner)
BUDGET_SLACK_S = float(os.environ.get("WSYNC_CONFORMANCE_WORK", "30"))
#: how much longer tests may take with ``--thorough`` (more examples, longer state machines)
THOROUGH_FACTOR = 10.0


def expect_connect_refused(worker: Any, timeout: float, what: str) -> None:
    """Call ``connect(timeout)`` on a worker whose sender will not have it (none there, or a
    static group that cannot admit it): it must raise WorkerTimeoutError or TransportError within
    the timeout (plus SLACK_S). Raises a ``live`` violation naming ``what`` otherwise."""
    t0 = time.monotonic()
    reply = worker.call("connect", timeout=timeout)
    took = time.monotonic() - t0
    if reply.error not in ("WorkerTimeoutError", "TransportError"):
        raise violated("live", f"{what}: connect(timeout={timeout:g}) gave {reply.error or 'success'}, "
                               f"expected WorkerTimeoutError or TransportError")
    if took > timeout + SLACK_S:
        raise violated("live", f"{what}: connect(timeout={timeout:g}) took {took:.1f} s")


def transport_hook(suite: Any, wsync: Context, name: str, capability_name: str, signature: str,
                   what: str) -> Callable[..., Any]:
    """The hook ``name`` a declared capability needs: from the suite, else a static method of the
    transport class; fails the test naming the hook and its signature if neither supplies it."""
    hook = getattr(suite, name, None) or getattr(wsync.target.cls, name, None)
    if hook is None:
        pytest.fail(f"transport declares the {capability_name!r} capability but its TransportSuite subclass does not "
                    f"supply `{name}{signature}` (nor the transport class, as a static method): {what} (see "
                    f"docs/conformance.md, 'Capabilities')", pytrace=False)
    return hook


def budget(seconds: float = 0.0, timeouts: float = 0.0, short_timeouts: float = 0.0) -> pytest.MarkDecorator:
    """Mark a test as waiting out ``seconds`` plus ``timeouts`` times the suite's timeout plus
    ``short_timeouts`` times its short timeout, beyond the one timeout every test is allowed."""
    return pytest.mark.wsync_budget(seconds=seconds, timeouts=timeouts, short_timeouts=short_timeouts)


def thorough() -> pytest.MarkDecorator:
    """Mark a test that runs only with ``--thorough``."""
    return pytest.mark.wsync_thorough


def option(request: pytest.FixtureRequest, name: str) -> Any:
    """The value of pytest option ``name``, or None when the wsync_conformance plugin is not loaded."""
    try:
        return request.config.getoption(name)
    except ValueError:
        return None


class SuiteBase:
    """The configuration a transport's test class sets, and the fixtures every check uses."""

    #: entry-point name, ``"module:attr"``, Transport class, Transport object or factory(**options)
    transport: ClassVar[str | Transport | type[Transport] | Callable[..., Transport]] = "inproc"
    #: options for the transport
    options: ClassVar[dict[str, Any]] = {}
    #: ``cpu`` or ``cuda`` (``--wsync-device`` overrides)
    device: ClassVar[str] = "cpu"
    #: seconds a call that should succeed may take (``--wsync-timeout`` overrides)
    timeout: ClassVar[float] = 30.0
    #: seconds for calls that must time out
    short_timeout: ClassVar[float] = 1.0
    #: size of the large tensor in the rich model
    large_mib: ClassVar[int] = 4

    @pytest.fixture(autouse=True)
    def wsync_budget(self, request: pytest.FixtureRequest):
        """Every test runs under a watchdog: one timeout, the waits it declares with ``budget``,
        and 30 s of work (x10 with --thorough); past that it fails naming the call that hung."""
        timeout = float(option(request, "wsync_timeout") or self.timeout)
        deep = bool(option(request, "wsync_thorough"))
        if request.node.get_closest_marker("wsync_thorough") is not None and not deep:
            pytest.skip("runs only with --thorough")
        waits = 0.0
        mark = request.node.get_closest_marker("wsync_budget")
        if mark is not None:
            kw = mark.kwargs
            waits = kw.get("seconds", 0.0) + kw.get("timeouts", 0.0) * timeout + kw.get("short_timeouts", 0.0) * self.short_timeout
        total = timeout + waits + BUDGET_SLACK_S * (THOROUGH_FACTOR if deep else 1.0)

        def kill_hung() -> None:
            for w, _ in harness.waiting():
                w.kill()

        capture = request.config.pluginmanager.getplugin("capturemanager")

        def release_output() -> None:
            """What pytest captured goes to the real streams, and the rest too (the process ends)."""
            if capture is not None:
                capture.suspend_global_capture(in_=False)
                out, err = capture.read_global_capture()
                sys.stdout.write(out)
                sys.stderr.write(err)

        dog = Watchdog(total, f"test {request.node.name}", on_hang=kill_hung, nodeid=request.node.nodeid,
                       on_exit=release_output).start()
        request.node.wsync_watchdog = dog  # the report names the hung call, whatever error followed it
        try:
            yield dog
        finally:
            dog.stop()

    @pytest.fixture
    def wsync_target(self) -> Target:
        """The transport under test (``TestConformance`` takes it from the command line)."""
        return Target(type(self).transport, dict(type(self).options))

    @pytest.fixture
    def wsync(self, request: pytest.FixtureRequest, wsync_target: Target):
        """A Context for one test; frees every scheme and returns every receiver runner after it."""
        device = option(request, "wsync_device") or self.device
        timeout = option(request, "wsync_timeout") or self.timeout
        if device == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("CUDA is not available on this machine")
            if not wsync_target.capabilities.cuda:
                pytest.skip(f"transport {wsync_target.name!r} does not declare the 'cuda' capability")
        ctx = Context(wsync_target, device, float(timeout), self.short_timeout)
        try:
            yield ctx
        finally:
            ctx.close()


def send_three(wsync: Context, s: Any, claims: list[harness.Worker], guarantee: str, what: str) -> list[harness.Reply]:
    """Send versions 1, 2 and 3 of session ``s`` while each of ``claims`` follows (receives in a
    loop); the followers' reports of the last. A send that times out is a violation of
    ``guarantee``, ``what`` saying what was going on."""
    reports: list[harness.Reply] = []
    for v in (1, 2, 3):
        fill_version(s.model, v)
        expected = digests(s.model)
        for w in claims:
            w.follow()
        try:
            got = s.scheme.send(timeout=wsync.timeout)
        except WorkerTimeoutError as exc:
            raise violated(guarantee, f"{what}: version {v} did not reach the worker holding it within "
                                      f"{wsync.timeout} s: {exc}") from None
        finally:
            reports = [w.stop() for w in claims]
        s.expected[got] = expected
    return reports


def contest_index(wsync: Context, s: Any, stray: harness.Worker, who: str, guarantee: str) -> None:
    """``stray``, opened under worker 0's index of session ``s`` (one worker, connected), connects
    while that worker holds the index; then three versions are sent, both following. Raise a
    violation of ``guarantee`` naming ``who`` unless every send reaches the holder, it holds
    version 3, and the stray, if its connect() succeeded, applied nothing and was told (its
    receive() raised)."""
    first = s.workers[0]
    joined = stray.call("connect", timeout=wsync.short_timeout)
    claims = [first] if joined.error else [first, stray]
    reports = send_three(wsync, s, claims, guarantee,
                         f"{who} claimed worker 0's index (its connect() gave {joined.error or 'success'})")
    holding = first.snapshot()
    if holding["version"] != 3 or holding["digests"] != s.expected[3]:
        raise violated(guarantee, f"{who} claimed worker 0's index: the worker holding it does not hold version 3 "
                                  f"(it holds {holding['version']})")
    if len(claims) == 2 and (reports[1].get("applied") or not reports[1].get("errors")):
        raise violated(guarantee, f"{who} claimed worker 0's index: its connect() succeeded and its receive() "
                                  f"{'applied a version' if reports[1].get('applied') else 'raised nothing'}; it "
                                  f"must be told why it gets no versions")
