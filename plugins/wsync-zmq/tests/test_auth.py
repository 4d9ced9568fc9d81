"""CURVE authentication: keyed workers get weights; a peer without the right key is refused and
logged, and nothing it sends reaches a model."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError
from wsync_core.protocol import Ack
from wsync_zmq.wire import ACK, HELLO, Hello
from zmq_helpers import digest, make_model


@pytest.fixture
def keys() -> dict[str, tuple[str, str]]:
    return {name: tuple(k.decode() for k in zmq.curve_keypair()) for name in ("server", "good", "bad")}


def try_connect(options: dict, worker: int, timeout: float = 5.0) -> tuple[WeightSyncScheme, list, threading.Thread]:
    """A receiver thread connecting with ``options``; errors land in the returned list."""
    scheme = WeightSyncScheme("zmq", timeout=timeout, **options)
    scheme.init_on_receiver(model=make_model(10 + worker), worker_idx=worker)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scheme.connect()
        except Exception as exc:  # reported to the test
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return scheme, errors, thread


def test_allowed_client_key_works_others_are_refused_and_logged(keys, spawn, caplog):
    server_pub, server_sec = keys["server"]
    model = make_model(0)
    sender = WeightSyncScheme("zmq", timeout=30.0, curve_server_key=server_pub, curve_server_secret=server_sec,
                              curve_allowed_clients=[keys["good"][0]])
    sender.init_on_sender(model=model, num_workers=2)
    address = sender.transport.options["address"]
    base = {"address": address, "curve_server_key": server_pub}
    good = spawn(0, {**base, "curve_client_key": keys["good"][0], "curve_client_secret": keys["good"][1]})
    bad, bad_errors, bad_thread = try_connect(
        {**base, "curve_client_key": keys["bad"][0], "curve_client_secret": keys["bad"][1]}, worker=1)
    plain = zmq.Context()
    intruder = plain.socket(zmq.DEALER)  # no CURVE at all: says hello and forges an ack
    intruder.linger = 0
    intruder.connect(address)
    intruder.send(HELLO + Hello(1, "policy", "x", 1).encode())
    intruder.send(ACK + Ack(1, 0).encode())
    try:
        with pytest.raises(WorkerTimeoutError) as info:  # only worker 0 holds an allowed key
            sender.connect(timeout=5.0)
        assert 1 in info.value.workers  # (0 too if its process is still starting: it joins late)
        assert good.wait_version(0)["digest"] == digest(model)
        bad_thread.join(30)
        assert bad_errors and isinstance(bad_errors[0], TransportError), bad_errors
        assert "refused" in str(bad_errors[0]) and bad.version == -1
        assert "not in curve_allowed_clients" in caplog.text
        assert "handshake failed" in caplog.text  # the plain peer
        with torch.no_grad():
            model[0].weight.add_(1)
        assert sender.send(worker_ids=[0]) == 1
        assert good.wait_version(1)["digest"] == digest(model)
    finally:
        bad_thread.join(30)
        bad.shutdown()
        plain.destroy(linger=0)
        sender.shutdown()


def test_without_the_server_key_a_peer_is_refused(keys, caplog):
    server_pub, server_sec = keys["server"]
    model = make_model(0)
    sender = WeightSyncScheme("zmq", timeout=30.0, curve_server_key=server_pub, curve_server_secret=server_sec)
    sender.init_on_sender(model=model, num_workers=2)
    address = sender.transport.options["address"]
    friend, friend_errors, friend_thread = try_connect({"address": address, "curve_server_key": server_pub},
                                                       worker=0, timeout=30.0)
    stranger, stranger_errors, stranger_thread = try_connect(
        {"address": address, "curve_server_key": keys["bad"][0]}, worker=1, timeout=4.0)
    plain, plain_errors, plain_thread = try_connect({"address": address}, worker=1, timeout=4.0)
    try:
        with pytest.raises(WorkerTimeoutError) as info:
            sender.connect(timeout=5.0)
        assert 1 in info.value.workers
        friend_thread.join(30)
        stranger_thread.join(30)
        assert not friend_errors and friend.version == 0
        assert stranger_errors and stranger.version == -1
        assert "handshake failed" in caplog.text
        plain_thread.join(30)
        assert plain.version == -1 and "does the sender require CURVE?" in str(plain_errors[0])
    finally:
        friend_thread.join(30)
        stranger_thread.join(30)
        plain_thread.join(30)
        friend.shutdown()
        stranger.shutdown()
        plain.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("damage", ["\n", "~", None], ids=["newline", "not-z85", "not-ascii"])
@pytest.mark.parametrize("option", ["curve_server_secret", "curve_client_secret"])
def test_a_malformed_secret_key_is_named_never_shown(option: str, damage: str | None) -> None:
    """A secret key with a stray character (a newline from its file), or not Z85 at all, is refused
    naming the option, and no error quotes it (an outside audit found it quoted whole)."""
    public, secret = (k.decode() for k in zmq.curve_keypair())
    bad: str | bytes = (secret + damage if damage == "\n" else secret[:-1] + damage if damage
                        else b"\xff" + secret[1:].encode())
    options = {"curve_server_key": public, option: bad}
    if option == "curve_client_secret":
        options["curve_client_key"] = public
    else:
        options["curve_server_secret"] = bad
    with pytest.raises(ValueError, match=option) as info:
        WeightSyncScheme("zmq", **options)
    shown = str(info.value)
    assert secret[:20] not in shown and secret[20:] not in shown, shown
