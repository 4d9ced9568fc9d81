"""The ``wsync`` entry point: registers the ``ray`` transport with wsync-core (Ray is imported
only when an endpoint opens)."""

from __future__ import annotations

from collections.abc import Callable

from wsync_core import hookimpl

from .transport import RayTransport

__all__ = ["wsync_register_transports"]


@hookimpl
def wsync_register_transports(register: Callable[[type], None]) -> None:
    register(RayTransport)
