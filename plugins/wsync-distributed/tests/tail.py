"""``Tail``: the JSON lines a script process prints, read as they come (a test can wait for one)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

__all__ = ["Tail"]


class Tail:
    """Reads ``proc.stdout`` (a ScriptProcess's Popen) in a thread; ``wait_for`` a line, ``lines`` so far."""

    def __init__(self, script_process) -> None:
        self.proc = script_process.proc
        self.cond = threading.Condition()
        self.seen: list[dict] = []
        self.ended = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                with self.cond:
                    self.seen.append(json.loads(line))
                    self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[dict], bool], timeout: float) -> dict:
        """The first line ``pred`` accepts; raises AssertionError, with the lines seen, after ``timeout`` s
        or once the process ended without one."""
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                found = next((line for line in self.seen if pred(line)), None)
                if found is not None:
                    return found
                if self.ended or time.monotonic() >= end:
                    raise AssertionError(f"no such line within {timeout:g} s: {self.seen}")
                self.cond.wait(min(0.5, max(0.0, end - time.monotonic())))

    def applied(self, version: int, timeout: float) -> dict:
        return self.wait_for(lambda line: line["event"] == "applied" and line["version"] == version, timeout)

    def lines(self, timeout: float = 120.0) -> list[dict]:
        """Every line, once the process ended (AssertionError if it did not within ``timeout`` s)."""
        self.proc.wait(timeout)
        self.thread.join(timeout)
        return list(self.seen)
