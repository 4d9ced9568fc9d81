"""Faults with real processes and real Gloo links: a worker SIGKILLed before, during or after a
send (its survivors are updated, only it is named, later sends work, a replacement joins under
its index), a worker stopped (SIGSTOP) and resumed, the sender SIGKILLed (every receiver's ``receive()`` returns or raises
TransportError in time, its model on the last version it applied), a worker whose model differs.

Each fault runs at 10 KiB or at a large size; the default run has one case per fault, ``--thorough``
the whole matrix (10 KiB, 16 MiB, 256 MiB).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from wsync_core import SchemaMismatchError, WeightSyncScheme, WorkerTimeoutError, free_port

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import send_versions, weights  # noqa: E402
from tail import Tail  # noqa: E402

#: model variants by size: 10 KiB, 16 MiB, 256 MiB
SIZES = {"10KiB": "kib10", "16MiB": "big16", "256MiB": "big256"}
#: the cases the default run keeps (the others need --thorough)
DEFAULT = {("before", "10KiB"), ("during", "16MiB"), ("after", "10KiB"), ("sender", "16MiB")}
#: seconds a worker may stay silent before the sender gives it up
HEARTBEAT = 1.5
#: the send's timeout: a dead worker must be named well within it
SEND_TIMEOUT = 30.0


def _case(request, when: str, size: str) -> str:
    if (when, size) not in DEFAULT and not request.config.getoption("wsync_thorough"):
        pytest.skip("runs only with --thorough")
    return SIZES[size]


def _sender(n: int, variant: str = "base", **options):
    scheme = WeightSyncScheme("distributed", timeout=90.0, heartbeat_timeout=HEARTBEAT, **options)
    w = weights(variant, 0.0)
    scheme.init_on_sender(weights=w, num_workers=n)
    return scheme, w


def _store(options: dict):
    """A client of the sender's store, as any process that reaches its port can open one."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.PrefixStore(options["prefix"], dist.TCPStore(options["host"], options["port"], None, False,
                                                             timedelta(seconds=10)))


def _fill(w: dict[str, torch.Tensor], v: int) -> None:
    for t in w.values():
        t.fill_(v)


def _kill(proc) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(30)


def _names_only(info: pytest.ExceptionInfo, dead: list[int], t0: float) -> None:
    assert isinstance(info.value, WorkerTimeoutError)
    assert info.value.workers == dead, info.value
    assert time.monotonic() - t0 < SEND_TIMEOUT + 10.0  # named by the timeout (slack: a noisy machine)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_a_killed_worker_is_named_alone_and_the_others_stay_updated(workers, request, when, size):
    """Worker 1 of 2 is SIGKILLed before, during or after a send: the send names it alone, worker
    0 holds that version, the scheme keeps working for worker 0 (a send to all names 1 again,
    a send to worker 0 succeeds), and a replacement started under index 1 joins and gets the
    newest version, after which a send to all succeeds (the default run checks the replacement
    in the "after" case only)."""
    variant = _case(request, when, size)
    scheme, w = _sender(2, variant)
    opts = scheme.transport.options
    config = {"options": opts, "variant": variant, "until": 4, "run_s": 180}
    procs = [workers({**config, "idx": i}) for i in range(2)]
    tails = [Tail(p) for p in procs]
    try:
        scheme.connect()
        _fill(w, 1)
        if when == "after":
            assert scheme.send(timeout=SEND_TIMEOUT) == 1
        if when == "before":
            _kill(procs[1])
        t0 = time.monotonic()
        if when == "during":
            handle = scheme.send_async()
            time.sleep(0.05)
            _kill(procs[1])
            try:  # it may have applied version 1 before it was killed (small sizes)
                handle.wait(SEND_TIMEOUT)
            except WorkerTimeoutError as exc:
                assert exc.workers == [1], exc
                assert time.monotonic() - t0 < SEND_TIMEOUT + 10.0
        elif when == "before":
            with pytest.raises(WorkerTimeoutError) as info:
                scheme.send(timeout=SEND_TIMEOUT)
            _names_only(info, [1], t0)
        tails[0].applied(1, 60)
        if when == "after":
            _kill(procs[1])
        _fill(w, 2)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:  # to all: worker 1 is named, worker 0 updated
            scheme.send(timeout=SEND_TIMEOUT)
        _names_only(info, [1], t0)
        tails[0].applied(2, 60)
        _fill(w, 3)
        assert scheme.send(worker_ids=[0], timeout=SEND_TIMEOUT) == 3
        survivors = [tails[0]]
        if when == "after" or request.config.getoption("wsync_thorough"):  # the default run: once
            survivors.append(Tail(workers({**config, "idx": 1})))  # joins under the dead one's index
            survivors[1].applied(3, 90)  # the newest version, at connect
            _fill(w, 4)
            assert scheme.send(timeout=SEND_TIMEOUT) == 4
        else:
            _fill(w, 4)
            assert scheme.send(worker_ids=[0], timeout=SEND_TIMEOUT) == 4
    finally:
        scheme.shutdown()
    for tail in survivors:
        lines = tail.lines()
        assert [line for line in lines if line["event"] == "error"] == []
        applied = [line for line in lines if line["event"] == "applied"]
        assert applied[-1]["version"] == 4 and applied[-1]["lo"] == applied[-1]["hi"] == 4.0, applied
    versions = [line["version"] for line in tails[0].lines() if line["event"] == "applied"]
    assert versions == sorted(set(versions)) and versions[-1] == 4, versions


