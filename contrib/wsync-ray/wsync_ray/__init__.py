"""wsync-ray: a wsync transport that moves weights through Ray's object store."""

from __future__ import annotations

__version__ = "0.1.0"

from .transport import RayTransport

__all__ = ["__version__", "RayTransport"]
