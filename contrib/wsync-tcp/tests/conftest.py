"""Fixtures for the tcp tests: worker processes (tcp_worker.py) that are always stopped."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tcp_worker, for the tests' model and digest

WORKER_SCRIPT = str(Path(__file__).with_name("tcp_worker.py"))


class WorkerProcess:
    """tcp_worker.py in a child process (``prefix`` runs it elsewhere, e.g. in a network namespace)."""

    def __init__(self, worker: int, options: dict, prefix: tuple[str, ...] = (), timeout: float = 30.0,
                 **config) -> None:
        self.worker = worker
        config = {"worker": worker, "options": options, "timeout": timeout, **config}
        self.proc = subprocess.Popen([*prefix, sys.executable, WORKER_SCRIPT, json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout: float = 60.0) -> dict:
        """The next line it prints; AssertionError if none comes in time."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker {self.worker} said nothing within {timeout} s; it said {self.seen}") from None
        self.seen.append(line)
        return line

    def wait_version(self, version: int, timeout: float = 60.0) -> dict:
        """The first line reporting ``version`` or later; AssertionError on an error or a timeout."""
        end = time.monotonic() + timeout
        for line in self.seen:
            if line.get("v", -1) >= version:
                return line
        while True:
            line = self.next(max(0.0, end - time.monotonic()))
            if "v" not in line:
                raise AssertionError(f"worker {self.worker} failed: {line}")
            if line["v"] >= version:
                return line

    def stop(self, timeout: float = 20.0) -> int | None:
        """Close its stdin (it shuts down and exits); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)
        self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture
def spawn() -> Iterator:
    """``spawn(worker, options, prefix=())`` starts a tcp_worker.py process; all are stopped after."""
    started: list[WorkerProcess] = []

    def start(worker: int, options: dict, prefix: tuple[str, ...] = (), **kw) -> WorkerProcess:
        started.append(WorkerProcess(worker, options, prefix, **kw))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()