@pytest.mark.parametrize("size", list(SIZES))
def test_a_killed_sender_ends_every_receive_in_time(workers, senders, request, size, tmp_path):
    """The sender (its own process, sending version after version) is SIGKILLed mid-send: each
    receiver's ``receive()`` returns or raises TransportError within its timeout (0.5 s, plus
    slack for a noisy machine) until the worker stops (on the first error, or after ``run_s``),
    and its model holds exactly the last version it applied."""
    variant = _case(request, "sender", size)
    opts = {"backend": "gloo", "port": free_port(), "heartbeat_timeout": HEARTBEAT}
    procs = [workers({"options": opts, "variant": variant, "idx": i, "until": 1 << 30, "run_s": 45,
                      "stacks": str(tmp_path / f"stacks{i}.txt")}) for i in range(2)]
    sender = senders({"options": opts, "variant": variant, "workers": 2})
    Tail(sender).wait_for(lambda line: line.get("version", 0) >= 2, 120)
    time.sleep(0.1)
    _kill(sender)
    killed = time.time()
    for i, p in enumerate(procs):
        try:
            p.proc.wait(120)
        except subprocess.TimeoutExpired:
            p.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            p.proc.kill()
            raise AssertionError(f"worker {i} still runs after its run_s (sender killed at {killed}); its lines: "
                                 f"{p.lines(30)}; its threads:\n" + (tmp_path / f"stacks{i}.txt").read_text()[-8000:]
                                 ) from None
    for p in procs:
        lines = p.lines()
        done = lines[-1]
        assert done["event"] == "done", lines
        errors = [line for line in lines if line["event"] == "error"]
        assert all(e["type"] == "TransportError" for e in errors), errors
        applied = [line for line in lines if line["event"] == "applied"]
        assert applied[-1]["version"] >= 2 and done["version"] == applied[-1]["version"], lines
        assert done["lo"] == done["hi"] == float(done["version"]), done  # never a half-written version
        assert done["slowest"] < 0.5 + 10.0, done


def test_a_stopped_worker_is_given_up_and_joins_again_when_it_resumes(workers):
    """Worker 1 of 2 is stopped (SIGSTOP: a hung process, a long pause) before a send: the send
    names it alone once its heartbeat has been silent for ``heartbeat_timeout``, worker 0 holds
    the version, later sends to worker 0 work; once worker 1 resumes (SIGCONT) it joins again by
    itself and ends on the newest version."""
    scheme, w = _sender(2, "kib10")
    config = {"options": scheme.transport.options, "variant": "kib10", "until": 3, "run_s": 120}
    procs = [workers({**config, "idx": i}) for i in range(2)]
    tails = [Tail(p) for p in procs]
    try:
        scheme.connect()
        procs[1].proc.send_signal(signal.SIGSTOP)
        _fill(w, 1)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=SEND_TIMEOUT)
        _names_only(info, [1], t0)
        tails[0].applied(1, 60)
        _fill(w, 2)
        assert scheme.send(worker_ids=[0], timeout=SEND_TIMEOUT) == 2
        procs[1].proc.send_signal(signal.SIGCONT)
        tails[1].applied(2, 60)
        _fill(w, 3)
        assert scheme.send(timeout=SEND_TIMEOUT) == 3
    finally:
        procs[1].proc.send_signal(signal.SIGCONT)
        scheme.shutdown()
    for tail in tails:
        applied = [line["version"] for line in tail.lines() if line["event"] == "applied"]
        assert applied == sorted(set(applied)) and applied[-1] == 3, applied


