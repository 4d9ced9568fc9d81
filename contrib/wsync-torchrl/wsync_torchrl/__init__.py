"""wsync inside TorchRL's collectors: ``WsyncScheme`` is a drop-in TorchRL weight sync scheme.

    MultiSyncCollector(..., weight_sync_schemes={"policy": WsyncScheme("shm")})
"""

from __future__ import annotations

__version__ = "0.1.0"

from .safepoint import SafePoint
from .scheme import WorkerStartupError, WsyncScheme

__all__ = ["__version__", "WsyncScheme", "WorkerStartupError", "SafePoint"]
