"""Fixtures for the shm transport's tests: child processes from the conformance harness, each
dying with the test run and killed and joined after its test."""

from __future__ import annotations

import sys
from pathlib import Path

from wsync_conformance.harness import process_fixture

sys.path.insert(0, str(Path(__file__).parent))

#: ``spawn(target, *args)`` starts a "spawn" process with a command pipe; returns (process, conn)
spawn = process_fixture("spawn", "spawn")
