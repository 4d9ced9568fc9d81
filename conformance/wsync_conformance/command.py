"""The ``wsync conformance`` command, registered with ``wsync_register_commands``."""

from __future__ import annotations

from wsync_core import hookimpl

from .cli import add_arguments, main

__all__ = ["wsync_register_commands"]


@hookimpl
def wsync_register_commands(register) -> None:
    register("conformance", "run the conformance suite against a transport, guarantee by guarantee",
             add_arguments, main)
