"""Receivers on other "hosts": network namespaces on a bridge with this process (root only). One
receiver gets versions across the bridge; one whose link is cut mid-send is named within the
send's timeout while the other is updated, and once its link is back it joins again and gets the
newest version; one shut down while its link is cut stops within seconds."""

from __future__ import annotations

import os
import sys
import time

import pytest
from wsync_conformance import netns
from wsync_core import WeightSyncScheme, WorkerTimeoutError

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import send_versions, weights  # noqa: E402
from tail import Tail  # noqa: E402

#: seconds a worker may stay silent before the sender gives it up
HEARTBEAT = 1.5
#: the send's timeout: a cut-off worker must be named well within it
SEND_TIMEOUT = 30.0
#: seconds a worker's receive(timeout=0.5) may take beyond its timeout on a loaded machine
RECEIVE_SLACK = 3.5


def _hosts(n: int):
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    return netns.hosts(n, local=True)


@pytest.fixture
def hosts():
    """This process (the sender) and a namespace (the receiver) on one bridge."""
    with _hosts(2) as pair:
        yield pair


def test_receiver_in_another_namespace(hosts, workers):
    here, there = hosts
    scheme = WeightSyncScheme("distributed", timeout=90.0, host=here.address, backend="gloo")
    w = weights("base", 0.0)
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "until": 2}, prefix=there.prefix)
    applied = send_versions(scheme, w, proc, [1, 2])
    assert [line["version"] for line in applied] == [0, 1, 2]
    assert applied[-1]["sum"] == 2.0 * 32


@pytest.mark.parametrize("size", ["64MiB", "256MiB"])
def test_a_cut_link_is_named_in_time_and_rejoins_once_restored(workers, request, size):
    """Worker 1's link goes down (no reset reaches anyone) right after a send of ``size`` starts:
    that send (or the next, if worker 1 had it already) names worker 1 alone within its timeout,
    worker 0 holds the version; once the link is back (after 9 s: long enough for worker 1's
    store clients to fail), worker 1 joins again by itself and gets the newest version, and sends
    to both succeed (its acks reach the sender again). Neither worker's ``receive(timeout=0.5)``
    overran its timeout meanwhile, and neither left a thread at shutdown."""
    if size != "64MiB" and not request.config.getoption("wsync_thorough"):
        pytest.skip("runs only with --thorough")
    variant = f"big{size[:-3]}"
    with _hosts(3) as (here, a, b):
        scheme = WeightSyncScheme("distributed", timeout=90.0, host=here.address, backend="gloo",
                                  heartbeat_timeout=HEARTBEAT)
        w = weights(variant, 0.0)
        scheme.init_on_sender(weights=w, num_workers=2)
        config = {"options": scheme.transport.options, "variant": variant, "until": 4, "run_s": 180,
                  "keep_going": True}  # receive() raises TransportError while the sender is out of reach
        tails = [Tail(workers({**config, "idx": i}, prefix=host.prefix)) for i, host in enumerate((a, b))]
        try:
            scheme.connect()
            w["w"].fill_(1.0)
            handle = scheme.send_async()
            b.cut()
            t0 = time.monotonic()
            named = None
            try:
                handle.wait(SEND_TIMEOUT)
            except WorkerTimeoutError as exc:
                named = exc
            tails[0].applied(1, 60)
            if named is None:  # worker 1 had version 1 before its link went down: the next send names it
                w["w"].fill_(2.0)
                t0 = time.monotonic()
                with pytest.raises(WorkerTimeoutError) as info:
                    scheme.send(timeout=SEND_TIMEOUT)
                named = info.value
                tails[0].applied(2, 60)
            assert named.workers == [1], named
            assert time.monotonic() - t0 < SEND_TIMEOUT + 10.0
            newest = scheme.version
            # down long enough for every idle store client of worker 1 to fail (its ack client too,
            # which was never replaced: acks failed for good, every later send waited out its timeout)
            time.sleep(max(0.0, t0 + 6 * HEARTBEAT - time.monotonic()))
            b.restore()
            tails[1].applied(newest, 120)  # joined again by itself, got the newest version
            while scheme.version < 4:  # to both
                w["w"].fill_(float(scheme.version + 1))
                assert scheme.send(timeout=SEND_TIMEOUT) == scheme.version
        finally:
            b.restore()
            scheme.shutdown()
        for tail in tails:
            lines = tail.lines()
            applied = [line for line in lines if line["event"] == "applied"]
            assert applied[-1]["version"] == 4 and applied[-1]["lo"] == applied[-1]["hi"] == 4.0, applied
            versions = [line["version"] for line in applied]
            assert versions == sorted(set(versions)), versions
            # every receive(timeout=0.5) returned in time (worker 1's took 5.5 s while its link was
            # cut: the probe of the sender's newest version waited for TCP to give up on the link),
            # and its shutdown left no thread (the abort of the link that failed was left running)
            done = next(line for line in lines if line["event"] == "done")
            assert done["slowest"] < 0.5 + RECEIVE_SLACK and done["threads"] == [], done


