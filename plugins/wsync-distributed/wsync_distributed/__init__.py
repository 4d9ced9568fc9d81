"""wsync-distributed: the ``distributed`` transport (torch.distributed, Gloo or NCCL)."""

from __future__ import annotations

from .transport import DistributedTransport

__version__ = "0.1.0"
__all__ = ["DistributedTransport", "__version__"]
