"""A pytest plugin for TorchRL's own test files: every place TorchRL would build its shared-memory
or multiprocessing weight sync scheme builds a ``WsyncScheme`` instead (``shm`` and ``mp``
transports), the scheme classes the tests name included. Load with ``-p plugin``."""

from __future__ import annotations

import torchrl.collectors._multi_base as _multi_base
import torchrl.weight_update as _weight_update
import torchrl.weight_update._mp as _mp
import torchrl.weight_update._shared as _shared
import torchrl.weight_update.weight_sync_schemes as _schemes

from wsync_torchrl import WsyncScheme

__all__ = ["SharedMemWsyncScheme", "MultiProcessWsyncScheme"]


class SharedMemWsyncScheme(WsyncScheme):
    """Stands in for ``SharedMemWeightSyncScheme`` (same arguments): wsync over ``shm``."""

    def __init__(self, strategy: str = "tensordict", sync: bool = True, per_worker_weights: bool = False) -> None:
        super().__init__("shm", strategy=strategy, sync=sync)
        self.per_worker_weights = per_worker_weights


class MultiProcessWsyncScheme(WsyncScheme):
    """Stands in for ``MultiProcessWeightSyncScheme`` (same arguments): wsync over ``mp``."""

    def __init__(self, strategy: str = "tensordict", sync: bool = True) -> None:
        super().__init__("mp", strategy=strategy, sync=sync)


for _module in (_weight_update, _multi_base, _shared, _mp):
    if hasattr(_module, "SharedMemWeightSyncScheme"):
        _module.SharedMemWeightSyncScheme = SharedMemWsyncScheme
    if hasattr(_module, "MultiProcessWeightSyncScheme"):
        _module.MultiProcessWeightSyncScheme = MultiProcessWsyncScheme
_schemes._WEIGHT_SYNC_SCHEMES["shared"] = SharedMemWsyncScheme
_schemes._WEIGHT_SYNC_SCHEMES["process"] = MultiProcessWsyncScheme
