"""The suite's own parts: option parsing, version classification, models, pickle inspection,
the runner pool, network namespaces, the watchdog."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from wsync_core import WeightSyncScheme
from wsync_core.transport import parse_options
from wsync_core.weights import flatten

from wsync_conformance import harness, netns
from wsync_conformance.context import classify
from wsync_conformance.models import build, digests, fill, random_values, rich_spec, version_spec
from wsync_conformance.portable import inspect_pickle
from wsync_conformance.strategies import model_specs
from wsync_conformance.target import Target


def test_parse_options() -> None:
    assert parse_options(["a=1", "b=0.5", "c=true", "d=None", "e=loopback", "f=x=y"]) == {
        "a": 1, "b": 0.5, "c": True, "d": None, "e": "loopback", "f": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options(["novalue"])
    # quoted: the string inside, whatever it reads as (a numeric authkey or shm name)
    assert parse_options(["authkey='12345'", 'name="true"', "q='", "r=''"]) == {
        "authkey": "12345", "name": "true", "q": "'", "r": ""}


def test_a_timeout_must_be_seconds_above_zero_and_an_unknown_option_is_named() -> None:
    import argparse

    from wsync_conformance.target import seconds

    assert seconds("2.5") == 2.5
    for bad in ("-5", "0", "nan", "inf", "abc"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds > 0"):
            seconds(bad)
    with pytest.raises(ValueError, match="has no option 'nosuch'; its options are channel, checksum"):
        Target("inproc", {"nosuch": 1}).make()


def test_target_accepts_names_classes_objects_and_factories() -> None:
    from wsync_core.inproc import InprocTransport

    for spec in ("inproc", "wsync_core.inproc:InprocTransport", InprocTransport, lambda **kw: InprocTransport(**kw)):
        t = Target(spec, {"checksum": True})
        assert isinstance(t.make(), InprocTransport) and t.make().checksum
        assert t.capabilities == InprocTransport.capabilities
    obj = InprocTransport()
    assert Target(obj).make() is obj


def test_classify() -> None:
    expected = {1: {"a": "x1", "b": "y1"}, 2: {"a": "x2", "b": "y2"}}
    assert classify({"a": "x2", "b": "y2"}, expected) == ("match", 2)
    assert classify({"a": "x2", "b": "y1"}, expected)[0] == "mixed"
    assert classify({"a": "zz", "b": "y1"}, expected) == ("unknown", ["a"])


@settings(max_examples=25, deadline=None)
@given(spec=model_specs())
def test_models_round_trip_exactly(spec) -> None:
    """A sender model (views, shared storage, ties) and a receiver model of one spec share a
    layout, and copying values makes their digests equal."""
    sender, receiver = build(spec, sender=True), build(spec)
    assert sorted(flatten(sender)) == sorted(flatten(receiver)) == sorted(t.key for t in spec.tensors)
    fill(sender, random_values(spec, 3))
    fill(receiver, {k: v.clone() for k, v in flatten(sender).items()})
    assert digests(sender) == digests(receiver)


def test_rich_spec_has_every_kind_of_tensor() -> None:
    spec = rich_spec("module", 1)
    model = build(spec, sender=True)
    tensors = flatten(model)
    assert {t.dtype for t in tensors.values()} >= {torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                                   torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool}
    assert any(t.dim() == 0 for t in tensors.values()) and any(t.numel() == 0 for t in tensors.values())
    assert any(not t.is_contiguous() for t in tensors.values())
    assert tensors["head.weight"] is not None and model.head.weight is model.head.tied_weight


def test_inspect_pickle_finds_forbidden_objects() -> None:
    assert inspect_pickle(WeightSyncScheme("inproc"))["forbidden"] == []
    assert "torch.Tensor" in inspect_pickle({"t": torch.zeros(2)})["forbidden"]
    assert inspect_pickle(threading.Lock())["pickle_error"]
    assert pickle.loads(pickle.dumps(WeightSyncScheme("inproc"))).version == -1


def test_trusted_runtime_allows_only_its_own_modules() -> None:
    from wsync_conformance.report import format_table
    from wsync_conformance.trust import trusted_runtime, untrusted_unpickling

    class Plain:
        pass

    class OnRay:
        trusted_runtime = ("ray", "Ray carries its own references")

    class Broken:
        trusted_runtime = ("ray",)

    assert trusted_runtime(Plain) is None
    assert trusted_runtime(OnRay) == ("ray", "Ray carries its own references")
    with pytest.raises(TypeError):
        trusted_runtime(Broken)
    events = [["ray._private.serialization", "_object_ref_deserializer"], ["ray", "ObjectRef"],
              ["rayx", "Evil"], ["builtins", "eval"],
              ["builtins", "type", "ray._private.function_manager:_load_actor_class_from_gcs"],  # Ray's own code
              ["builtins", "eval", "wsync_ray.endpoints:recv"], ["builtins", "eval", "rayx.evil:load"]]
    assert untrusted_unpickling(events, None) == events
    assert untrusted_unpickling(events, trusted_runtime(OnRay)) == [
        ["rayx", "Evil"], ["builtins", "eval"], ["builtins", "eval", "wsync_ray.endpoints:recv"],
        ["builtins", "eval", "rayx.evil:load"]]
    table = format_table({}, "header", ["processes"], trusted=trusted_runtime(OnRay))
    assert table.splitlines()[-1] == "trusted runtime: ray (Ray carries its own references)"
    assert "trusted runtime" not in format_table({}, "header", ["processes"])


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_hosts_reaps_what_a_killed_process_left_and_never_takes_a_subnet_in_use() -> None:
    """A process killed inside ``hosts(local=True)`` leaves its link and route behind; while they
    are there no new local host gets that subnet, and the next ``hosts`` deletes them."""
    code = ("import os\nfrom wsync_conformance import netns\n"
            "with netns.hosts(2, local=True) as made:\n    print(made[0].address, flush=True)\n    os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    left = out.stdout.split()[0].rsplit(".", 1)[0]
    assert f"inet {left}." in _addresses(), "the killed process left no link behind: nothing tested"
    assert netns._free_subnet(int(left.rsplit(".", 1)[1])) != left
    with netns.hosts(2, local=True) as (here, there):
        assert f"inet {left}." not in _addresses(), "the dead process's link was not deleted"
        with socket.socket() as server:
            server.bind((here.address, 0))
            server.listen()
            probe = f"import socket; socket.create_connection(({here.address!r}, {server.getsockname()[1]}), timeout=20)"
            assert there.run([sys.executable, "-c", probe]).wait(60) == 0


def _addresses() -> str:
    return subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.parametrize("leaves_a_listener", [False, True])
def test_a_runner_goes_back_to_the_pool_only_as_it_came(leaves_a_listener: bool, monkeypatch) -> None:
    """release() pools a runner whose session closed cleanly, and kills one still listening on a
    socket after its session closed (a later test would count that socket as its transport's)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the runner, spawned now, imports wsync_broken
    from wsync_broken import ListenerLeft
    from wsync_tcp import TcpTransport

    spec = version_spec()
    scheme = WeightSyncScheme(ListenerLeft() if leaves_a_listener else TcpTransport(), timeout=30.0)
    scheme.init_on_sender(model=build(spec), num_workers=1)
    w = harness.Worker(kind="spawn")
    try:
        w.open(scheme, spec, "cpu", 0)
        harness.release([w])
        assert w.alive() is not leaves_a_listener
        assert (w in harness._pool["spawn"]) is not leaves_a_listener
    finally:
        scheme.shutdown()
        if w in harness._pool["spawn"]:
            harness._pool["spawn"].remove(w)
        w.kill()


def test_a_runner_of_a_trusted_runtime_keeps_only_the_runtimes_listeners(monkeypatch) -> None:
    """A transport with a trusted runtime (Ray's processes listen for as long as they live): the
    runner goes back to the pool listening on what it listened on at its first close, and is
    killed once it listens on anything more."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from wsync_broken import RuntimeListens  # a listener more at each session: the first is the "runtime's"

    spec = version_spec()
    w = harness.Worker(kind="spawn")
    try:
        for session, pooled in ((1, True), (2, False)):
            scheme = WeightSyncScheme(RuntimeListens(), timeout=30.0)
            scheme.init_on_sender(model=build(spec), num_workers=1)
            try:
                w.open(scheme, spec, "cpu", 0)
                harness.release([w])
            finally:
                scheme.shutdown()
            assert (w in harness._pool["spawn"]) is pooled, f"session {session}"
            assert w.alive() is pooled, f"session {session}"
            if pooled:
                harness._pool["spawn"].remove(w)
    finally:
        if w in harness._pool["spawn"]:
            harness._pool["spawn"].remove(w)
        w.kill()


_HANG_IN_TEARDOWN = '''
import time

import pytest
from wsync_conformance import TransportSuite


class TestHang(TransportSuite):
    transport = "inproc"
    timeout = 0.5

    @pytest.fixture
    def stuck(self):
        yield
        time.sleep(60)  # interrupted by the watchdog's Hung, a BaseException

    def test_hangs_in_teardown(self, stuck) -> None:
        pass

    def test_runs_after_the_hang(self) -> None:
        time.sleep(4)  # longer than the watchdog's grace: a watchdog left running ends the process

    def test_fails_and_is_reported_slowly(self) -> None:
        assert False, "fails"
'''

_SLOW_REPORT = '''
import time


def pytest_runtest_makereport(item, call):
    if call.when == "call" and item.name == "test_fails_and_is_reported_slowly":
        time.sleep(4)  # as formatting a failure can take on a loaded machine: past the test's budget
'''


def _run_hang_file(tmp_path: Path, selection: str) -> tuple[int, str]:
    """Run the tests of ``tmp_path/test_hang.py`` that ``-k selection`` picks, in a pytest of their
    own with a short budget and grace; its exit status and output."""
    env = dict(os.environ, WSYNC_CONFORMANCE_WORK="1", WSYNC_CONFORMANCE_GRACE="0.5")
    proc = subprocess.run([sys.executable, "-m", "pytest", "test_hang.py", "-p", "no:cacheprovider", "-rA",
                           "-k", selection], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_hang_in_a_fixtures_teardown_stops_the_watchdog_with_the_test(tmp_path: Path) -> None:
    """A Hung raised in one fixture's teardown makes pytest skip the finalizers after it, the
    budget's own among them: the watchdog still stops when the test's teardown ends, so the next
    test runs to its end instead of the process ending with the hung status."""
    (tmp_path / "test_hang.py").write_text(_HANG_IN_TEARDOWN)
    returncode, out = _run_hang_file(tmp_path, "hangs_in_teardown or runs_after_the_hang")
    assert returncode == 1, out[-4000:]
    assert "ERROR test_hang.py::TestHang::test_hangs_in_teardown" in out and "ran past its budget" in out, out[-4000:]
    assert "PASSED test_hang.py::TestHang::test_runs_after_the_hang" in out, out[-4000:]


def test_the_watchdog_neither_counts_nor_interrupts_the_making_of_a_report(tmp_path: Path) -> None:
    """pytest formats a failure (reading source files) after the test's call: on a loaded machine
    that took long enough for the budget to run out, and the Hung raised inside pytest's
    report hooks was an internal error (exit status 3, in CI: a tooth's run failed so). Now the
    report's making does not count, and the test fails as it failed."""
    (tmp_path / "test_hang.py").write_text(_HANG_IN_TEARDOWN)
    (tmp_path / "conftest.py").write_text(_SLOW_REPORT)
    returncode, out = _run_hang_file(tmp_path, "fails_and_is_reported_slowly")
    assert returncode == 1 and "INTERNALERROR" not in out, out[-4000:]
    assert "FAILED test_hang.py::TestHang::test_fails_and_is_reported_slowly" in out, out[-4000:]