def test_a_receiver_shut_down_while_its_link_is_cut_stops_in_seconds(workers):
    """A worker whose link to the sender is down shuts down within a few heartbeats and leaves no
    thread. It took 130 s and left two (with ``timeout=60``): its threads' calls to the sender's
    store waited on the dead link for TCP to give up, which store timeouts do not bound; the
    store's sockets now fail once the link is silent for about ``heartbeat_timeout``."""
    with _hosts(2) as (here, there):
        scheme = WeightSyncScheme("distributed", timeout=30.0, host=here.address, backend="gloo",
                                  heartbeat_timeout=HEARTBEAT)
        w = weights("base", 0.0)
        scheme.init_on_sender(weights=w, num_workers=1)
        tail = Tail(workers({"options": scheme.transport.options, "idx": 0, "until": 99, "run_s": 6.0,
                             "timeout": 30.0, "keep_going": True}, prefix=there.prefix))
        try:
            scheme.connect()
            tail.applied(0, 60)
            there.cut()  # its run ends a few seconds later, with the link still down
            done = tail.wait_for(lambda line: line["event"] == "done", 120)
        finally:
            there.restore()
            scheme.shutdown()
        assert done["shutdown_s"] < 4 * HEARTBEAT + 5.0 and done["threads"] == [], done


@pytest.mark.parametrize("down_s", [0.0, 4 * HEARTBEAT])
def test_a_receive_of_a_version_that_waited_returns_in_time_while_the_link_is_cut(workers, tmp_path, down_s):
    """A worker that holds version 1 (it calls no ``receive()``) while version 2 reaches it, then
    resumes ``down_s`` after its link was cut: its ``receive(timeout=0.5)`` applies version 2
    exactly and returns it within its timeout. It took 5.5 s (its question to the sender's store
    about the newest version waited for TCP to give up on the link); after a cut long enough for
    its store clients to fail, it raised TransportError once version 2 was applied (the ack,
    pushed in the call, found its client dead and waited for a new connection)."""
    go = tmp_path / "go"
    with _hosts(2) as (here, there):
        scheme = WeightSyncScheme("distributed", timeout=30.0, host=here.address, backend="gloo",
                                  heartbeat_timeout=HEARTBEAT)
        w = weights("kib8", 0.0)
        scheme.init_on_sender(weights=w, num_workers=1)
        tail = Tail(workers({"options": scheme.transport.options, "variant": "kib8", "idx": 0, "until": 2,
                             "run_s": 120, "keep_going": True, "hold": {"at": 1, "file": str(go)}}, prefix=there.prefix))
        try:
            scheme.connect()
            w["w"].fill_(1.0)
            assert scheme.send(timeout=SEND_TIMEOUT) == 1
            w["w"].fill_(2.0)
            handle = scheme.send_async()
            time.sleep(2.0)  # version 2 reaches the worker's buffers (a few KiB over the bridge)
            there.cut()
            time.sleep(down_s)
            go.touch()
            applied = tail.applied(2, 60)
            there.restore()
            done = tail.wait_for(lambda line: line["event"] == "done", 120)
            try:  # (its ack may reach the sender once the link is back, or be given up)
                handle.wait(SEND_TIMEOUT)
            except WorkerTimeoutError:
                pass
        finally:
            there.restore()
            scheme.shutdown()
    assert applied["lo"] == applied["hi"] == 2.0, applied
    assert done["slowest"] < 0.5 + RECEIVE_SLACK, done
