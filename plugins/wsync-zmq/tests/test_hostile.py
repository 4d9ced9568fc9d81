"""Hostile and broken peers, with real sockets: the sender survives them; a receiver fed garbage
raises TransportError and keeps its last good version."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from wsync_core import Deadline, SenderContext, TransportError, WeightSyncScheme, WorkerTimeoutError
from wsync_core.layout import Layout
from wsync_core.protocol import Ack, Header, checksum
from wsync_core.weights import flatten
from wsync_zmq import ZmqTransport
from wsync_zmq.wire import ACK, DATA, HELLO, NEWER, PROBE, Hello, encode_delivery
from zmq_helpers import digest, make_model


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_sender_survives_garbage_from_raw_and_zmq_peers(spawn, context, caplog):
    model = make_model(0)
    scheme = WeightSyncScheme("zmq", timeout=60.0)
    scheme.init_on_sender(model=model, num_workers=1)
    options = scheme.transport.options
    host, port = options["address"][len("tcp://"):].rsplit(":", 1)
    try:
        w0 = spawn(0, options)
        scheme.connect()
        w0.wait_version(0)

        # raw TCP peers: random bytes, a half greeting, a huge declared frame, then gone
        for junk in (os.urandom(4096), b"\xff" + b"\x00" * 8 + b"\x7f", b"\xff" * 100_000):
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(junk)
        # zmq peers: wrong kinds, too many frames, oversized frames, bad hellos, acks without hello
        garbage = [
            [b"X"], [b""], [HELLO], [HELLO + b"{not json"], [HELLO + b"[]"], [HELLO, Hello(0, "policy", "x", 1).encode()],
            [HELLO + json.dumps({"wsync": 1, "w": 99, "m": "policy", "d": "x", "n": 1}).encode()],
            [HELLO + json.dumps({"wsync": 1, "w": -1, "m": "policy", "d": "x", "n": 1}).encode()],
            [HELLO + b"x" * 5000], [ACK] * 50, [ACK + Ack(0, 1).encode()], [b"B"], [b"Bx"], [b"W", b""],
            [encode_delivery(b"{}", b"payload")], [ACK + b"\x00" * (200 * 1024)],
        ]
        peers = []
        for frames in garbage:
            peer = context.socket(zmq.DEALER)
            peer.linger = 0
            peer.connect(options["address"])
            peer.send_multipart(frames)
            peers.append(peer)
        # a peer that claims worker 0's identity at the socket level gets a fresh one from the ROUTER
        impostor = context.socket(zmq.DEALER)
        impostor.linger = 0
        impostor.routing_id = b"\x00\x6b\x8b\x45\x67"
        impostor.connect(options["address"])
        impostor.send(ACK + Ack(0, 99).encode())
        time.sleep(0.5)
        for v in (1, 2):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            assert scheme.send() == v
            assert w0.wait_version(v)["digest"] == digest(model)
        assert "has not said hello" in caplog.text and "malformed message from a peer" in caplog.text
    finally:
        scheme.shutdown()


def test_a_connection_that_never_greets_is_closed_after_heartbeat(context):
    """A raw TCP peer that never sends ZMTP's greeting is closed within ``heartbeat`` (2 s here):
    libzmq's default 30 s let a local flood of silent connections hold every descriptor of the
    trainer's process (an outside audit: 1,100 of them, a new worker could not join)."""
    transport = ZmqTransport(heartbeat=2.0)
    layout = Layout.of(flatten(make_model(0)))
    endpoint = transport.sender(SenderContext(1, layout, "policy", torch.device("cpu")))
    host, port = transport.options["address"][len("tcp://"):].rsplit(":", 1)
    try:
        endpoint.open(Deadline(10))  # (listening, no worker needed)
        with socket.create_connection((host, int(port)), timeout=30) as silent:
            t0 = time.monotonic()
            try:
                while silent.recv(1 << 16):  # libzmq sends its own greeting first
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - t0 < 15, "a silent connection was kept past its handshake interval"
    finally:
        endpoint.close()


def test_forged_ack_never_completes_a_send(context):
    """A peer that never said hello cannot ack for a worker; the send times out naming it."""
    model = make_model(0)
    scheme = WeightSyncScheme("zmq", timeout=30.0)
    scheme.init_on_sender(model=model, num_workers=1)
    receiver = WeightSyncScheme("zmq", address=scheme.transport.options["address"], timeout=30.0)
    receiver.init_on_receiver(model=make_model(1), worker_idx=0)
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    try:
        scheme.connect()
        thread.join(30)
        forger = context.socket(zmq.DEALER)
        forger.linger = 0
        forger.connect(scheme.transport.options["address"])
        forger.send(ACK + Ack(0, 1).encode())
        # the real worker does not call receive(): only a forged ack could complete this send
        with pytest.raises(WorkerTimeoutError) as info:
            scheme.send(timeout=1.5)
        assert info.value.workers == [0]
    finally:
        thread.join(30)
        receiver.shutdown()
        scheme.shutdown()


