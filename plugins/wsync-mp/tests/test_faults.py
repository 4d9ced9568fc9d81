"""mp under faults: killed workers and senders, every start method, hostile peers, no unpickling."""

from __future__ import annotations

import array
import fcntl
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsync_conformance import harness
from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError

sys.path.insert(0, str(Path(__file__).parent))

import mp_fault_workers as fw  # noqa: E402
from wsync_core.framing import PREFIX  # noqa: E402
from wsync_core.memory import SEALS  # noqa: E402
from wsync_core.protocol import Ack  # noqa: E402
from wsync_mp.wire import FRAMING, NONCE_BYTES, Kind, mac  # noqa: E402

TIMEOUT = 60.0


class Pool:
    """Processes of one start method, always killed and joined at the end of a test.

    Each process reports on its own queue: a process killed while it writes to a shared queue
    would leave that queue's lock held and hang everyone else's reports.
    """

    def __init__(self, method: str = "spawn") -> None:
        self.method = method
        self.ctx = multiprocessing.get_context(method)
        self.stop = self.ctx.Event()
        self.queues: list = []
        self.procs: list = []
        self.pids: list[int] = []

    def queue(self):
        self.queues.append(self.ctx.Queue())
        return self.queues[-1]

    def start(self, target, *args):
        proc = harness.start_process(target, *args, kind=self.method)  # dies with the test run
        self.procs.append(proc)
        return proc

    def worker(self, blob: bytes, worker: int, audit: bool = False):
        """Start receiver ``worker``; returns (process, its report queue)."""
        out = self.queue()
        return self.start(fw.receiver, blob, worker, out, self.stop, audit), out

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for q in self.queues:
            q.close()
            q.join_thread()


def expect(out, kind: str, timeout: float = TIMEOUT) -> tuple:
    """The next report of ``kind`` on ``out``; fails on a worker's error report."""
    end = time.monotonic() + timeout
    while True:
        item = out.get(timeout=max(0.1, end - time.monotonic()))
        if item[0] == kind:
            return item
        if item[0] == "error":
            raise AssertionError(f"a worker failed: {item}")


@pytest.fixture
def pool():
    pools: list[Pool] = []

    def make(method: str = "spawn") -> Pool:
        pools.append(Pool(method))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


@pytest.fixture
def sender_scheme():
    schemes: list[WeightSyncScheme] = []

    def make(num_workers: int = 2, **options) -> tuple[WeightSyncScheme, dict]:
        scheme = WeightSyncScheme("mp", timeout=TIMEOUT, **options)
        model = fw.make_model()
        scheme.init_on_sender(weights=model, num_workers=num_workers)
        schemes.append(scheme)
        return scheme, model

    yield make
    for s in schemes:
        s.shutdown()


def _fill(model: dict, version: int) -> None:
    for t in model.values():
        t.fill_(version)


def _latest(outs: list, version: int) -> list[int]:
    """Read each worker's reports until it reported ``version``; checks no model was ever mixed."""
    seen = []
    for out in outs:
        v = -1
        while v < version:
            _, w, v, held = expect(out, "v")
            assert held == v, f"worker {w} applied version {v} but its model holds {held}"
        seen.append(v)
    return seen


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_start_methods(method, pool, sender_scheme):
    """Workers started with each start method get exact copies of every version."""
    scheme, model = sender_scheme()
    p = pool(method)
    blob = pickle.dumps(scheme)
    outs = [p.worker(blob, w)[1] for w in range(2)]
    scheme.connect()
    _latest(outs, 0)
    for v in (1, 2, 3):
        _fill(model, v)
        assert scheme.send() == v
        _latest(outs, v)


def test_sigkilled_receiver(pool, sender_scheme):
    """The next send fails fast naming the killed worker, the other is updated, later sends work."""
    scheme, model = sender_scheme()
    p = pool()
    blob = pickle.dumps(scheme)
    (_, out), (victim, _) = [p.worker(blob, w) for w in range(2)]
    scheme.connect()
    _latest([out], 0)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(TIMEOUT)
    _fill(model, 1)
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        scheme.send(timeout=TIMEOUT)
    assert info.value.workers == [1]
    assert time.monotonic() - t0 < TIMEOUT / 2, "a SIGKILLed worker should be noticed at once, not at the timeout"
    assert _latest([out], 1) == [1]
    _fill(model, 2)
    assert scheme.send(worker_ids=[0]) == 2
    assert _latest([out], 2) == [2]


