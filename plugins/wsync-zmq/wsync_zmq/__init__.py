"""wsync-zmq: the ``zmq`` transport, weights over ZeroMQ to workers on this or other hosts."""

from .transport import ZmqTransport

__all__ = ["ZmqTransport", "__version__"]

__version__ = "0.1.0"
