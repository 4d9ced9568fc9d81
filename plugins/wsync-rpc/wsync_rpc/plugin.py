"""The ``wsync`` entry point: registers the ``rpc`` transport."""

from __future__ import annotations

from collections.abc import Callable

import wsync_core

from .transport import RpcTransport

__all__ = ["wsync_register_transports"]


@wsync_core.hookimpl
def wsync_register_transports(register: Callable[[type], None]) -> None:
    register(RpcTransport)
