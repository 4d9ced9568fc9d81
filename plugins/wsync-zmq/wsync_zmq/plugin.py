"""The pluggy entry point of wsync-zmq: registers the ``zmq`` transport."""

from __future__ import annotations

import wsync_core

from .transport import ZmqTransport

__all__ = ["wsync_register_transports"]


@wsync_core.hookimpl
def wsync_register_transports(register) -> None:
    register(ZmqTransport)
