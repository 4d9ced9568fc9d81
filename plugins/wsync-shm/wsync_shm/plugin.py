"""The pluggy entry point: registers the ``shm`` transport with wsync."""

from __future__ import annotations

from collections.abc import Callable

from wsync_core import hookimpl

from .transport import ShmTransport

__all__ = ["wsync_register_transports"]


@hookimpl
def wsync_register_transports(register: Callable[[type], None]) -> None:
    register(ShmTransport)
