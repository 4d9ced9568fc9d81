"""Fixtures: receiver processes running ``rpc_worker.py``, killed at teardown whatever happens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("rpc_worker.py"))


class Worker:
    """One receiver process; ``lines()`` waits for it to end and returns its JSON lines."""

    def __init__(self, cfg: dict, prefix: list[str]) -> None:
        self.proc = subprocess.Popen([*prefix, sys.executable, WORKER, json.dumps(cfg)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)

    def lines(self, timeout: float = 120.0) -> list[dict]:
        out, _ = self.proc.communicate(timeout=timeout)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(cfg: dict, prefix: list[str] = ()) -> Worker:
        w = Worker(cfg, list(prefix))
        started.append(w)
        return w

    try:
        yield start
    finally:
        for w in started:
            w.kill()
            if w.proc.stdout is not None:
                w.proc.stdout.close()
