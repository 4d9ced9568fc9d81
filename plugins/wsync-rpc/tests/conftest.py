"""Fixtures: receiver processes running ``rpc_worker.py``, killed at teardown whatever happens."""

from __future__ import annotations

from pathlib import Path

from wsync_conformance.harness import script_workers

workers = script_workers(Path(__file__).with_name("rpc_worker.py"))
