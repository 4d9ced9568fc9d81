"""wsync: keep a model's weights in sync between a trainer and many workers.

Exact, isolated, atomic, versioned: see ``WeightSyncScheme``. Transports are plugins found
through the ``wsync`` entry-point group; ``list_transports()`` shows what is installed.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .deadline import Deadline
from .errors import (
    SchemaMismatchError,
    StateError,
    TransportError,
    UnknownTransportError,
    WorkerDiedError,
    WorkerTimeoutError,
    WsyncError,
)
from .hookspecs import hookimpl
from .layout import Layout
from .registry import TransportInfo, get_transport, list_transports
from .report import SendReport
from .scheme import SendHandle, WeightSyncScheme
from .transport import (
    Acked,
    Capabilities,
    Delivery,
    Joined,
    Left,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
    free_port,
    zero_copy_for,
)

__all__ = [
    "__version__",
    # using it
    "WeightSyncScheme",
    "SendHandle",
    "SendReport",
    "list_transports",
    "get_transport",
    "TransportInfo",
    # errors
    "WsyncError",
    "StateError",
    "SchemaMismatchError",
    "WorkerTimeoutError",
    "WorkerDiedError",
    "TransportError",
    "UnknownTransportError",
    # writing a transport
    "hookimpl",
    "Transport",
    "Capabilities",
    "SenderContext",
    "ReceiverContext",
    "SenderEndpoint",
    "ReceiverEndpoint",
    "Delivery",
    "Joined",
    "Acked",
    "Left",
    "Deadline",
    "Layout",
    "free_port",
    "zero_copy_for",
]
