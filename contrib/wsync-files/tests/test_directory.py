"""What else may sit in the directory: entries that are not files (a FIFO, a directory) under the
transport's names, and what a sender killed mid-write left. Every call still ends by its
deadline with a named error, and a new sender clears a dead one's leftovers."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from wsync_core import TransportError, WeightSyncScheme, WorkerTimeoutError


def _connected(directory: str) -> tuple[WeightSyncScheme, WeightSyncScheme, dict, dict]:
    trainer_model, worker_model = {"w": torch.zeros(4096)}, {"w": torch.zeros(4096)}
    trainer = WeightSyncScheme("files", directory=directory, timeout=5.0)
    trainer.init_on_sender(model=trainer_model, num_workers=1)
    worker = WeightSyncScheme("files", directory=directory, timeout=5.0)
    worker.init_on_receiver(model=worker_model, worker_idx=0)
    connecting = threading.Thread(target=worker.connect)
    connecting.start()
    trainer.connect()
    connecting.join()
    return trainer, worker, trainer_model, worker_model


@pytest.mark.parametrize("what", ["mailbox", "payload"])
def test_a_fifo_in_place_of_a_file_never_blocks_a_receive(tmp_path, what: str) -> None:
    """A FIFO would block open() forever: the worker refuses it, by its deadline, and keeps its version."""
    trainer, worker, trainer_model, worker_model = _connected(str(tmp_path))
    try:
        trainer_model["w"].fill_(1.0)
        sent = trainer.send_async()
        line = (tmp_path / "to-0").read_bytes().partition(b"\n")[0].split()
        victim = tmp_path / ("to-0" if what == "mailbox" else line[2].decode())
        victim.unlink()
        os.mkfifo(victim)
        with pytest.raises(TransportError, match="is not a regular file"):
            worker.receive(timeout=2.0)
        assert worker.version == 0 and torch.equal(worker_model["w"], torch.zeros(4096))
        with pytest.raises((TransportError, WorkerTimeoutError)):
            sent.wait(2.0)
        victim.unlink()
        trainer_model["w"].fill_(2.0)
        sent = trainer.send_async()
        assert worker.receive(timeout=5.0) == 2 and sent.wait() == 2
        assert torch.equal(worker_model["w"], trainer_model["w"])
    finally:
        worker.shutdown()
        trainer.shutdown()


@pytest.mark.parametrize("name", ["hello-1", "ack-0-99999999999999999999"])
def test_a_directory_or_fifo_named_like_a_workers_file_is_named_once_and_shutdown_goes_on(tmp_path,
                                                                                         name: str) -> None:
    """The sender's scan of the directory names it (a TransportError from the send), once: the
    next send goes on, and the sender's shutdown leaves it where it is (it is not the transport's).
    The scan that finds it may be the service thread's, between calls (here it is: the test waits
    for it): its error is then raised by the next call (it was only logged, and lost)."""
    trainer, worker, trainer_model, worker_model = _connected(str(tmp_path))
    (tmp_path / name).mkdir()
    time.sleep(1.0)  # the sender's service thread scans meanwhile
    try:
        trainer_model["w"].fill_(1.0)
        with pytest.raises(TransportError, match=f"{name} is not a regular file"):
            trainer.send_async().wait(5.0)
        trainer_model["w"].fill_(2.0)
        sent = trainer.send_async()
        assert worker.receive(timeout=5.0) == sent.version and sent.wait() == sent.version
        assert torch.equal(worker_model["w"], trainer_model["w"])
    finally:
        worker.shutdown()
        trainer.shutdown()  # (raised IsADirectoryError, not a WsyncError, before)
    assert sorted(os.listdir(tmp_path)) == [name]


def test_a_new_sender_removes_what_a_killed_one_was_writing(tmp_path) -> None:
    for leftover in (".tmp-payload-dead-1.bin-0123abcd", ".tmp-to-0-0123abcd", "payload-dead-1.bin"):
        (tmp_path / leftover).write_bytes(b"x" * 100)
    (tmp_path / ".tmp-ack-0-0123abcd").write_bytes(b"{}")  # a worker's: a live one may be writing it
    trainer = WeightSyncScheme("files", directory=str(tmp_path), timeout=1.0)
    trainer.init_on_sender(model={"w": torch.zeros(16)}, num_workers=1)
    try:
        with pytest.raises(WorkerTimeoutError):
            trainer.connect()
        names = sorted(os.listdir(tmp_path))
        assert not [n for n in names if "dead" in n or n.startswith(".tmp-to-")], names
        assert ".tmp-ack-0-0123abcd" in names
    finally:
        trainer.shutdown()


def test_endpoints_refuse_calls_before_open_and_after_close_and_write_nothing(tmp_path) -> None:
    """acquire() before open() raised IndexError; publish() and ack() after close() wrote files."""
    from wsync_core import Deadline, Layout, ReceiverContext, SenderContext
    from wsync_files import FilesTransport

    layout = Layout.of({"w": torch.zeros(16)})
    transport = FilesTransport(directory=str(tmp_path))
    sender = transport.sender(SenderContext(1, layout, "m", torch.device("cpu")))
    receiver = transport.receiver(ReceiverContext(0, layout, "m", torch.device("cpu")))
    with pytest.raises(TransportError, match="files sender on .* is not open"):
        sender.acquire(Deadline(0))
    sender.open(Deadline(5))
    receiver.open(Deadline(5))
    buffer = sender.acquire(Deadline(0))
    sender.close()
    receiver.close()
    before = sorted(os.listdir(tmp_path))
    for call in (lambda: sender.acquire(Deadline(0)), lambda: sender.publish(buffer, b"h", [0]),
                 lambda: sender.poll(Deadline(0)), lambda: receiver.recv(Deadline(0)), lambda: receiver.ack(b"a")):
        with pytest.raises(TransportError, match="is not open"):
            call()
    assert sorted(os.listdir(tmp_path)) == before