def test_a_heartbeat_key_written_by_someone_else_does_not_end_the_watch(workers):
    """The store takes anyone's writes (distributed has no auth): a heartbeat key set to something
    that is not a count ended the sender's watcher thread (an outside audit: int() of it, unchecked),
    and no silent worker was ever given up again. Now a stopped worker is named within its
    heartbeat_timeout as before, its key's value quoted."""
    import threading

    from wsync_distributed import wire

    scheme, w = _sender(1, "kib10")
    options = scheme.transport.options
    proc = workers({"options": options, "variant": "kib10", "until": 1, "run_s": 120, "idx": 0})
    try:
        scheme.connect()
        store = _store(options)
        store.set(wire.heartbeat_key(0), b"not-a-number")
        time.sleep(3 * HEARTBEAT)
        assert any(t.name == "wsync-distributed-watch" for t in threading.enumerate())
        proc.proc.send_signal(signal.SIGSTOP)
        _fill(w, 1)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=SEND_TIMEOUT)
        assert info.value.workers == [0] and time.monotonic() - t0 < SEND_TIMEOUT / 2, info.value
    finally:
        proc.proc.send_signal(signal.SIGCONT)
        scheme.shutdown()


def test_a_join_anyone_pushes_for_an_unused_index_does_not_stall_the_watch(workers):
    """The store takes anyone's writes: a JOIN pushed for an index no worker holds (worker 1 died,
    its heartbeat key deleted) made a lane whose heartbeat key never existed, and the sender's
    watch waited on it for the store's hour (an outside audit): no silent worker was given up
    again. Now that lane counts as silent ("no heartbeat key"), and a stopped worker 0 is named
    within its heartbeat_timeout as before."""
    import json

    from wsync_distributed import wire

    scheme, w = _sender(2, "kib10")
    options = scheme.transport.options
    config = {"options": options, "variant": "kib10", "until": 1000, "run_s": 120}
    procs = [workers({**config, "idx": i}) for i in range(2)]
    try:
        scheme.connect()
        _kill(procs[1])
        store = _store(options)
        store.delete_key(wire.heartbeat_key(1))
        join = json.dumps({"inbox": "f" * 32, "nbytes": scheme._role.layout.nbytes, "origin": ""}).encode()
        store.queue_push(wire.EVENTS, wire.encode_event(wire.JOIN, 1, join))
        time.sleep(HEARTBEAT / 2)  # (the sender reads it: its watch now has a lane with no key)
        procs[0].proc.send_signal(signal.SIGSTOP)
        _fill(w, 1)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=SEND_TIMEOUT)
        assert info.value.workers == [0, 1] and time.monotonic() - t0 < SEND_TIMEOUT / 2, info.value
    finally:
        procs[0].proc.send_signal(signal.SIGCONT)
        scheme.shutdown()


