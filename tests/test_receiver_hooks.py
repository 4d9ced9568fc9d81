"""The receiver-side hooks integrations need (TorchRL's collectors first): waiting for a version,
being told one was applied, applying only at the worker's safe point, re-pointing at another
model, and a sender's connect() that fails fast when a worker dies before it connects."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

from core_helpers import bump, connected_pair, make_policy, same
from wsync_core import WeightSyncScheme, WorkerDiedError, WorkerTimeoutError




def test_wait_for_version_applies_until_it_holds_the_version():
    sender, model, receiver, local = connected_pair(sync=False)
    try:
        for _ in range(3):
            bump(model)
            sender.send()
        assert receiver.wait_for_version(3, timeout=30) == 3
        assert same(local, model)
        assert receiver.wait_for_version(1, timeout=0) == 3  # already held: returns at once
        with pytest.raises(WorkerTimeoutError) as info:
            receiver.wait_for_version(4, timeout=0.2)
        assert info.value.workers == [0]
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_apply_listener_runs_before_the_ack_in_version_order():
    model = make_policy(0)
    sender = WeightSyncScheme("inproc", timeout=30.0)
    sender.init_on_sender(model=model, num_workers=1)
    receiver: WeightSyncScheme = pickle.loads(pickle.dumps(sender))
    local = make_policy(1)
    seen: list[tuple[int, bool]] = []
    receiver.init_on_receiver(model=local, worker_idx=0)
    receiver.add_apply_listener(lambda v: seen.append((v, same(local, model))))
    stop = threading.Event()

    def run():
        receiver.connect()
        while not stop.is_set():
            receiver.receive(timeout=0.01)

    t = threading.Thread(target=run)
    t.start()
    try:
        sender.connect()
        for v in range(1, 6):
            bump(model)
            assert sender.send() == v
            assert seen[-1] == (v, True)  # a sync send returns after the worker's listener ran
        assert [v for v, _ in seen] == list(range(6))
    finally:
        stop.set()
        t.join()
        receiver.shutdown()
        sender.shutdown()


def test_apply_guard_holds_every_change_to_the_model():
    """While the worker holds its safe-point lock, nothing is written into its model; the
    version lands as soon as the lock is free."""
    sender, model, receiver, local = connected_pair(sync=False)
    lock = threading.Lock()
    receiver.set_apply_guard(lambda: lock)
    try:
        before = {k: v.clone() for k, v in local.state_dict().items()}
        with lock:
            bump(model)
            sender.send()
            t = threading.Thread(target=receiver.wait_for_version, args=(1, 30))
            t.start()
            time.sleep(0.3)  # the receiver has the delivery and waits for the safe point
            assert all(torch.equal(local.state_dict()[k], v) for k, v in before.items())
            assert receiver.version == 0
        t.join()
        assert receiver.version == 1 and same(local, model)
    finally:
        receiver.shutdown()
        sender.shutdown()


class _FlakyGuard:
    """An apply guard whose entering fails ``fails`` times (a lock taken with a timeout that gave up)."""

    def __init__(self, fails: int) -> None:
        self.fails = fails

    def __call__(self) -> "_FlakyGuard":
        return self

    def __enter__(self) -> None:
        if self.fails:
            self.fails -= 1
            raise TimeoutError("the step loop kept the model")

    def __exit__(self, *exc) -> None:
        return None


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_a_guard_that_raises_loses_nothing(transport):
    """A receive whose apply guard raises raises that error and applies nothing; the next receive
    applies that version (or a newer one) and its send completes. Before, the version taken was
    dropped: the next receive found nothing, and the send waited its whole timeout for an ack.
    Over shm each failure keeps the slot it read; five in a row must not run the sender out."""
    sender, model, receiver, local = connected_pair(transport, sync=False)
    guard = _FlakyGuard(1)
    receiver.set_apply_guard(guard)
    try:
        bump(model)
        handle = sender.send_async()
        with pytest.raises(TimeoutError, match="kept the model"):
            receiver.receive(timeout=30)
        assert receiver.version == 0 and not same(local, model)
        assert receiver.receive(timeout=30) == 1 and same(local, model)
        assert handle.wait(30) == 1
        guard.fails = 5
        for v in range(2, 7):  # a new version each time the guard fails: the newest is applied once it lets it
            bump(model)
            sender.send_async()
            with pytest.raises(TimeoutError):
                receiver.receive(timeout=30)
        assert receiver.version == 1
        assert receiver.wait_for_version(6, timeout=30) == 6 and same(local, model)
        bump(model)
        handle = sender.send_async()
        assert receiver.wait_for_version(7, timeout=30) == 7 and same(local, model) and handle.wait(30) == 7
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_the_guard_and_listeners_must_be_callable():
    """set_apply_guard takes a function that returns a context manager: a lock itself (a
    natural slip: the docs say "a lock") is refused there, naming the fix; a function that returns
    something else makes receive() raise TypeError naming set_apply_guard, losing nothing. A
    listener that is not callable is refused when added (before, every later send raised
    "'int' object is not callable", though each had delivered). wait_for_version takes an int."""
    sender, model, receiver, local = connected_pair(sync=False)
    lock = threading.Lock()
    try:
        with pytest.raises(TypeError, match="set_apply_guard.*lambda: lock"):
            receiver.set_apply_guard(lock)
        with pytest.raises(TypeError, match="add_report_listener"):
            sender.add_report_listener(42)
        with pytest.raises(TypeError, match="add_apply_listener"):
            receiver.add_apply_listener(42)
        for bad in ("3", None, 2.0, True):
            with pytest.raises(TypeError, match="wait_for_version.* takes a version number"):
                receiver.wait_for_version(bad, timeout=0)
        receiver.set_apply_guard(lambda: 42)
        bump(model)
        handle = sender.send_async()
        with pytest.raises(TypeError, match="apply guard \\(set_apply_guard\\) returned a int"):
            receiver.receive(timeout=30)
        receiver.set_apply_guard(lambda: lock)
        assert receiver.receive(timeout=30) == 1 and same(local, model) and handle.wait(30) == 1
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_receive_by_the_thread_holding_a_lock_guard_returns_at_its_timeout():
    """``with lock: receive(timeout=0.5)`` where the guard is ``lambda: lock``: the receive would
    wait for its own thread; it returns None at its timeout, and the version, kept, is applied by
    the next receive once the lock is free (before, it waited for ever: an outside audit). An
    RLock its thread holds is entered again: that receive applies at once."""
    sender, model, receiver, local = connected_pair(sync=False)
    lock, rlock = threading.Lock(), threading.RLock()
    receiver.set_apply_guard(lambda: lock)
    try:
        bump(model)
        handle = sender.send_async()
        with lock:
            started = time.monotonic()
            assert receiver.receive(timeout=0.5) is None
            assert time.monotonic() - started < 20
        assert receiver.receive(timeout=30) == 1 and same(local, model) and handle.wait(30) == 1
        receiver.set_apply_guard(lambda: rlock)
        bump(model)
        handle = sender.send_async()
        with rlock:
            assert receiver.receive(timeout=30) == 2 and same(local, model)
        assert handle.wait(30) == 2
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_listener_that_raises_in_connect_leaves_the_worker_connected():
    """An apply listener that raises on version 0: connect() raises its error, and the worker is
    connected (it holds version 0, which it acked): receive() takes the next version (before, the
    scheme stayed unconnected, a second connect() timed out and receive() raised StateError)."""
    model = make_policy(0)
    sender = WeightSyncScheme("inproc", timeout=30.0, sync=False)
    sender.init_on_sender(model=model, num_workers=1)
    receiver: WeightSyncScheme = pickle.loads(pickle.dumps(sender))
    local = make_policy(1)
    receiver.init_on_receiver(model=local, worker_idx=0)
    calls: list[int] = []

    def listener(v: int) -> None:
        calls.append(v)
        if len(calls) == 1:
            raise RuntimeError("the listener failed once")

    receiver.add_apply_listener(listener)
    failed: list[BaseException] = []
    t = threading.Thread(target=lambda: _record(receiver.connect, failed))
    t.start()
    try:
        sender.connect()
        t.join()
        assert [type(e) for e in failed] == [RuntimeError] and receiver.state == "connected receiver"
        bump(model)
        handle = sender.send_async()
        assert receiver.receive(timeout=30) == 1 and same(local, model) and handle.wait(30) == 1
    finally:
        receiver.shutdown()
        sender.shutdown()


def _record(call, errors: list[BaseException]) -> None:
    try:
        call()
    except Exception as exc:  # the test looks at it
        errors.append(exc)


def test_connect_checks_watch_before_it_opens_anything():
    """connect(watch=...) with something not callable is refused before anything opens (the
    scheme stays as it was); a watch that returns no mapping is named (bare errors before)."""
    sender = WeightSyncScheme("inproc", timeout=1.0)
    sender.init_on_sender(model=make_policy(0), num_workers=1)
    try:
        with pytest.raises(TypeError, match="connect.*watch="):
            sender.connect(watch=5)
        assert sender.state == "initialized as sender"
        with pytest.raises(TypeError, match="watch returned a list"):
            sender.connect(watch=lambda missing: list(missing))
    finally:
        sender.shutdown()


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_shutdown_by_the_thread_holding_the_guard_ends_a_receive_waiting_for_it(transport):
    """A worker's step loop holds its safe-point lock and shuts the scheme down while a background
    receive() waits for that lock with a version in hand: shutdown() returns (it waited for that
    receive forever), the receive ends with StateError once the lock is free, applying nothing,
    and the scheme is closed, its endpoint with it."""
    sender, model, receiver, local = connected_pair(sync=False, transport=transport)
    lock = threading.Lock()
    asked = threading.Event()  # the receive holds a version and asks for the guard

    def guard():
        asked.set()
        return lock

    receiver.set_apply_guard(guard)
    ended: list[BaseException] = []

    def receive_in_background():
        try:
            while True:
                receiver.receive(timeout=0.5)
        except BaseException as exc:  # what ended it, for the test to check
            ended.append(exc)

    t = threading.Thread(target=receive_in_background, daemon=True)
    try:
        before = {k: v.clone() for k, v in local.state_dict().items()}
        with lock:
            t.start()
            bump(model)
            sender.send_async()
            assert asked.wait(30)
            done = threading.Thread(target=receiver.shutdown, daemon=True)
            done.start()
            done.join(10)
            assert not done.is_alive(), "shutdown() by the guard's holder waited for the receive that waits for it"
        t.join(30)
        assert not t.is_alive() and len(ended) == 1 and type(ended[0]).__name__ == "StateError", ended
        assert all(torch.equal(local.state_dict()[k], v) for k, v in before.items())
        assert receiver.state == "shut down"
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_guard_that_raises_while_shutdown_waits_for_it_still_shuts_down():
    """shutdown() from another thread while a receive() waits in the apply guard hands the rest of
    the shutdown to that receive; if the guard then raises, the receive raises the guard's error
    and the scheme is shut down all the same (it stayed a connected receiver, its endpoint open)."""
    sender, model, receiver, local = connected_pair(sync=False)
    entered, go = threading.Event(), threading.Event()

    class Failing:
        def __enter__(self):
            entered.set()
            go.wait(30)
            raise RuntimeError("the guard failed")

        def __exit__(self, *exc):
            return None

    receiver.set_apply_guard(Failing)
    ended: list[BaseException] = []

    def receive():
        try:
            receiver.receive(timeout=30)
        except BaseException as exc:  # what ended it, for the test to check
            ended.append(exc)

    t = threading.Thread(target=receive, daemon=True)
    try:
        before = {k: v.clone() for k, v in local.state_dict().items()}
        bump(model)
        sender.send_async()
        t.start()
        assert entered.wait(30)
        done = threading.Thread(target=receiver.shutdown, daemon=True)
        done.start()
        done.join(10)
        assert not done.is_alive(), "shutdown() waited for the receive in the guard"
        go.set()
        t.join(30)
        assert not t.is_alive() and len(ended) == 1 and str(ended[0]) == "the guard failed", ended
        assert receiver.state == "shut down"
        assert all(torch.equal(local.state_dict()[k], v) for k, v in before.items())
    finally:
        go.set()
        receiver.shutdown()
        sender.shutdown()


def test_receive_by_the_thread_holding_the_guard_does_not_wait_for_a_receive_waiting_for_it():
    """While a background receive() holds a version and waits for the worker's safe-point lock,
    the lock's holder calling receive() gets None at once and wait_for_version() a
    WorkerTimeoutError that says why (both waited forever); the version lands once the lock is free."""
    sender, model, receiver, local = connected_pair(sync=False)
    lock = threading.Lock()
    asked = threading.Event()

    def guard():
        asked.set()
        return lock

    receiver.set_apply_guard(guard)
    stop = threading.Event()
    t = threading.Thread(target=lambda: [receiver.receive(timeout=0.05) for _ in iter(stop.is_set, True)], daemon=True)
    try:
        with lock:
            t.start()
            bump(model)
            sender.send_async()
            assert asked.wait(30)
            t0 = time.monotonic()
            assert receiver.receive(timeout=0.2) is None
            with pytest.raises(WorkerTimeoutError, match="waits for the apply guard") as info:
                receiver.wait_for_version(1, timeout=0.5)
            assert info.value.workers == [0] and time.monotonic() - t0 < 20
            assert receiver.version == 0
        assert receiver.wait_for_version(1, timeout=30) == 1 and same(local, model)
    finally:
        stop.set()
        t.join(30)
        receiver.shutdown()
        sender.shutdown()


def test_rebind_moves_later_versions_to_the_new_model():
    sender, model, receiver, local = connected_pair()
    stop = threading.Event()
    t = threading.Thread(target=lambda: [receiver.receive(timeout=0.01) for _ in iter(stop.is_set, True)])
    try:
        moved = make_policy(7)  # e.g. TorchRL's copy of the policy on its device
        receiver.rebind(moved)
        assert same(moved, local)  # starts from the version held
        t.start()
        bump(model)
        sender.send()
        assert same(moved, model) and not same(local, model)
        with pytest.raises(Exception, match="layout|shape|keys"):
            receiver.rebind(nn.Linear(2, 2))
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        receiver.shutdown()
        sender.shutdown()


def _dies_at_startup(scheme: WeightSyncScheme, i: int) -> None:
    if i == 1:
        raise RuntimeError("env construction failed: no such env 'Foo-v0'")
    scheme.init_on_receiver(model=make_policy(i), worker_idx=i)
    scheme.connect()
    scheme.wait_for_version(10**6, timeout=60)  # until the sender goes away


@pytest.mark.parametrize("transport", ["shm", "mp"])
def test_connect_fails_fast_naming_a_worker_that_died_before_connecting(transport):
    ctx = mp.get_context("spawn")
    sender = WeightSyncScheme(transport, timeout=120.0)
    sender.init_on_sender(model=make_policy(0), num_workers=2)
    procs = [ctx.Process(target=_dies_at_startup, args=(sender, i)) for i in range(2)]
    for p in procs:
        p.start()

    def watch(missing):
        return {w: f"process exited with code {procs[w].exitcode}" for w in missing if not procs[w].is_alive()}

    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerDiedError) as info:
            sender.connect(watch=watch)
        assert time.monotonic() - t0 < 60  # far less than the 120 s timeout
        assert info.value.workers == [1]
        assert "worker 1" in str(info.value) and "exited with code 1" in str(info.value)
        assert isinstance(info.value, WorkerTimeoutError)
    finally:
        sender.shutdown()
        for p in procs:
            p.kill()
            p.join()


SILENT = """
import multiprocessing as mp, sys
from torch import nn
from wsync_core import WeightSyncScheme

