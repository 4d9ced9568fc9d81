"""Fixtures for the shm transport's tests: child processes that are always killed and joined."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def spawn() -> Iterator:
    """``spawn(target, *args)`` starts a "spawn" process with a command pipe; returns (process, conn)."""
    ctx = multiprocessing.get_context("spawn")
    started = []

    def start(target, *args):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        child.close()
        started.append((proc, parent))
        return proc, parent

    yield start
    for proc, conn in started:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        conn.close()