@pytest.mark.parametrize("fork_sleeper", [False, True], ids=["plain", "forked-child-alive"])
def test_sigkilled_sender(fork_sleeper, pool):
    """Receivers keep their last good version; receive raises TransportError promptly, once, then
    returns None; a sender started again from the same options (a new process: the same address
    and authkey) is found by the worker by itself, whose model then holds exactly its versions,
    numbered from 0 again (a child the first forked, still alive, holds nothing of it)."""
    scheme = WeightSyncScheme("mp", timeout=TIMEOUT)
    blob = pickle.dumps(scheme)
    p = pool()
    commands = p.ctx.Queue()
    out = p.queue()
    proc = p.start(fw.sender, blob, out, commands, fork_sleeper)
    model = fw.make_model(-1)
    scheme.init_on_receiver(model=model, worker_idx=0)
    try:
        scheme.connect()
        if fork_sleeper:
            p.pids.append(expect(out, "sleeper")[1])
        commands.put(1)
        assert scheme.receive(timeout=TIMEOUT) == 1
        assert expect(out, "sent")[1] == 1
        os.kill(proc.pid, signal.SIGKILL)
        end = time.monotonic() + TIMEOUT
        while proc.is_alive() and time.monotonic() < end:  # reaps it; join() would wait for the
            time.sleep(0.02)  # sentinel pipe, which the forked child still holds open
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="without a goodbye.*connects to a sender started again"):
            scheme.receive(timeout=TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT / 2
        assert scheme.receive(timeout=0.5) is None
        assert fw.version_of(model) == 1 and scheme.version == 1
        again, out = p.queue(), p.queue()  # (the killed one may have died holding its queues' locks)
        second = p.start(fw.sender, blob, out, again, False)
        for version, value in ((0, 0), (1, 7)):  # its connect() (its version 0), then a send
            if version:
                again.put(value)
            end = time.monotonic() + TIMEOUT
            while scheme.version != version and time.monotonic() < end:
                scheme.receive(timeout=0.5)
            assert scheme.version == version and fw.version_of(model) == value
        assert expect(out, "sent")[1] == 1
        second.kill()  # (it waits for commands: the pool would wait 10 s for it to stop)
    finally:
        scheme.shutdown()
        commands.close()
        commands.join_thread()


def test_clean_sender_shutdown_returns_none():
    """After the sender shuts down cleanly, receive returns None (nothing new will come)."""
    scheme = WeightSyncScheme("mp", timeout=TIMEOUT)
    model = fw.make_model()
    sender = pickle.loads(pickle.dumps(scheme))
    sender.init_on_sender(weights=model, num_workers=1)
    thread = threading.Thread(target=sender.connect)
    thread.start()
    scheme.init_on_receiver(model=fw.make_model(5), worker_idx=0)
    try:
        scheme.connect()
        thread.join(TIMEOUT)
        sender.shutdown()
        assert scheme.receive(timeout=0.5) is None
        assert scheme.version == 0
    finally:
        sender.shutdown()
        scheme.shutdown()


def test_nothing_unpickled_in_receivers(pool, sender_scheme):
    """No pickle.find_class runs in a receiver while it connects and receives."""
    scheme, model = sender_scheme(num_workers=1)
    p = pool()
    _, out = p.worker(pickle.dumps(scheme), 0, audit=True)
    scheme.connect()
    for v in (1, 2):
        _fill(model, v)
        scheme.send()
    _latest([out], 2)
    p.stop.set()
    assert expect(out, "audit")[2] == []


# -- hostile peers ------------------------------------------------------------------------------
def _raw_connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(b"\0" + address[1:].encode())
    except OSError:
        sock.close()
        raise
    return sock


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,
    PREFIX.pack(b"WSMP", Kind.RESPONSE, 0, 0, 2**31, 0),    # oversized
    PREFIX.pack(b"WSMP", Kind.ACK, 0, 0, 10, 0) + b"0123456789",  # ack before authenticating
    PREFIX.pack(b"WSMP", Kind.RESPONSE, 0, 0, 64, 0) + b"\0" * 64,  # wrong key
], ids=["not-wsync", "oversized", "out-of-order", "wrong-key"])
def test_sender_drops_hostile_clients(garbage, pool, sender_scheme):
    """A local client that does not authenticate is dropped and never becomes a worker."""
    scheme, model = sender_scheme(num_workers=1)
    p = pool()
    _, out = p.worker(pickle.dumps(scheme), 0)
    scheme.connect()
    _latest([out], 0)
    hostile = _raw_connect(scheme.transport.options["address"])
    try:
        assert PREFIX.unpack(hostile.recv(PREFIX.size))[1] == Kind.CHALLENGE
        hostile.sendall(garbage + FRAMING.encode(Kind.HELLO, arg=0))
        hostile.settimeout(TIMEOUT)
        while hostile.recv(1 << 16):  # the sender closes the connection
            pass
    except ConnectionResetError:
        pass
    finally:
        hostile.close()
    _fill(model, 1)
    assert scheme.send() == 1  # the real worker 0 was not displaced
    assert _latest([out], 1) == [1]


