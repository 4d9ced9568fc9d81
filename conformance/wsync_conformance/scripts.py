"""Receivers as scripts: ``python SCRIPT CONFIG_JSON`` in a child process that prints JSON lines
(part of the public harness: ``wsync_conformance.harness`` re-exports both names).

``workers = script_workers(Path(__file__).with_name("my_worker.py"))`` in a conftest.py gives tests
a ``workers(config, prefix=())`` fixture whose processes are killed at teardown, whatever happens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from os import PathLike
from typing import Any

import pytest

__all__ = ["ScriptProcess", "script_workers"]


class ScriptProcess:
    """One ``python SCRIPT CONFIG_JSON`` process (``prefix`` before it, e.g. a ``Host.prefix``)."""

    def __init__(self, script: str | PathLike, config: dict[str, Any], prefix: Sequence[str] = ()) -> None:
        from .harness import launch

        self.proc = launch([sys.executable, str(script), json.dumps(config)], prefix, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)

    def lines(self, timeout: float = 120.0) -> list[dict]:
        """Wait for it to end (raises subprocess.TimeoutExpired after ``timeout`` s); its JSON lines."""
        out, _ = self.proc.communicate(timeout=timeout)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def kill(self) -> None:
        """Kill it if it still runs, reap it and close its pipe."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def script_workers(script: str | PathLike, name: str = "workers") -> Any:
    """A pytest fixture (called ``name``) that starts ``ScriptProcess(script, config, prefix)`` and kills them all after."""

    def fixture() -> Iterator[Callable[..., ScriptProcess]]:
        started: list[ScriptProcess] = []

        def start(config: dict[str, Any], prefix: Sequence[str] = ()) -> ScriptProcess:
            proc = ScriptProcess(script, config, prefix)
            started.append(proc)
            return proc

        try:
            yield start
        finally:
            for proc in started:
                proc.kill()

    return pytest.fixture(fixture, name=name)