def test_a_flood_of_joins_costs_a_bounded_number_of_threads(workers):
    """The store takes anyone's writes: each JOIN pushed under a worker's index started a lane
    thread whose link set-up waited out the timeout for a peer that never came, with a store
    client and gloo's sockets each (an outside audit: a JOIN every 10 ms held 340 threads and
    2,800 descriptors). Now an index has at most 16 links in set-up at once (a newer join waits
    for one to end), so a bounded number of lane threads, and the other worker is updated
    throughout."""
    import json
    import threading

    from wsync_distributed import wire

    scheme, w = _sender(2, "kib10")
    options = scheme.transport.options
    config = {"options": options, "variant": "kib10", "until": 1000, "run_s": 120}
    for i in range(2):
        workers({**config, "idx": i})
    try:
        scheme.connect()
        store = _store(options)
        nbytes = scheme._role.layout.nbytes
        earlier = set(threading.enumerate())  # (a lane of an earlier test may still be ending)
        most = 0
        for i in range(200):
            join = json.dumps({"inbox": f"{i:032x}", "nbytes": nbytes, "origin": ""}).encode()
            store.queue_push(wire.EVENTS, wire.encode_event(wire.JOIN, 1, join))
            time.sleep(0.005)
            most = max(most, sum(t.name == "wsync-distributed-lane-1" and t not in earlier
                                 for t in threading.enumerate()))
            if i % 50 == 49:
                _fill(w, i // 50 + 1)
                assert scheme.send(worker_ids=[0], timeout=SEND_TIMEOUT) == i // 50 + 1
        assert most <= 20, f"{most} lane threads for worker 1 at once"  # 16 set-ups, the current lane, some ending
    finally:
        scheme.shutdown()


def test_garbage_in_a_links_rendezvous_keys_costs_that_link_not_the_worker(workers):
    """The store takes anyone's writes: a process that overwrites the gloo rendezvous keys of the
    next links with garbage made gloo raise MemoryError (std::bad_alloc), which ended the worker's
    receive thread for good (an outside audit: it never took another version). Now a link that
    fails so is a failed link: once the writes stop, the worker joins again and is updated."""
    import contextlib
    import threading


    from wsync_core import Deadline
    from wsync_core.transport import wait_listening

    scheme, w = _sender(1, "kib10")
    options = scheme.transport.options
    stop = threading.Event()

    def connect() -> None:
        with contextlib.suppress(WorkerTimeoutError):
            scheme.connect(timeout=8.0)

    connecting = threading.Thread(target=connect, daemon=True)
    connecting.start()  # (its store listens from the start)
    assert wait_listening(options["host"], options["port"], Deadline(30), lambda: False)
    store = _store(options)

    def garbage() -> None:
        keys = [f"pg/{n}//{d}/0" for n in range(1, 9) for d in range(2)]
        while not stop.is_set():
            store.multi_set(keys, [b"garbage"] * len(keys))

    writer = threading.Thread(target=garbage, daemon=True)
    writer.start()
    workers({"options": options, "variant": "kib10", "until": 3, "run_s": 120, "idx": 0, "timeout": 90.0})
    try:
        connecting.join(30)
        stop.set()
        writer.join(10)
        sent = None
        deadline = time.monotonic() + 60.0
        while sent is None and time.monotonic() < deadline:
            _fill(w, 1)
            with contextlib.suppress(WorkerTimeoutError):
                sent = scheme.send(timeout=10.0)
        assert sent is not None, "the worker was never updated again once the garbage stopped"
    finally:
        stop.set()
        scheme.shutdown()


@pytest.mark.parametrize("variant", ["other"])
def test_schema_mismatch_raises_on_both_sides(workers, variant):
    scheme, _ = _sender(1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "variant": variant, "timeout": 60.0})
    try:
        with pytest.raises(SchemaMismatchError, match="a"):
            scheme.connect()
    finally:
        scheme.shutdown()
    errors = [line for line in proc.lines() if line["event"] == "error"]
    assert errors and errors[0]["type"] == "SchemaMismatchError", errors


def test_nccl_path(workers):
    """NCCL: CUDA buffers on both sides (one GPU per rank), a streamed snapshot, the model adopting
    the receive buffer on its own device."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs one GPU per rank; this machine has {torch.cuda.device_count()}")
    scheme = WeightSyncScheme("distributed", timeout=120.0, backend="nccl", bucket_mb=1)
    w = {k: t.to("cuda:0") for k, t in weights("mixed4", 0.0).items()}
    scheme.init_on_sender(weights=w, num_workers=1)
    proc = workers({"options": scheme.transport.options, "idx": 0, "variant": "mixed4", "device": "cuda:1",
                    "until": 2, "timeout": 120.0})
    applied = send_versions(scheme, w, proc, [1, 2])
    assert [line["version"] for line in applied] == [0, 1, 2], applied
    assert [(line["lo"], line["hi"]) for line in applied[1:]] == [(1.0, 1.0), (2.0, 2.0)]
