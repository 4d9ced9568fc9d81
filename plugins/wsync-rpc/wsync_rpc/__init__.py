"""wsync-rpc: the ``rpc`` transport (torch.distributed.rpc over TensorPipe)."""

from __future__ import annotations

from .transport import RpcTransport

__version__ = "0.1.0"
__all__ = ["RpcTransport", "__version__"]
