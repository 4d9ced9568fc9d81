"""wsync: keep a model's weights in sync between a trainer and many workers.

Users: ``WeightSyncScheme`` (docs/api.md; the ten guarantees: docs/guarantees.md). Transports are
plugins found through the ``wsync`` entry-point group; ``list_transports()`` shows what is
installed. Transport authors: every name of the interface (docs/writing-a-transport.md) is
importable from here.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .deadline import Deadline, Wakeup
from .endpoints import AckPusher, ReceiverBase, SenderBase
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
from .protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from .registry import TransportInfo, get_transport, list_transports
from .report import SendReport
from .stream import StreamReceiver, StreamSender
from .scheme import SendHandle, WeightSyncScheme
from .transport import (
    Acked,
    Buffer,
    INTERFACE_VERSION,
    Capabilities,
    Delivery,
    Event,
    Joined,
    Left,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
    free_port,
    is_loopback,
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
    "INTERFACE_VERSION",
    "Capabilities",
    "Buffer",
    "SenderContext",
    "ReceiverContext",
    "SenderEndpoint",
    "ReceiverEndpoint",
    "Delivery",
    "Joined",
    "Acked",
    "Left",
    "Event",
    "Deadline",
    "Wakeup",
    "Layout",
    "free_port",
    "is_loopback",
    "zero_copy_for",
    "MAX_HEADER_BYTES",
    "MAX_ACK_BYTES",
    # the bases a transport may build on (docs/writing-a-transport.md)
    "SenderBase",
    "ReceiverBase",
    "AckPusher",
    "StreamSender",
    "StreamReceiver",
]
