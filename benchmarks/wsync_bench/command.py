"""The ``wsync bench`` command, registered with ``wsync_register_commands``."""

from __future__ import annotations

import argparse

from wsync_core import hookimpl

from .harness import main

__all__ = ["wsync_register_commands"]


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="shm,mp")
    p.add_argument("--sizes", default="10KiB,64MiB,512MiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--compare", default="", help="comma-separated: torchrl")
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png")


@hookimpl
def wsync_register_commands(register) -> None:
    register("bench", "time transports side by side on this machine", _configure, main)
