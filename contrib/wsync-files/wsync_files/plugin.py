"""The ``wsync`` entry point: registers the ``files`` transport with wsync-core."""

from __future__ import annotations

from collections.abc import Callable

from wsync_core import hookimpl

from .transport import FilesTransport

__all__ = ["wsync_register_transports"]


@hookimpl
def wsync_register_transports(register: Callable[[type], None]) -> None:
    register(FilesTransport)
