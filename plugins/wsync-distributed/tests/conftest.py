"""Fixtures: receiver processes running ``dist_worker.py`` (``workers``) and sender processes running
``dist_sender.py`` (``senders``), killed at teardown whatever happens."""

from __future__ import annotations

from pathlib import Path

from wsync_conformance.harness import script_workers

workers = script_workers(Path(__file__).with_name("dist_worker.py"))
senders = script_workers(Path(__file__).with_name("dist_sender.py"), name="senders")
