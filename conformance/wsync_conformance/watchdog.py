"""Every conformance test runs under a budget: its timeouts plus at most 30 s of work.

A watchdog thread measures the test (time spent starting receiver processes does not count).
When the budget runs out it finds the transport call that did not return, in any thread of this
process (a ``SenderEndpoint``/``ReceiverEndpoint`` method still on a stack) or in a receiver
runner the test waits for (its stack, dumped by ``faulthandler``), and interrupts the test's
thread with ``Hung``, which fails the test under "live" naming that call; the receiver runners
involved are killed. ``Hung`` is raised once (a second one would land in the test's teardown or
in pytest's report of the first); a call blocked in C that does not return to Python when
signalled is signalled again, up to three times 30 s apart. If the test has not ended by then,
the watchdog writes every stack to stderr and ends the process with status 70, so that a supervisor (``wsync conformance``) can record the failure and
go on with the rest.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator
from types import FrameType
from typing import Any

__all__ = ["Hung", "Watchdog", "current", "paused", "HUNG_EXIT_STATUS", "INTERFACE_CALLS"]

#: the process exit status when a hung test could not be interrupted
HUNG_EXIT_STATUS = 70
#: seconds between a first interruption and the next (teardown of a hung test gets as long)
GRACE_S = float(os.environ.get("WSYNC_CONFORMANCE_GRACE", "30"))
#: the transport interface's blocking calls, by the name a stack shows
INTERFACE_CALLS = frozenset({"open", "acquire", "publish", "ready", "poll", "close", "recv", "ack"})
_SIGNAL = signal.SIGUSR2

_current: list[Watchdog] = []


class Hung(BaseException):
    """A test ran past its budget; the message names the call that did not return.

    A BaseException, so no ``except Exception`` in a transport, the core or hypothesis swallows it.
    """

    guarantee = "live"

    def __init__(self, message: str) -> None:
        super().__init__(f"[live] {message}")


def _endpoint_call(frame: FrameType | None) -> tuple[str, str] | None:
    """The outermost transport interface call on ``frame``'s stack: (name, where it is now)."""
    from wsync_core import Deadline
    from wsync_core.transport import ReceiverEndpoint, SenderEndpoint

    found = None
    innermost = frame
    while frame is not None:
        if frame.f_code.co_name in INTERFACE_CALLS:
            owner = frame.f_locals.get("self")
            deadline = frame.f_locals.get("deadline")
            if isinstance(deadline, Deadline) and time.monotonic() - deadline._end < 2.0:
                pass  # a call still within its deadline (or just past it) is waiting as it may
            elif isinstance(owner, (SenderEndpoint, ReceiverEndpoint)):
                side = "SenderEndpoint" if isinstance(owner, SenderEndpoint) else "ReceiverEndpoint"
                found = f"{side}.{frame.f_code.co_name}() of {type(owner).__module__}.{type(owner).__qualname__}"
        frame = frame.f_back
    if found is None or innermost is None:
        return None
    return found, f"{os.path.basename(innermost.f_code.co_filename)}:{innermost.f_lineno} in {innermost.f_code.co_name}"


def diagnose(skip: Collection[int] = frozenset()) -> tuple[str, list[str]]:
    """What this process and the receiver runners it waits for are stuck in: (summary, details)."""
    from . import harness

    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    here: list[str] = []  # the test's own thread first, then the others (receiver threads last)
    others: list[str] = []
    details: list[str] = []
    frames = sys._current_frames()
    for ident in sorted(frames, key=lambda i: (i != main_id, names.get(i) == "wsync-conformance-receiver")):
        if ident in skip:
            continue
        frame = frames[ident]
        hit = _endpoint_call(frame)
        if hit is not None:
            line = f"{hit[0]} did not return (thread {names.get(ident, ident)!r}, now at {hit[1]})"
            (here if ident == main_id else others).append(line)
        details.append(f"thread {names.get(ident, ident)!r}:\n" + "".join(traceback.format_stack(frame)[-12:]))
    runners: list[str] = []
    for worker, what in harness.waiting():
        stack = worker.dump_stack()
        stuck = harness.hung_call(stack)
        if stuck is not None and "recv_bytes" in stuck:
            continue  # idle: waiting for its next command
        where = f", stuck in {stuck}" if stuck else ""
        runners.append(f"receiver runner {worker.label} gave no answer to {what}{where}")
        details.append(f"receiver runner {worker.label}:\n{stack}")
    # the culprit: the test's own call into the transport; else a runner it waits for; else any thread
    calls = here or runners or others
    if not calls:
        main = sys._current_frames().get(main_id) if main_id is not None else None  # (the main thread's, as above)
        if main is not None:
            last = traceback.extract_stack(main)[-1]
            calls.append(f"the test did not return from {last.name} ({os.path.basename(last.filename)}:{last.lineno})")
    return "; ".join(calls), details