def test_a_flood_of_unfinished_handshakes_is_bounded_and_workers_join_meanwhile(pool, sender_scheme):
    """A local process opens connections that never answer the challenge (the address is listed in
    /proc/net/unix, no authkey needed): the sender keeps at most _MAX_HANDSHAKING of them, dropping
    the oldest, and goes on serving, a worker joining in the middle of the flood included. It kept
    every one (an outside audit: out of descriptors, its I/O thread ended, every worker was lost)."""
    from wsync_mp.sender import _MAX_HANDSHAKING

    scheme, model = sender_scheme(num_workers=2)
    address = scheme.transport.options["address"]
    connecting = threading.Thread(target=scheme.connect)  # listens, then waits for both workers
    connecting.start()
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(flood) < 3 * _MAX_HANDSHAKING:
            try:
                flood.append(_raw_connect(address))
            except OSError:  # not listening yet, or its backlog full: the sender accepts in its own time
                assert time.monotonic() < deadline, f"the sender stopped accepting after {len(flood)} connections"
                time.sleep(0.01)
        for s in flood:
            s.settimeout(TIMEOUT)
        closed = 0
        for s in flood[:2 * _MAX_HANDSHAKING]:  # the oldest: dropped once newer ones came
            try:
                while s.recv(1 << 16):
                    pass
            except ConnectionResetError:
                pass
            closed += 1
        assert closed == 2 * _MAX_HANDSHAKING
        p = pool()
        outs = [p.worker(pickle.dumps(scheme), w)[1] for w in (0, 1)]
        connecting.join(TIMEOUT * 2)
        assert not connecting.is_alive() and _latest(outs, 0) == [0, 0]
        _fill(model, 1)
        assert scheme.send() == 1 and _latest(outs, 1) == [1, 1]
    finally:
        for s in flood:
            s.close()
        connecting.join(TIMEOUT * 2)


def test_sender_drops_a_worker_that_probes_without_reading(pool, sender_scheme):
    """An authenticated worker that floods probes and never reads the answers is dropped once its
    queue holds _MAX_QUEUED frames; the sender's memory stays bounded and the others keep being updated."""
    scheme, model = sender_scheme(num_workers=2, authkey="probe-flood")
    p = pool()
    _, out = p.worker(pickle.dumps(scheme), 0)
    connecting = threading.Thread(target=scheme.connect)  # it listens, then waits for both workers
    connecting.start()
    end = time.monotonic() + TIMEOUT
    while True:
        try:
            hostile = _raw_connect(scheme.transport.options["address"])
            break
        except ConnectionRefusedError:
            assert time.monotonic() < end, "the sender never listened"
            time.sleep(0.05)
    try:
        hostile.settimeout(TIMEOUT)
        challenge = hostile.recv(PREFIX.size + NONCE_BYTES, socket.MSG_WAITALL)[PREFIX.size:]
        nonce = os.urandom(NONCE_BYTES)
        hostile.sendall(FRAMING.encode(Kind.RESPONSE, mac(b"probe-flood", b"receiver", challenge) + nonce)
                        + FRAMING.encode(Kind.HELLO, arg=1)
                        + FRAMING.encode(Kind.ACK, Ack(1, 0).encode()))  # it "holds" version 0
        connecting.join(TIMEOUT)
        assert not connecting.is_alive()
        _latest([out], 0)
        flood = FRAMING.encode(Kind.PROBE, arg=1) * 4096
        with pytest.raises(OSError):  # the sender drops it: a reset, or a full buffer never drained
            for _ in range(64):  # 256 Ki probes: their answers far exceed the socket's buffer
                hostile.sendall(flood)
    finally:
        hostile.close()
    _fill(model, 1)
    with pytest.raises(WorkerTimeoutError) as raised:
        scheme.send()
    assert raised.value.workers == [1]
    assert _latest([out], 1) == [1]


