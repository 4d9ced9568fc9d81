"""Fixtures for the zmq transport's tests: worker processes that are always stopped."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from zmq_helpers import WorkerProcess  # noqa: E402


@pytest.fixture
def spawn() -> Iterator:
    """``spawn(worker, options, prefix=())`` starts a zmq_worker.py process; all are stopped after."""
    started: list[WorkerProcess] = []

    def start(worker: int, options: dict, prefix: tuple[str, ...] = (), **config) -> WorkerProcess:
        proc = WorkerProcess(worker, options, prefix, **config)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