class FakeSender:
    """A raw ROUTER at a receiver's address that speaks the wire format, correctly or not."""

    def __init__(self, context: zmq.Context, address: str, model: torch.nn.Module) -> None:
        self.sock = context.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(address)
        self.tensors = flatten(model)
        self.layout = Layout.of(self.tensors)
        self.rid: bytes | None = None

    def wait_hello(self, timeout: float = 30.0) -> Hello:
        end = time.monotonic() + timeout
        while self.sock.poll(max(0.0, end - time.monotonic()) * 1000):
            rid, message, *_ = self.sock.recv_multipart()
            if message[:1] == HELLO:  # (acks, including the receiver's rejections, are skipped)
                self.rid = rid
                return Hello.decode(message[1:])
        raise AssertionError("the receiver never said hello")

    def valid(self, version: int, *, layout: bool = False) -> tuple[bytes, bytes]:
        buf = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        self.layout.pack(self.tensors, buf)
        wire = json.loads(self.layout.to_json()) if layout else None
        header = Header(version, "policy", self.layout.digest, self.layout.nbytes, checksum(buf), wire)
        header = header.encode(sealed=True)
        return header, buf.numpy().tobytes()

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.rid, *frames])

    def deliver(self, header: bytes, payload: bytes, separate: bool = False) -> None:
        """A delivery as the zmq sender frames it: in one frame, or (``separate``) the payload in a second."""
        self.send(*([encode_delivery(header), payload] if separate else [encode_delivery(header, payload)]))

    def close(self) -> None:
        self.sock.close(linger=0)


@contextlib.contextmanager
def connected_to_fake(context: zmq.Context, source: torch.nn.Module, local: torch.nn.Module
                      ) -> Iterator[tuple[FakeSender, WeightSyncScheme]]:
    """A receiver of ``local`` connected to a FakeSender of ``source``, which delivered version 0;
    the receiver shut down and the fake closed after."""
    address = ZmqTransport().options["address"]
    fake = FakeSender(context, address, source)
    receiver = WeightSyncScheme("zmq", address=address, timeout=30.0)
    receiver.init_on_receiver(model=local, worker_idx=0)
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    try:
        assert fake.wait_hello().worker == 0
        fake.deliver(*fake.valid(0, layout=True))
        thread.join(30)
        assert receiver.version == 0 and digest(local) == digest(source)
        yield fake, receiver
    finally:
        thread.join(30)
        receiver.shutdown()
        fake.close()


def test_receiver_rejects_malformed_truncated_and_oversized_messages(context):
    source, local = make_model(0), make_model(1)
    with connected_to_fake(context, source, local) as (fake, receiver):
        good = digest(local)

        header, payload = fake.valid(1)
        bad_crc = bytearray(payload)
        bad_crc[7] ^= 0xFF
        length = len(header).to_bytes(4, "big")
        cases = {
            "no header length": [DATA],
            "header length beyond its frame": [DATA + (len(header) + 1).to_bytes(4, "big") + header],
            "header length beyond the bound": [DATA + (1 << 31).to_bytes(4, "big") + header + payload],
            "the old three frames": [DATA, header, payload],
            "too many frames": [encode_delivery(header), payload, b"extra"],
            "payload in both frames": [encode_delivery(header, payload[:8]), payload],
            "wrong kind": [b"Q" + length + header + payload],
            "empty header": [encode_delivery(b"", payload)],
            "header not json": [encode_delivery(b"\x80garbage", payload)],
            "payload too long": [encode_delivery(header, payload + b"\x00" * 64)],
            "payload truncated": [encode_delivery(header, payload[:-64])],
            "separate payload truncated": [encode_delivery(header), payload[:-64]],
            "damaged payload": [encode_delivery(header, bytes(bad_crc))],
            "damaged separate payload": [encode_delivery(header), bytes(bad_crc)],
            "header lies about size": [encode_delivery(Header(1, "policy", fake.layout.digest, 10**12).encode(), payload)],
        }
        for name, frames in cases.items():
            fake.send(*frames)
            with pytest.raises(TransportError):  # (it waits out the timeout for the probe this fake never answers)
                receiver.receive(timeout=3.0)
            assert receiver.version == 0 and digest(local) == good, name

        # a frame beyond the receiver's bound is refused by libzmq before allocation: the
        # connection drops, nothing is applied, and the receiver reconnects and says hello again
        fake.deliver(header, b"\x00" * (8 << 20), separate=True)
        hello = None
        end = time.monotonic() + 30
        while hello is None and time.monotonic() < end:
            assert receiver.receive(timeout=0.1) is None  # (the hello goes out from receive())
            try:
                hello = fake.wait_hello(timeout=0.0)
            except AssertionError:
                pass
        assert hello is not None and hello.worker == 0
        assert receiver.version == 0 and digest(local) == good

        with torch.no_grad():
            source[0].weight.mul_(2)
        fake.tensors = flatten(source)
        fake.deliver(*fake.valid(2), separate=True)
        assert receiver.receive(timeout=10.0) == 2 and digest(local) == digest(source)


