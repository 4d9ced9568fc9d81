"""Helpers for the zmq tests: a worker process driven through its stdin/stdout, launched with the
conformance harness (it dies with the test run)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from wsync_conformance.harness import launch

from zmq_worker import digest, make_model

__all__ = ["WorkerProcess", "SenderProcess", "digest", "make_model", "WORKER_SCRIPT", "SENDER_SCRIPT"]

WORKER_SCRIPT = str(Path(__file__).with_name("zmq_worker.py"))
SENDER_SCRIPT = str(Path(__file__).with_name("zmq_sender.py"))


class WorkerProcess:
    """zmq_worker.py in a child process; ``lines`` holds what it printed, decoded."""

    script = WORKER_SCRIPT

    def __init__(self, worker: int, options: dict, prefix: tuple[str, ...] = (), **config) -> None:
        self.worker = worker
        config = {"worker": worker, "options": options, **config}
        self.proc = launch([sys.executable, self.script, json.dumps(config)], prefix, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                self.lines.put({"junk": line})

    def wait_version(self, version: int, timeout: float = 60.0) -> dict:
        """The first line reporting ``version`` or later; raises AssertionError on an error or timeout."""
        end = time.monotonic() + timeout
        for line in self.seen:
            if line.get("v", -1) >= version:
                return line
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"worker {self.worker} did not report version {version} within "
                                     f"{timeout} s; it said {self.seen}") from None
            self.seen.append(line)
            if "v" not in line:
                raise AssertionError(f"worker {self.worker} failed: {line}")
            if line["v"] >= version:
                return line

    def errors(self, wait: float = 0.0) -> list[str]:
        """The errors this worker reported so far (waiting up to ``wait`` s for the first)."""
        end = time.monotonic() + wait
        while True:
            try:
                self.seen.append(self.lines.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                break
        return [line["error"] for line in self.seen if "error" in line]

    def pause(self, seconds: float) -> None:
        """Make the worker stop calling receive() for ``seconds``."""
        self.proc.stdin.write(json.dumps({"pause": seconds}) + "\n")
        self.proc.stdin.flush()

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

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class SenderProcess(WorkerProcess):
    """zmq_sender.py in a child process: ``send(**kw)`` asks for one more version and returns its result."""

    script = SENDER_SCRIPT

    def __init__(self, workers: int, options: dict, prefix: tuple[str, ...] = (), **config) -> None:
        super().__init__(-1, options, prefix, workers=workers, **config)

    def next(self, timeout: float = 60.0) -> dict:
        """The next line the sender prints."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the sender said nothing within {timeout} s") from None
        self.seen.append(line)
        return line

    def send(self, timeout: float = 60.0, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        return self.next(timeout)
