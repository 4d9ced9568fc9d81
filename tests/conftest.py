"""Fixtures for the core's tests."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from core_helpers import Cluster, ReceiverThread, make_policy
from wsync_core import WeightSyncScheme


@pytest.fixture
def cluster() -> Iterator[Callable[..., Cluster]]:
    """Build a connected inproc sender with ``n`` receiver threads; everything is shut down after."""
    made: list[Cluster] = []

    def build(n: int = 2, make: Callable[[int], Any] = make_policy, connect: bool = True, model: Any = None,
              **scheme_kw: Any) -> Cluster:
        scheme_kw.setdefault("timeout", 30.0)
        model = make(0) if model is None else model
        sender = WeightSyncScheme("inproc", **scheme_kw)
        sender.init_on_sender(model=model, num_workers=n)
        blob = pickle.dumps(sender)
        receivers = [ReceiverThread(blob, make(i + 1), i) for i in range(n)]
        c = Cluster(sender, model, receivers)
        made.append(c)
        if connect:
            sender.connect()
            for r in receivers:
                assert r.connected.wait(30), r.errors
        return c

    yield build
    for c in made:
        c.stop()

