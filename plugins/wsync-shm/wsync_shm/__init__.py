"""wsync-shm: the ``shm`` transport. Weights travel through named shared memory on one host."""

from __future__ import annotations

from .transport import ShmTransport

__all__ = ["ShmTransport"]