class Watchdog:
    """Interrupts the main thread with ``Hung`` once ``budget`` seconds of test time have passed."""

    def __init__(self, budget: float, label: str, on_hang: Callable[[], None] | None = None, nodeid: str = "",
                 on_exit: Callable[[], None] | None = None) -> None:
        self.budget = budget
        self.label = label
        self.nodeid = nodeid
        self.on_hang = on_hang
        #: called before the process ends: release captured output, so the stacks reach the real stderr
        self.on_exit = on_exit
        self.used = 0.0
        self._since: float | None = None
        self._pauses = 0
        self._quiet = 0  # inside ``reporting()``: a Hung due waits for its end
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._fired: list[str] = []
        self._delivered = False  # the test's thread got its Hung
        self._thread: threading.Thread | None = None
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None  # signal.signal's handler

    @property
    def fired(self) -> bool:
        """Whether the budget ran out."""
        return bool(self._fired)

    @property
    def message(self) -> str | None:
        """What the watchdog found when the budget ran out (None if it did not)."""
        return self._fired[0] if self._fired else None

    # -- the clock ------------------------------------------------------------------------------
    def elapsed(self) -> float:
        with self._lock:
            return self.used + (time.monotonic() - self._since if self._since is not None else 0.0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the block does not count (starting receiver processes)."""
        with self._lock:
            self._pauses += 1
            if self._pauses == 1 and self._since is not None:
                self.used += time.monotonic() - self._since
                self._since = None
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                if self._pauses == 0 and not self._done.is_set():
                    self._since = time.monotonic()

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """pytest makes the test's report in the block: its time does not count (formatting a
        failure reads source files, slow on a loaded machine), and no Hung is raised in it (in
        pytest's own hooks it would be an internal error, not the test's failure): the watch
        sends a Hung due again after the block (``GRACE_S`` apart)."""
        with self.paused():
            self._quiet += 1
            try:
                yield
            finally:
                self._quiet -= 1

    # -- start and stop -------------------------------------------------------------------------
    def start(self) -> Watchdog:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the conformance watchdog must be started from the main thread")
        self._previous = signal.signal(_SIGNAL, self._interrupt)
        self._since = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="wsync-conformance-watchdog", daemon=True)
        self._thread.start()
        _current.append(self)
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)
        if self in _current:
            _current.remove(self)
        if self._previous is not None:
            signal.signal(_SIGNAL, self._previous)
            self._previous = None

    # -- the watch ------------------------------------------------------------------------------
    def _interrupt(self, signum, frame) -> None:
        if self._fired and not self._done.is_set() and not self._delivered and not self._quiet:
            self._delivered = True  # once: a second Hung would land in the test's teardown or report
            raise Hung(self._fired[-1])

    def _watch(self) -> None:
        main = threading.main_thread().ident
        assert main is not None  # (a started thread has an ident: the main thread runs)
        while not self._done.wait(0.1):
            if self.elapsed() <= self.budget:
                continue
            summary, details = diagnose(skip={threading.get_ident()})
            self._fired.append(f"{self.label} ran past its budget of {self.budget:.0f} s: {summary}")
            sys.stderr.write(f"\nwsync conformance watchdog: {self._fired[-1]}\n" + "\n".join(details) + "\n")
            if self.on_hang is not None:
                self.on_hang()
            for _ in range(3):  # a call blocked in C sees the signal only when it returns to Python
                if not self._delivered:
                    signal.pthread_kill(main, _SIGNAL)
                if self._done.wait(GRACE_S):
                    return
            if self.on_exit is not None:
                self.on_exit()
            sys.stderr.write(f"\nwsync conformance watchdog: {self._fired[0]}\n"
                             f"wsync conformance watchdog: {self.label} could not be interrupted "
                             f"(a call blocked in C); every stack follows, then this process exits "
                             f"with status {HUNG_EXIT_STATUS}\n")
            faulthandler.dump_traceback(all_threads=True)
            sys.stderr.flush()
            from . import harness, report

            report.note_hung(self.nodeid, self._fired[0])
            harness.kill_all()
            os._exit(HUNG_EXIT_STATUS)


def current() -> Watchdog | None:
    """The watchdog of the test running now, if any."""
    return _current[-1] if _current else None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Stop the current test's clock inside the block (no-op outside a test)."""
    dog = current()
    if dog is None:
        yield
    else:
        with dog.paused():
            yield