def worker(scheme, i):
    scheme.init_on_receiver(model=nn.Linear(8, 8), worker_idx=i)
    scheme.connect()
    scheme.wait_for_version(2, timeout=60)

if __name__ == "__main__":
    mp.set_start_method(sys.argv[2])
    s = WeightSyncScheme(sys.argv[1], timeout=60)
    s.init_on_sender(model=nn.Linear(8, 8), num_workers=2)
    ps = [mp.Process(target=worker, args=(s, i)) for i in range(2)]
    for p in ps:
        p.start()
    s.connect()
    s.send()
    s.send()
    for p in ps:
        p.join()
    # neither side calls shutdown()
"""


def only_plugin(name: str) -> dict[str, str]:
    """An environment where ``name`` is the only wsync plugin loaded: another plugin installed
    beside it that fails to load says so on stderr, which is not this test's subject."""
    others = {ep.name for ep in entry_points(group="wsync")} - {name}
    return dict(os.environ, WSYNC_DISABLE_PLUGINS=",".join(sorted(others)))


@pytest.mark.parametrize("transport,start", [("shm", "spawn"), ("mp", "fork")])
def test_exit_without_shutdown_is_silent(tmp_path, transport, start):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SILENT))
    out = subprocess.run([sys.executable, str(script), transport, start], capture_output=True, text=True, timeout=240,
                         env=only_plugin(transport))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
