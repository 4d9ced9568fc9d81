"""Helpers for the core's tests: inproc receivers as real threads, bitwise comparison."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
from torch import nn

from wsync_core import WeightSyncScheme, WsyncError


def make_policy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


class ReceiverThread:
    """A worker: a thread with its own unpickled copy of the scheme, receiving until stopped.

    While ``paused`` it does not call receive() (a silent worker).
    """

    def __init__(self, blob: bytes, model: Any, worker_idx: int, poll: float = 0.005) -> None:
        self.scheme: WeightSyncScheme = pickle.loads(blob)
        self.model = model
        self.worker_idx = worker_idx
        self.poll = poll
        self.paused = threading.Event()
        self.idle = threading.Event()
        self.stopped = threading.Event()
        self.errors: list[BaseException] = []
        self.applied: list[int] = []
        self.scheme.init_on_receiver(model=model, worker_idx=worker_idx)
        self.thread = threading.Thread(target=self._run, name=f"receiver-{worker_idx}", daemon=True)
        self.connected = threading.Event()
        self.thread.start()

    def _run(self) -> None:
        try:
            self.scheme.connect()
            self.applied.append(self.scheme.version)
            self.connected.set()
            while not self.stopped.is_set():
                if self.paused.is_set():
                    self.idle.set()
                    self.stopped.wait(self.poll)
                    continue
                try:
                    v = self.scheme.receive(timeout=self.poll)
                except WsyncError as exc:
                    self.errors.append(exc)
                    continue
                if v is not None:
                    self.applied.append(v)
        except BaseException as exc:  # reported to the test through .errors
            self.errors.append(exc)
        finally:
            self.scheme.shutdown()

    def pause(self) -> None:
        """Stop calling receive() (a silent worker); returns once the thread is idle."""
        self.idle.clear()
        self.paused.set()
        assert self.idle.wait(30), "receiver thread did not pause"

    def resume(self) -> None:
        self.paused.clear()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "receiver thread did not stop"


class Cluster:
    def __init__(self, sender: WeightSyncScheme, model: Any, receivers: list[ReceiverThread]) -> None:
        self.sender, self.model, self.receivers = sender, model, receivers

    def pause(self) -> None:
        """Stop calling receive() (a silent worker); returns once the thread is idle."""
        self.idle.clear()
        self.paused.set()
        assert self.idle.wait(30), "receiver thread did not pause"

    def resume(self) -> None:
        self.paused.clear()

    def stop(self) -> None:
        for r in self.receivers:
            r.stop()
        self.sender.shutdown()


def same(a: Any, b: Any, strategy: str = "tensordict") -> bool:
    """Bit-for-bit equality of two weight containers."""
    from wsync_core.weights import flatten

    fa, fb = flatten(a, strategy), flatten(b, strategy)
    if fa.keys() != fb.keys():
        return False
    return all(
        fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape
        and torch.equal(fa[k].contiguous().view(-1).view(torch.uint8) if fa[k].numel() else fa[k].new_empty(0),
                        fb[k].contiguous().view(-1).view(torch.uint8) if fb[k].numel() else fb[k].new_empty(0))
        for k in fa
    )


def bump(model: nn.Module, by: float = 1.0) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def connected_pair(transport: str = "inproc", model: Any = None, local: Any = None,
                   **kw: Any) -> tuple[WeightSyncScheme, Any, WeightSyncScheme, Any]:
    """A connected sender of ``model`` and one receiver of ``local`` (in a thread of this process)
    on ``transport``, two policies by default: (sender, its model, receiver, the receiver's model)."""
    model = make_policy(0) if model is None else model
    local = make_policy(1) if local is None else local
    sender = WeightSyncScheme(transport, timeout=30.0, **kw)
    sender.init_on_sender(model=model, num_workers=1)
    receiver: WeightSyncScheme = pickle.loads(pickle.dumps(sender))
    receiver.init_on_receiver(model=local, worker_idx=0)
    t = threading.Thread(target=receiver.connect)
    t.start()
    sender.connect()
    t.join()
    return sender, model, receiver, local


def connected_workers(transport: str, n: int, **kw: Any) -> tuple[WeightSyncScheme, Any, list[WeightSyncScheme]]:
    """A connected sender of a policy and ``n`` receivers of their own policies (connected in
    threads of this process) on ``transport``: (sender, its model, receivers)."""
    model = make_policy(0)
    sender = WeightSyncScheme(transport, timeout=30.0, **kw)
    sender.init_on_sender(model=model, num_workers=n)
    workers = [pickle.loads(pickle.dumps(sender)) for _ in range(n)]
    for i, w in enumerate(workers):
        w.init_on_receiver(model=make_policy(1), worker_idx=i)
    threads = [threading.Thread(target=w.connect) for w in workers]
    for t in threads:
        t.start()
    sender.connect()
    for t in threads:
        t.join()
    return sender, model, workers


def connect_both(sender: WeightSyncScheme, receiver: WeightSyncScheme) -> tuple[Exception | None, Exception | None]:
    """Connect ``sender`` and ``receiver`` (in a thread) at once, both initialised: what each
    ``connect()`` raised, or None."""
    raised: list[Exception | None] = [None]

    def connect() -> None:
        try:
            receiver.connect()
        except Exception as exc:  # returned to the caller
            raised[0] = exc

    t = threading.Thread(target=connect)
    t.start()
    mine: Exception | None = None
    try:
        sender.connect()
    except Exception as exc:  # returned to the caller
        mine = exc
    finally:
        t.join()
    return mine, raised[0]