def test_receiver_keeps_its_version_when_the_sender_dies(context):
    source, local = make_model(0), make_model(1)
    with connected_to_fake(context, source, local) as (fake, receiver):
        fake.close()
        assert receiver.receive(timeout=0.5) is None
        assert receiver.version == 0 and digest(local) == digest(source)


def test_hostile_json_in_acks_never_stops_the_sender(context, caplog):
    """A peer that joins as worker 1 then acks with a 5000-digit integer and arrays nested 5000
    deep: the sender names each malformed ack, its service thread lives on, and the honest
    worker 0 still gets every send through."""
    model = make_model(0)
    scheme = WeightSyncScheme("zmq", timeout=30.0)
    scheme.init_on_sender(model=model, num_workers=2)
    address = scheme.transport.options["address"]
    layout = Layout.of(flatten(model))
    receiver = WeightSyncScheme("zmq", address=address, timeout=30.0)
    received = make_model(1)
    receiver.init_on_receiver(model=received, worker_idx=0)
    hostile = context.socket(zmq.DEALER)
    hostile.linger = 0
    hostile.connect(address)
    hostile.send(HELLO + Hello(1, "policy", layout.digest, layout.nbytes).encode())
    hostile.send(ACK + Ack(1, 0).encode(sealed=True))  # it holds version 0, as far as the sender knows
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    try:
        scheme.connect()
        thread.join(30)
        hostile.send(ACK + b'{"wsync":1,"w":1,"v":' + b"7" * 5000 + b"}")
        hostile.send(HELLO + b'{"wsync":1,"w":1,"m":' + b"[" * 1500 + b"]" * 1500 + b"}")
        time.sleep(0.3)  # one at a time: each reaches the sender's service thread on its own poll
        hostile.send(ACK + b'{"wsync":1,"w":1,"v":0,"e":' + b"[" * 5000 + b"]" * 5000 + b"}")
        end = time.monotonic() + 20
        while caplog.text.count("sent a malformed ack") < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert caplog.text.count("sent a malformed ack") == 2, caplog.text[-2000:]
        assert "hello is" in caplog.text or "nests arrays" in caplog.text
        assert scheme._role._service is not None and scheme._role._service.is_alive()
        for v in (1, 2):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            got: list = []
            follower = threading.Thread(target=lambda: got.append(receiver.receive(timeout=30)))
            follower.start()
            assert scheme.send(worker_ids=[0]) == v
            follower.join(30)
            assert got == [v]
            assert digest(received) == digest(model)
    finally:
        thread.join(30)
        receiver.shutdown()
        scheme.shutdown()


def test_a_receive_takes_what_arrived_when_its_timeout_leaves_no_time_to_ask(context):
    """A version that arrived while the worker was busy: ``receive(timeout=0)`` (a safe point in an
    inference loop) applies it without asking the sender for a newer one; with a short timeout it
    asks, and waits for the answer only until its timeout (it waited at least 0.5 s for the answer,
    then for the newer version, whatever its timeout)."""
    def polled(receiver: WeightSyncScheme) -> int | None:
        """What ``receive(timeout=0)`` in a loop applies first (this fake answers one probe only)."""
        end, got = time.monotonic() + 30, None
        while got is None and time.monotonic() < end:
            got = receiver.receive(timeout=0.0)
        return got

    with connected_to_fake(context, make_model(0), make_model(1)) as (fake, receiver):
        fake.deliver(*fake.valid(1))
        assert polled(receiver) == 1
        told = [message for _, message in iter(lambda: fake.sock.recv_multipart() if fake.sock.poll(300) else None, None)]
        assert told and not [m for m in told if m[:1] == PROBE], told  # acks and wants only

        fake.deliver(*fake.valid(2))
        time.sleep(0.3)  # version 2 arrives while the worker is busy

        def answer_late() -> None:  # the sender's answer: a newer version is on its way, 0.3 s later
            while fake.sock.poll(10_000):
                _, message = fake.sock.recv_multipart()
                if message[:1] == PROBE:
                    time.sleep(0.3)
                    fake.send(NEWER + message[1:])
                    fake.deliver(*fake.valid(3))
                    return

        answering = threading.Thread(target=answer_late)
        answering.start()
        try:
            assert receiver.receive(timeout=0.05) == 2
        finally:
            answering.join(30)
        assert polled(receiver) == 3
