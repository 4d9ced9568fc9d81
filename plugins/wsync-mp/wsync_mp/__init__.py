"""wsync-mp: the ``mp`` transport, for worker processes on one Linux host (any start method)."""

from .plugin import MpTransport

__all__ = ["MpTransport"]
