"""wsync-ray: a wsync transport that moves weights through Ray's object store.

Importing the package is cheap on purpose: the mailbox actor's process imports
``wsync_ray.mailbox`` only (no torch, no wsync-core), so it starts in a fraction of a second.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "RayTransport"]


def __getattr__(name: str) -> Any:
    if name == "RayTransport":
        from .transport import RayTransport

        return RayTransport
    raise AttributeError(f"module 'wsync_ray' has no attribute {name!r}")