class FakeSender:
    """A hostile sender on an address: authenticates properly, then sends what the test says."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(b"\0" + address[1:].encode())
        self.listener.listen(1)
        self.listener.settimeout(TIMEOUT)
        self.authkey = authkey
        self.conn: socket.socket | None = None

    def accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(TIMEOUT)
        nonce = os.urandom(NONCE_BYTES)
        self.conn.sendall(FRAMING.encode(Kind.CHALLENGE, nonce))
        data = b""
        while len(data) < 2 * PREFIX.size + 2 * NONCE_BYTES:
            data += self.conn.recv(4096)
        response = next(FRAMING.reader("test", frozenset({Kind.RESPONSE})).feed(data[:PREFIX.size + 2 * NONCE_BYTES]))
        assert response.body[:NONCE_BYTES] == mac(self.authkey, b"receiver", nonce)
        self.conn.sendall(FRAMING.encode(Kind.PROOF, mac(self.authkey, b"sender", response.body[NONCE_BYTES:])))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def _fd_frame(conn: socket.socket, frame: bytes, size: int, sealed: bool) -> None:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        os.close(fd)


@pytest.mark.parametrize("attack", ["bad-magic", "oversized-header", "unknown-slot", "unsealed-memfd", "fd-missing",
                                    "truncated", "unsealed-board", "short-board", "board-without-fd"])
def test_receiver_refuses_hostile_sender(attack):
    """Whatever a hostile (authenticated) sender sends, receive raises TransportError and the model is untouched."""
    address = f"@wsync-mp-test-{os.getpid()}-{attack}"
    fake = FakeSender(address, b"")
    scheme = WeightSyncScheme("mp", timeout=TIMEOUT, address=address)
    model = fw.make_model(7)
    scheme.init_on_receiver(model=model, worker_idx=0)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(scheme.connect, errors))
    try:
        thread.start()
        fake.accept()
        conn = fake.conn
        if attack == "bad-magic":
            conn.sendall(b"PKL\x80" + b"\0" * 60)
        elif attack == "oversized-header":
            conn.sendall(PREFIX.pack(b"WSMP", Kind.NOTIFY, 0, 0, 2**32 - 1, 0))
        elif attack == "unknown-slot":
            conn.sendall(FRAMING.encode(Kind.NOTIFY, b"{}", arg=3))
        elif attack == "unsealed-memfd":  # no seals: it could shrink under the reader
            _fd_frame(conn, FRAMING.encode(Kind.NOTIFY, b"{}", arg=0, flags=1), 4096, sealed=False)
        elif attack == "unsealed-board":
            _fd_frame(conn, FRAMING.encode(Kind.BOARD, flags=1), 8, sealed=False)
        elif attack == "short-board":  # no word for worker 0
            _fd_frame(conn, FRAMING.encode(Kind.BOARD, flags=1), 4, sealed=True)
        elif attack == "board-without-fd":
            conn.sendall(FRAMING.encode(Kind.BOARD, flags=1))
        elif attack == "fd-missing":
            conn.sendall(FRAMING.encode(Kind.NOTIFY, b"{}", arg=0, flags=1))
        elif attack == "truncated":
            conn.sendall(FRAMING.encode(Kind.NOTIFY, b"{}", arg=0)[:10])
            conn.close()
            fake.conn = None
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], TransportError), errors
        assert fw.version_of(model) == 7 and model["mask"].all()
    finally:
        fake.close()
        thread.join(TIMEOUT)
        scheme.shutdown()


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as exc:  # handed to the test thread
        errors.append(exc)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_frame_reader_never_overallocates(chunks):
    """Arbitrary bytes either parse into bounded frames or raise TransportError; nothing else."""
    reader = FRAMING.reader("fuzz", frozenset(Kind))
    try:
        for chunk in chunks:
            for frame in reader.feed(chunk):
                assert len(frame.body) <= 64 * 8
    except TransportError:
        pass
    assert len(reader._buf) <= 64 * 8


def test_wrong_authkey_is_refused():
    """A receiver with another authkey cannot join, and says why."""
    sender = WeightSyncScheme("mp", timeout=TIMEOUT, address=f"@wsync-mp-test-key-{os.getpid()}", authkey="right")
    sender.init_on_sender(weights=fw.make_model(), num_workers=1)
    receiver = WeightSyncScheme("mp", timeout=TIMEOUT, address=sender.transport.options["address"], authkey="wrong")
    receiver.init_on_receiver(model=fw.make_model(3), worker_idx=0)
    thread = threading.Thread(target=lambda: _catch(lambda: sender.connect(timeout=3.0), []))
    try:
        thread.start()
        with pytest.raises(TransportError, match="authkey"):
            receiver.connect(timeout=10.0)
    finally:
        thread.join(TIMEOUT)
        receiver.shutdown()
        sender.shutdown()


def test_options_are_plain_and_secret_hidden():
    """The transport pickles as options only, and its repr never shows the authkey."""
    scheme = WeightSyncScheme("mp")
    opts = scheme.transport.options
    assert opts["address"].startswith("@") and len(opts["authkey"]) == 32
    assert opts["authkey"] not in repr(scheme.transport)
    copy = pickle.loads(pickle.dumps(scheme))
    assert copy.transport.options == opts
    with pytest.raises(ValueError, match="authkey must be a non-empty string"):  # os.environ.get("KEY", "")
        WeightSyncScheme("mp", address="@somewhere", authkey="")


def test_independent_receiver_on_a_path(tmp_path, pool):
    """A receiver built from the same options (not the sender's object) joins over a socket path;
    the path is private while in use and gone after shutdown."""
    path = str(tmp_path / "mp.sock")
    options = {"address": path, "authkey": "shared-secret"}
    scheme = WeightSyncScheme("mp", timeout=TIMEOUT, **options)
    model = fw.make_model()
    scheme.init_on_sender(weights=model, num_workers=1)
    p = pool()
    try:
        _, out = p.worker(pickle.dumps(WeightSyncScheme("mp", timeout=TIMEOUT, **options)), 0)
        scheme.connect()
        assert os.stat(path).st_mode & 0o777 == 0o600
        _fill(model, 1)
        scheme.send()
        assert _latest([out], 1) == [1]
    finally:
        scheme.shutdown()
    assert not os.path.exists(path)


def test_a_failed_io_thread_is_named_in_the_send_and_every_later_one(monkeypatch):
    """The sender's I/O thread dying (a bug, a failed allocation) fails the workers with its error
    and every later call with TransportError quoting it; before, the error was only in the log."""
    from wsync_mp.sender import MpSender

    sender = WeightSyncScheme("mp", timeout=TIMEOUT)
    model = fw.make_model()
    sender.init_on_sender(weights=model, num_workers=1)
    worker = pickle.loads(pickle.dumps(sender))
    worker.init_on_receiver(model=fw.make_model(5), worker_idx=0)
    thread = threading.Thread(target=worker.connect)
    thread.start()
    try:
        sender.connect()
        thread.join(TIMEOUT)

        def broken(self, conn):
            raise MemoryError("no room for the frame")

        monkeypatch.setattr(MpSender, "_read", broken)
        _fill(model, 1)
        handle = sender.send_async()
        assert worker.receive(timeout=TIMEOUT) == 1  # its ack is what the I/O thread fails to read
        with pytest.raises(WorkerTimeoutError, match="worker 0: the sender's I/O thread failed: MemoryError: "
                                                     "no room for the frame"):
            handle.wait(TIMEOUT)
        with pytest.raises(TransportError, match="mp: the sender's I/O thread failed: MemoryError"):
            sender.send(timeout=TIMEOUT)
    finally:
        worker.shutdown()
        sender.shutdown()
