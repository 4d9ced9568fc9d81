"""Ordered use: every call out of order raises StateError naming the expected call, and changes nothing."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from core_helpers import make_policy
from wsync_core import StateError, WeightSyncScheme, WorkerTimeoutError

CALLS = ["init_on_sender", "init_on_receiver", "connect", "send", "send_async", "receive", "shutdown"]


def call(scheme: WeightSyncScheme, name: str) -> object:
    if name == "init_on_sender":
        return scheme.init_on_sender(model=make_policy(), num_workers=1)
    if name == "init_on_receiver":
        return scheme.init_on_receiver(model=make_policy(), worker_idx=0)
    if name == "connect":
        return scheme.connect(timeout=0.05)
    if name == "send":
        return scheme.send(timeout=0.05)
    if name == "send_async":
        return scheme.send_async(timeout=0.05)
    if name == "receive":
        return scheme.receive(timeout=0.0)
    return scheme.shutdown()


# which calls each state allows (connect may time out: no peer here)
ALLOWED = {
    "new": {"init_on_sender", "init_on_receiver", "shutdown"},
    "initialized as sender": {"connect", "shutdown"},
    "initialized as receiver": {"connect", "shutdown"},
    "connected sender": {"send", "send_async", "shutdown"},
    "connected receiver": {"receive", "shutdown"},
    "shut down": {"shutdown"},
}


class Lifecycle(RuleBasedStateMachine):
    """Random call sequences on one scheme; a peer (thread) exists so connect can succeed."""

    def __init__(self) -> None:
        super().__init__()
        self.scheme = WeightSyncScheme("inproc", timeout=5)
        self.peer: WeightSyncScheme | None = None
        self.peer_thread: threading.Thread | None = None

    def _start_peer(self) -> None:
        """Give the scheme a counterpart so that connect() succeeds."""
        if self.peer is not None:
            return
        peer = pickle.loads(pickle.dumps(self.scheme))
        if self.scheme.state == "initialized as sender":
            peer.init_on_receiver(model=make_policy(1), worker_idx=0)
            target = peer.connect
        else:
            peer.init_on_sender(model=make_policy(1), num_workers=1)
            target = peer.connect
        self.peer = peer
        self.peer_thread = threading.Thread(target=lambda: _quiet(target), daemon=True)
        self.peer_thread.start()

    @rule(name=st.sampled_from(CALLS))
    def any_call(self, name: str) -> None:
        state = self.scheme.state
        version = self.scheme.version
        if name == "connect" and state in ("initialized as sender", "initialized as receiver"):
            self._start_peer()
            self.scheme.connect(timeout=10)
            self.peer_thread.join(10)
            return
        if name in ALLOWED[state]:
            try:
                call(self.scheme, name)
            except WorkerTimeoutError:
                assert name in ("send",)  # the peer receiver does not answer after connect
            return
        with pytest.raises(StateError) as info:
            call(self.scheme, name)
        assert f"{name}()" in str(info.value)  # the error names the call made
        assert self.scheme.state == state and self.scheme.version == version  # nothing half-happened

    @invariant()
    def state_known(self) -> None:
        assert self.scheme.state in ALLOWED

    def teardown(self) -> None:
        self.scheme.shutdown()
        if self.peer is not None:
            self.peer.shutdown()
        if self.peer_thread is not None:
            self.peer_thread.join(10)


def _quiet(fn) -> None:
    try:
        fn()
    except WorkerTimeoutError:
        pass


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=30, stateful_step_count=8, deadline=None)


def test_messages_name_the_expected_call():
    s = WeightSyncScheme("inproc")
    with pytest.raises(StateError, match=r"send\(\).*call init_on_sender\(\) first"):
        s.send()
    with pytest.raises(StateError, match=r"receive\(\).*call init_on_receiver\(\) first"):
        s.receive()
    with pytest.raises(StateError, match=r"connect\(\)"):
        s.connect()
    s.init_on_sender(model=make_policy(), num_workers=1)
    with pytest.raises(StateError, match=r"send\(\).*call connect\(\) first"):
        s.send()
    with pytest.raises(StateError, match=r"init_on_receiver\(\).*sender"):
        s.init_on_receiver(model=make_policy(), worker_idx=0)
    with pytest.raises(StateError, match=r"init_on_sender\(\)"):
        s.init_on_sender(model=make_policy(), num_workers=1)
    s.shutdown()
    with pytest.raises(StateError, match="shut down"):
        s.connect()


@pytest.mark.filterwarnings("ignore:ComplexHalf")
def test_bad_arguments_change_nothing():
    s = WeightSyncScheme("inproc")
    with pytest.raises(ValueError, match="exactly one"):
        s.init_on_sender(num_workers=1)
    with pytest.raises(ValueError, match="num_workers"):
        s.init_on_sender(model=make_policy(), num_workers=0)
    with pytest.raises(TypeError, match="nn.Module, a TensorDict or a state_dict"):
        s.init_on_sender(weights=[1, 2], num_workers=1)
    with pytest.raises(TypeError, match="dtype"):
        s.init_on_sender(weights={"x": torch.zeros(2, dtype=torch.complex32)}, num_workers=1)
    assert s.state == "new"
    with pytest.raises(ValueError, match="timeout"):
        WeightSyncScheme("inproc", timeout=-1)
    with pytest.raises(ValueError, match="strategy"):
        WeightSyncScheme("inproc", strategy="pickle")


@pytest.mark.parametrize("timeout", ["1", True, None])
def test_a_timeout_that_is_not_a_number_is_refused_by_name(timeout) -> None:
    """A string or a bool is not a number of seconds (True would read as 1 s): TypeError naming
    the timeout, at construction and on each call that takes one; the scheme keeps working."""
    if timeout is not None:  # (None on a call means "the scheme's timeout")
        s = WeightSyncScheme("inproc", timeout=5.0)
        s.init_on_sender(model=make_policy(), num_workers=1)
        r = pickle.loads(pickle.dumps(s))
        r.init_on_receiver(model=make_policy(), worker_idx=0)
        connecting = threading.Thread(target=r.connect)
        connecting.start()
        s.connect()
        connecting.join()
        try:
            for call in (lambda: s.send(timeout=timeout), lambda: r.receive(timeout=timeout)):
                with pytest.raises(TypeError, match="timeout must be a number of seconds"):
                    call()
            handle = s.send_async()
            assert r.receive(timeout=5.0) == 1 and handle.wait() == 1
        finally:
            r.shutdown()
            s.shutdown()
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        WeightSyncScheme("inproc", timeout=timeout)
