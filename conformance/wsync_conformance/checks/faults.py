"""live under faults (issue 16): a dead, cut-off, slow or orphaned worker never costs the others
their update, and the scheme stays usable.

- ``test_faults_slow_worker_gets_newest`` (every transport, one host): a worker that stops
  calling ``receive()`` while the sender keeps sending (``sync=False``) applies the newest version
  when it resumes, never a stale queued one, and the sender's memory grows by at most two model
  sizes meanwhile (one version being written to it and one pending, plus allocator slack). A
  process worker freezes whole (SIGSTOP) with a version waiting in it and the next one in flight,
  and wakes while the trainer holds its GIL, so a stale version is certainly at hand when it resumes.
- For transports that declare ``multi_host``, with real processes in separate network namespaces
  (``wsync_conformance.netns``; skipped with the reason where they cannot be made), the sender in
  a fresh process on this host, the worker that keeps working and the worker at fault each
  launched on a host of its own:
  a worker SIGKILLed before, during or after a send, then a replacement under its index; a
  worker's link cut mid-send, then restored; the sender SIGKILLed mid-send.
  The default run keeps one small case per fault; ``--thorough`` adds the matrix (every moment of
  the kill, 10 KiB to 256 MiB).

Transports supply the ``multi_host_options(self, host_address)`` hook on their suite (see
``capabilities.py``), or the transport class supplies a static one of the same name.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from wsync_core import WeightSyncScheme, WorkerTimeoutError

from .. import harness, netns, watchdog
from ..context import Context
from ..guarantees import capability, guarantee, violated
from ..models import ModelSpec, build, digests, many_spec, random_values
from ..target import Target
from .base import SLACK_S, budget, expect_connect_refused, thorough, transport_hook

__all__ = ["FaultChecks", "Cluster", "rss_bytes", "KILL_MOMENTS", "KILL_SIZES_KIB"]

#: when the worker is killed, relative to a send
KILL_MOMENTS: tuple[str, ...] = ("before", "during", "after")
#: model sizes of the --thorough kill matrix (KiB): 10 KiB to 256 MiB
KILL_SIZES_KIB: tuple[int, ...] = (10, 4 << 10, 64 << 10, 256 << 10)
#: the slow-worker check: model size (MiB) and versions sent while the worker sleeps
SLOW_MIB, SLOW_VERSIONS = 8.0, 6
#: how long the trainer stays busy (holding its GIL) as the slow worker wakes
WAKE_BUSY_S = 0.5
#: errors a receiver may report once its sender is gone
_SENDER_GONE = (None, "TransportError", "WorkerTimeoutError")


def _receive_in_time(c: Cluster, worker: int, timeout: float, what: str) -> None:
    """Raise a violation of "live" unless worker ``worker``'s ``receive(timeout)`` returns, or raises
    TransportError, within ``timeout`` (and the suite's slack)."""
    t0 = time.monotonic()
    c.workers[worker].call_async("receive", timeout=timeout)
    try:
        reply = c.workers[worker].recv(timeout + SLACK_S, "answer to receive()")
    except harness.HarnessError as exc:
        raise violated("live", f"worker {worker}'s receive(timeout={timeout:g}) ({what}) did not return within "
                               f"{timeout + SLACK_S:g} s: {exc}") from None
    took = time.monotonic() - t0
    if reply.error not in (None, "TransportError"):
        raise violated("live", f"worker {worker}'s receive(timeout={timeout:g}) ({what}) raised {reply.error}: "
                               f"{reply.get('message')}")
    if took > timeout + SLACK_S:
        raise violated("live", f"worker {worker}'s receive(timeout={timeout:g}) ({what}) took {took:.1f} s")


def rss_bytes() -> int | None:
    """This process's resident memory in bytes (shared memory it touched included), or None where
    /proc is not there."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _require_hosts(suite: Any, wsync: Context):
    wsync.require("multi_host")
    hook = transport_hook(suite, wsync, "multi_host_options", "multi_host", "(self, host_address: str) -> dict",
                          "options for a sender listening on host_address, reachable from another network namespace")
    if (reason := netns.available()) is not None:
        pytest.skip(f"multi_host faults cannot be tested here: {reason}")
    return hook


def _spec_of(kib: int) -> ModelSpec:
    return many_spec("state_dict", kib / 1024, count=12 if kib < 1024 else 36)


class Cluster:
    """A sender in a fresh spawned runner on this host and two workers, each launched (``python -m
    wsync_conformance.harness``) on a host of its own (a network namespace): worker 0 the one that
    keeps working, worker 1 the one at fault, on ``remote`` (whose link can be cut). Every runner is
    fresh: some transports fix a process's address at its first endpoint. ``expected[v]`` holds the
    sender's digests of version ``v``."""

    def __init__(self, wsync: Context, hook, spec: ModelSpec, stack: contextlib.ExitStack, setup=None) -> None:
        self.ctx, self.spec = wsync, spec
        t0 = time.monotonic()
        self.here, self.near, self.remote = stack.enter_context(netns.hosts(3, local=True))
        extra = {}
        if setup is not None:  # a runtime the transport needs on every host (a Ray node on each)
            with watchdog.paused():
                extra = dict(stack.enter_context(setup(self.here, self.near, self.remote)))
        target = Target(wsync.target.transport, {**wsync.target.options, **dict(hook(self.here.address)), **extra})
        local = WeightSyncScheme(target.make(), timeout=wsync.timeout)
        local.init_on_sender(model=build(spec), num_workers=2)  # resolves the options receivers need
        self.blob = pickle.loads(pickle.dumps(local))
        local.shutdown()
        self.started: list[harness.Worker] = []
        stack.callback(self._close)  # before the namespaces go (callbacks run last-in first-out)
        with watchdog.paused():
            self.sender = harness.Worker(kind="spawn", wait=False)  # fresh: some transports fix a process's address
            self.started.append(self.sender)
            self.workers = [self._launch(self.near), self._launch(self.remote)]
            for w in self.started:
                w.wait_started()
        t1 = time.monotonic()
        self.sender.open(self.blob, spec, wsync.device, 0, init=False)
        self.sender.call("init_on_sender", num_workers=2).raise_for_error("init_on_sender() in the sender runner")
        for i, w in enumerate(self.workers):
            w.open(self.blob, spec, wsync.device, i)
        self.seed = 0  # version v's values are those of seed + v (a restarted sender's differ)
        self.expected: dict[int, dict[str, str]] = {0: self.fill(0)}
        for w in self.workers:
            w.call_async("connect", timeout=wsync.timeout)
        connected = self.sender.call("connect", timeout=wsync.timeout)
        for i, w in enumerate(self.workers):
            w.recv(wsync.timeout + SLACK_S + 60, "answer to connect").raise_for_error(f"worker {i}'s connect()")
        connected.raise_for_error("the sender's connect() to a receiver on another host")
        self.version = 0
        if os.environ.get("WSYNC_FAULTS_DEBUG"):
            print(f"cluster: set up in {t1 - t0:.1f} s, connected in {time.monotonic() - t1:.1f} s")

    def _launch(self, host: netns.Host) -> harness.Worker:
        w = harness.Worker(kind="launched", prefix=host.prefix, wait=False)
        self.started.append(w)
        return w

    def _close(self) -> None:
        for w in self.started:
            if w.alive():
                with contextlib.suppress(harness.HarnessError):
                    w.request("exit", 30.0, abrupt=True)  # nobody waits on a goodbye to a dead peer
            w.kill()

    def fill(self, seed: int) -> dict[str, str]:
        return self.sender.request("fill", seed=seed).raise_for_error("fill in the sender runner")["digests"]

    def next_version(self) -> int:
        """Fill the sender's model with the next version's values; returns that version."""
        self.version += 1
        self.expected[self.version] = self.fill(self.seed + self.version)
        return self.version

    def restart_sender(self) -> None:
        """A fresh sender runner built from the first one's pickled scheme (its address), whose
        connect() must reach the workers while they call receive(): they find it by themselves
        (``sender_restart``). Its versions count from 0 again, with values no earlier one had."""
        with watchdog.paused():
            self.sender = harness.Worker(kind="spawn", wait=False)
            self.started.append(self.sender)
            self.sender.wait_started()
        self.sender.open(self.blob, self.spec, self.ctx.device, 0, init=False)
        self.sender.call("init_on_sender", num_workers=2).raise_for_error("init_on_sender() in the restarted sender")
        self.seed, self.version = 1000, 0
        self.expected = {0: self.fill(self.seed)}
        for w in self.workers:
            w.follow()
        try:
            reply = self.sender.call("connect", timeout=self.ctx.timeout)
        finally:
            for w in self.workers:
                w.stop()
        if reply.error:
            raise violated("live", f"a sender restarted on the killed one's address: its connect() raised "
                                   f"{reply.error}: {reply.get('message')}")

    def send(self, timeout: float, follow: list[int], **kw: Any) -> harness.Reply:
        """``send(timeout, **kw)`` in the sender while receivers ``follow`` receive; the sender's reply."""
        for i in follow:
            self.workers[i].follow()
        try:
            return self.sender.call("send", timeout=timeout, **kw)
        finally:
            for i in follow:
                self.workers[i].stop()

    def send_naming(self, victim: int, timeout: float, follow: list[int], what: str) -> None:
        """A send that must raise WorkerTimeoutError naming exactly ``victim`` in time; the workers
        that follow are then checked to hold the version sent."""
        t0 = time.monotonic()
        reply = self.send(timeout, follow)
        took = time.monotonic() - t0
        if reply.error is None:
            raise violated("live", f"{what}: send() returned although worker {victim} could not receive")
        if reply.error != "WorkerTimeoutError":
            raise violated("live", f"{what}: send() raised {reply.error}, not WorkerTimeoutError naming worker "
                                   f"{victim}: {reply.get('message')}")
        if reply.get("workers") != [victim]:
            raise violated("live", f"{what}: WorkerTimeoutError names {reply.get('workers')}, expected [{victim}]")
        if took > timeout + SLACK_S:
            raise violated("live", f"{what}: send(timeout={timeout:g}) took {took:.1f} s")
        for i in follow:
            self.check(i, self.version, what)

    def check(self, i: int, version: int, what: str) -> None:
        snap = self.workers[i].snapshot()
        if snap["version"] != version:
            raise violated("live", f"{what}: worker {i} holds version {snap['version']}, expected {version}")
        if snap["digests"] != self.expected[version]:
            raise violated("exact", f"{what}: worker {i} at version {version} holds other content than was sent")

    def replace_remote(self) -> harness.Worker:
        """A fresh receiver runner under index 1 on the remote host, opened (not connected)."""
        with watchdog.paused():
            w = self._launch(self.remote)
            w.wait_started()
        w.open(self.blob, self.spec, self.ctx.device, 1)
        self.workers[1] = w
        return w

    def wait_version(self, i: int, version: int, timeout: float) -> int | None:
        """Worker ``i`` calls receive() until it holds ``version``; returns the version it holds then."""
        end = time.monotonic() + timeout
        held = None
        while time.monotonic() < end:
            reply = self.workers[i].call("receive", timeout=min(1.0, max(0.1, end - time.monotonic())))
            held = reply.get("version")
            if held == version:
                return held
        return held


@contextlib.contextmanager
def _cluster(suite: Any, wsync: Context, spec: ModelSpec) -> Iterator[Cluster]:
    hook = _require_hosts(suite, wsync)
    with contextlib.ExitStack() as stack:
        yield Cluster(wsync, hook, spec, stack, getattr(suite, "multi_host_setup", None))


class FaultChecks:
    """Faults across hosts and slow workers (a mixin of ``TransportSuite``)."""

    # -- every transport -------------------------------------------------------------------------
    @guarantee("live")
    @budget(seconds=30, short_timeouts=10)
    def test_faults_slow_worker_gets_newest(self, wsync: Context) -> None:
        """A worker that stops calling receive() for a few seconds while the sender keeps sending
        (sync=False) to everyone: its next receive() applies exactly the newest version, never a
        stale queued one; the sender grows by at most two model sizes (what it writes to the slow
        worker and one pending version) plus one of allocator slack; the others kept up.

        The scene leaves nothing to a race: the first of those versions reaches the worker while it
        does not receive (it waits there), then the worker's process freezes (a GC pause) before
        the next is sent, so one is certainly in flight to it, unread; its receive() is asked while
        it still sleeps, and it wakes while the trainer holds its GIL (see ``_trainer_busy``)."""
        spec = many_spec("state_dict", SLOW_MIB)
        s = wsync.session(spec, n=3, sync=False)
        model_bytes = int(SLOW_MIB * (1 << 20))
        for step in range(2):  # everyone keeps up: the sender's steady state, buffers and all
            s.fill(random_values(spec, 3000 + step))
            s.send()
        slow = s.workers[1]
        pid = slow.pid if wsync.process else None  # a process pauses whole (a GC pause, SIGSTOP): frozen
        asleep = False

        def freeze() -> None:
            nonlocal asleep
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                asleep = True

        try:
            with s.following([0, 2]) as reports:
                grown = _keep_sending(wsync, s, spec, freeze)
            latest = s.scheme.version
            for i in (0, 2):
                if reports[i].get("errors"):
                    err = reports[i]["errors"][0]
                    raise violated("live", f"worker {i} raised while the slow worker slept: {err['error']}: {err['message']}")
                if not reports[i].get("applied") or max(reports[i]["applied"]) != latest:
                    _settle(s, i, latest)
            if pid is not None:
                # receive() is asked while the worker still sleeps, and it wakes while this process
                # (the trainer) is busy in Python: a sender whose I/O needs this process's GIL cannot
                # write meanwhile, so receive() starts with a stale version waiting, another at most
                # partly arrived and the newest not begun. What it returns is the transport's own
                # answer, never the luck of a race with the newest version's arrival.
                slow.call_async("receive", timeout=wsync.timeout)
                with _trainer_busy(WAKE_BUSY_S):
                    os.kill(pid, signal.SIGCONT)
                    asleep = False
                reply = slow.recv(wsync.timeout + 60.0, "answer to receive()")
            else:
                reply = slow.call("receive", timeout=wsync.timeout)
        finally:
            if asleep and pid is not None:  # (asleep: frozen)
                os.kill(pid, signal.SIGCONT)
        if reply.error:
            raise violated("live", f"the slow worker's receive() raised {reply.error}: {reply.get('message')}")
        got = reply.get("result")
        if got != latest:
            stale = f"a stale queued version {got}" if isinstance(got, int) and got < latest else f"{got}"
            raise violated("live", f"the slow worker's first receive() after sleeping through versions "
                                   f"{latest - SLOW_VERSIONS + 1}..{latest} applied {stale}, not the newest "
                                   f"({latest})")
        s.check(latest, [1], guarantee="live")
        if os.environ.get("WSYNC_FAULTS_DEBUG"):
            print(f"slow worker: sender grew {grown / model_bytes if grown is not None else -1:.2f} model sizes")
        if grown is not None and grown > 3 * model_bytes:
            raise violated("live", f"while one worker slept through {SLOW_VERSIONS} versions of a "
                                   f"{model_bytes >> 20} MiB model the sender grew by {grown / (1 << 20):.0f} "
                                   f"MiB ({grown / model_bytes:.1f} model sizes): it may hold at most one "
                                   f"pending version for a worker beyond the one it is writing to it (2 model "
                                   f"sizes, plus one of slack)")
        s.fill(random_values(spec, 3200))
        s.send()  # everyone, the slow worker included, is updated again

    # -- multi_host: faults across hosts ----------------------------------------------------------
    @guarantee("live")
    @capability("multi_host")
    @budget(timeouts=4, short_timeouts=12)
    def test_faults_worker_killed(self, wsync: Context) -> None:
        """A worker on another host SIGKILLed during a send of a 1 MiB model: the send (or the next
        one) names exactly it in time, the worker on the other host is updated by each send, and
        the scheme keeps working for it. Then a replacement is started on its host under its index:
        with late_join it connects holding the newest version and the next send updates everyone;
        without (a static membership) its connect() raises WorkerTimeoutError or TransportError
        within its timeout and the survivor keeps being updated."""
        self._worker_killed(wsync, "during", 1024, replace=True)

    @guarantee("live")
    @capability("multi_host")
    @thorough()
    @budget(timeouts=6, short_timeouts=12)
    @pytest.mark.parametrize("kib", KILL_SIZES_KIB, ids=lambda k: f"{k}KiB")
    @pytest.mark.parametrize("moment", KILL_MOMENTS)
    def test_faults_worker_killed_matrix(self, wsync: Context, moment: str, kib: int) -> None:
        """The kill of ``test_faults_worker_killed`` before, during and after a send, 10 KiB to 256 MiB."""
        self._worker_killed(wsync, moment, kib)

    def _worker_killed(self, wsync: Context, moment: str, kib: int, replace: bool = False) -> None:
        wait = wsync.short_timeout * 2 + kib / (16 << 10)  # and a second per 16 MiB for the survivor to apply
        with _cluster(self, wsync, _spec_of(kib)) as c:
            what = f"worker 1 killed {moment} a send of {kib} KiB"
            c.next_version()
            if moment == "after":
                c.send(wsync.timeout, [0, 1]).raise_for_error("send() to both workers")
                c.check(1, c.version, "before the kill")
                c.workers[1].kill()
            elif moment == "before":
                c.workers[1].kill()
                c.send_naming(1, wait, [0], what)
            elif moment == "during":
                c.workers[0].follow()
                c.workers[1].follow()
                c.sender.call_async("send", timeout=wait)
                time.sleep(0.01 + kib / (400 << 10))  # well into the send: ~400 MiB/s on a busy machine
                c.workers[1].kill()
                reply = c.sender.recv(wait + SLACK_S + 60, "answer to send()")
                c.workers[0].stop()
                if reply.error is not None and (reply.error != "WorkerTimeoutError" or reply.get("workers") != [1]):
                    raise violated("live", f"{what}: send() raised {reply.error} naming {reply.get('workers')}, "
                                           f"expected WorkerTimeoutError naming [1] (or success, had it finished)")
                c.check(0, c.version, what)
            c.next_version()  # the scheme stays usable: a later send names it, and only it
            c.send_naming(1, wait, [0], f"{what}, a later send")
            if wsync.caps.subset_send:
                c.next_version()
                c.send(wsync.timeout, [0], worker_ids=[0]).raise_for_error(f"{what}: send(worker_ids=[0])")
                c.check(0, c.version, f"{what}: send(worker_ids=[0])")
            if replace:
                _replace_worker(c, wsync, wait)

    @guarantee("live")
    @capability("multi_host")
    @budget(timeouts=4, short_timeouts=12)
    def test_faults_link_cut(self, wsync: Context) -> None:
        """A worker's link cut (no reset reaches anyone) during a send it has not received yet, then
        restored: the send names exactly it within its timeout and the worker on the other host is
        updated; the cut-off worker's ``receive(timeout)`` right after the cut, with that version
        waiting for it, returns within its timeout; once the link is back a late_join transport has
        it reconnect under its index and hold the newest version, and a send to everyone completes."""
        wait = wsync.short_timeout * 2
        with _cluster(self, wsync, _spec_of(1024)) as c:
            c.next_version()
            c.send(wsync.timeout, [0, 1]).raise_for_error("send() to both workers before the cut")
            c.check(1, c.version, "before the cut")
            c.next_version()
            c.workers[0].follow()
            c.sender.call_async("send", timeout=wait)
            time.sleep(1.0)  # its copy reaches worker 1, which does not receive it yet
            c.remote.cut()
            try:
                _receive_in_time(c, 1, wsync.short_timeout, "its link just cut, a version waiting for it")
                reply = c.sender.recv(wait + SLACK_S + 60, "answer to send()")
            finally:
                c.workers[0].stop()
            if reply.error != "WorkerTimeoutError" or reply.get("workers") != [1]:
                raise violated("live", f"a send while worker 1's link was cut gave "
                                       f"{reply.error or 'success'} naming {reply.get('workers')}, expected "
                                       f"WorkerTimeoutError naming [1]")
            c.check(0, c.version, "a send while worker 1's link was cut")
            c.next_version()
            c.send_naming(1, wait, [0], "a second send while worker 1's link is cut")
            c.remote.restore()
            newest = c.version
            if wsync.caps.late_join:
                held = c.wait_version(1, newest, wsync.timeout)
                if held != newest:
                    raise violated("live", f"worker 1's link came back, but within {wsync.timeout:g} s it did not "
                                           f"get the newest version {newest} (it holds {held}): a late_join "
                                           f"transport reconnects it under its index")
                c.check(1, newest, "worker 1 after its link came back")
                c.next_version()
                c.send(wsync.timeout, [0, 1]).raise_for_error("a send to both workers after the link came back")
                for i in (0, 1):
                    c.check(i, c.version, "a send to both workers after the link came back")
            else:  # static membership: the survivor keeps being served, whatever becomes of worker 1
                c.next_version()
                reply = c.send(wait, [0, 1])
                if reply.error is not None and (reply.error != "WorkerTimeoutError" or reply.get("workers") != [1]):
                    raise violated("live", f"after the link came back a send raised {reply.error} naming "
                                           f"{reply.get('workers')}: only worker 1 may be named")
                c.check(0, c.version, "a send after worker 1's link came back")

    @guarantee("live")
    @capability("multi_host")
    @capability("sender_restart")
    @budget(timeouts=4, short_timeouts=12)
    def test_faults_sender_killed(self, wsync: Context) -> None:
        """The sender SIGKILLed mid-send: every receiver on the other hosts has its receive() return
        (or raise TransportError) within its timeout, twice, its model holding exactly the last
        version it applied. With ``sender_restart``, a sender started again on the killed one's
        address then connects and updates both workers (its version 1, exactly)."""
        wait = wsync.short_timeout * 2
        with _cluster(self, wsync, _spec_of(1024)) as c:
            c.next_version()
            c.send(wsync.timeout, [0, 1]).raise_for_error("send() to both workers")
            c.next_version()
            for w in c.workers:
                w.follow()
            c.sender.call_async("send", timeout=wsync.timeout)
            time.sleep(0.02)
            c.sender.kill()
            time.sleep(0.5)
            reports = [w.stop(wait + SLACK_S + 60) for w in c.workers]
            last = {i: max([c.version - 1, *reports[i].get("applied", [])]) for i in (0, 1)}
            for i in (0, 1):
                bad = [e for e in reports[i].get("errors", []) if e["error"] not in _SENDER_GONE]
                if bad:
                    raise violated("live", f"worker {i}'s receive() raised {bad[0]['error']} once the sender was "
                                           f"killed, expected TransportError or nothing: {bad[0]['message']}")
            for _ in range(2):  # both workers at once, twice: a receive() that ends once keeps ending
                t0 = time.monotonic()
                for w in c.workers:
                    w.call_async("receive", timeout=wait)
                for i, w in enumerate(c.workers):
                    reply = w.recv(wait + SLACK_S + 60, "answer to receive()")
                    took = time.monotonic() - t0
                    if reply.error not in _SENDER_GONE:
                        raise violated("live", f"worker {i}'s receive() after the sender was killed raised "
                                               f"{reply.error}: {reply.get('message')}")
                    if took > wait + SLACK_S:
                        raise violated("live", f"worker {i}'s receive(timeout={wait:g}) took {took:.1f} s once "
                                               f"the sender was killed")
                    if isinstance(reply.get("result"), int):
                        last[i] = reply["result"]
            for i, w in enumerate(c.workers):
                snap = w.snapshot()
                if snap["version"] != last[i]:
                    raise violated("live", f"worker {i} holds version {snap['version']} after the sender died, "
                                           f"not the last version it applied ({last[i]})")
                if snap["digests"] != c.expected[snap["version"]]:
                    raise violated("atomic", f"worker {i} reports version {snap['version']} but holds other "
                                             f"content once the sender died mid-send")
            if wsync.caps.sender_restart:
                c.restart_sender()
                c.next_version()
                reply = c.send(wsync.timeout, [0, 1])
                if reply.error:
                    raise violated("live", f"the sender restarted after the first was killed: its send() of version 1 "
                                           f"raised {reply.error}: {reply.get('message')}")
                for i in (0, 1):
                    c.check(i, c.version, "a send from the sender restarted after the first was killed")

def _replace_worker(c: Cluster, wsync: Context, wait: float) -> None:
    """A replacement for the killed worker 1, on its host under its index: with late_join it
    connects holding the newest version and the next send updates everyone; without, its connect()
    raises WorkerTimeoutError or TransportError in time and the survivor keeps being updated."""
    w = c.replace_remote()
    if not wsync.caps.late_join:
        expect_connect_refused(w, wait, "a replacement worker without late_join")
        c.next_version()
        c.send_naming(1, wait, [0], "a send after a replacement for worker 1 was refused")
        return
    w.call("connect", timeout=wsync.timeout).raise_for_error("the replacement worker 1's connect()")
    held = c.wait_version(1, c.version, wsync.timeout)
    if held != c.version:
        raise violated("live", f"a replacement worker under index 1 holds version {held}, not the newest "
                               f"({c.version})")
    c.check(1, c.version, "the replacement worker")
    c.next_version()
    c.send(wsync.timeout, [0, 1]).raise_for_error("a send to the survivor and the replacement")
    for i in (0, 1):
        c.check(i, c.version, "a send to the survivor and the replacement")


def _keep_sending(wsync: Context, s, spec: ModelSpec, after_first: Callable[[], None]) -> int | None:
    """SLOW_VERSIONS sends to everyone, ``sync=False``, 0.3 s apart, calling ``after_first()`` 0.3 s
    after the first; returns how many bytes this process (the sender) grew at most meanwhile (None:
    not measured)."""
    base = rss_bytes() if wsync.process else None  # thread receivers share this process's memory
    peak = base
    for step in range(SLOW_VERSIONS):
        s.fill(random_values(spec, 3100 + step))
        expected = digests(s.model)
        try:
            v = s.scheme.send(timeout=wsync.short_timeout * 5)  # sync=False: it waits on nobody
        except WorkerTimeoutError as exc:
            raise violated("live", f"send() with sync=False raised WorkerTimeoutError for {exc.workers} "
                                   f"while worker 1 was merely not receiving: the sender cannot keep "
                                   f"sending past a slow worker") from exc
        s.expected[v] = expected
        now = rss_bytes()
        peak = max(peak, now) if now is not None and peak is not None else None
        time.sleep(0.3)  # the slow worker sleeps through the whole loop: a few seconds
        if step == 0:
            after_first()
    return None if base is None or peak is None else peak - base


@contextlib.contextmanager
def _trainer_busy(seconds: float) -> Iterator[None]:
    """Run the block, then keep this process busy in Python for ``seconds``, holding the GIL the
    whole time (the switch interval is raised so no other thread of this process runs meanwhile)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 5.0)
    try:
        yield
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)


def _settle(s, i: int, latest: int) -> None:
    """Follower ``i`` receives until it holds ``latest``; raises under "live" if it does not in time."""
    deadline = time.monotonic() + s.ctx.timeout
    held = None
    while time.monotonic() < deadline:
        reply = s.workers[i].call("receive", timeout=1.0)
        if reply.error:
            raise violated("live", f"worker {i}'s receive() raised {reply.error}: {reply.get('message')}")
        held = reply.get("version")
        if held == latest:
            return
    raise violated("live", f"worker {i}, which kept receiving, holds version {held}, not the newest ({latest})")
