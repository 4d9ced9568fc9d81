"""``RpcTransport``: options of the ``rpc`` transport and the endpoints it builds.

The sender is RPC worker ``wsync-sender`` (rank 0), worker ``i`` is ``wsync-worker-<i>``
(rank ``i + 1``); all ranks meet at a TCP store on ``host:port`` that the sender hosts.
"""

from __future__ import annotations


import torch.distributed.rpc as rpc
from wsync_core import Capabilities, ReceiverContext, SenderContext, Transport, free_port, is_loopback
from wsync_core.transport import flag, number

__all__ = ["RpcTransport"]

if not rpc.is_available():  # the plugin then fails to load, and `wsync transports` shows why
    raise ImportError("wsync-rpc: this torch build has no torch.distributed.rpc (rpc.is_available() is False)")




class RpcTransport(Transport):
    """Weights pushed over torch.distributed.rpc (TensorPipe) to receivers registered by name.

    Options: ``host`` and ``port`` of the rendezvous store the sender hosts (default 127.0.0.1
    and a free port, resolved once so every copy meets there), ``world_size`` (num_workers + 1;
    filled in by the sender, required by receivers started on their own), ``rpc_timeout``
    (seconds for every RPC), ``checksum`` (XXH3-64 checksums of every payload, checked before it is
    applied; default on when ``host`` is not a loopback address). One RPC agent per process: a
    process hosts one endpoint at a time.
    """

    name = "rpc"
    interface = 2
    capabilities = Capabilities(processes=True, multi_host=True, cuda=False, zero_copy=False, async_send=True,
                                subset_send=True, late_join=False, auth=False)

    @staticmethod
    def multi_host_options(host_address: str) -> dict[str, object]:
        """The conformance suite's hook: options for a sender that listens on ``host_address`` (its
        address on a bridge to another network namespace)."""
        return {"host": host_address, "rpc_timeout": 20.0}

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, world_size: int | None = None,
                 rpc_timeout: float = 60.0, checksum: bool | None = None) -> None:
        if world_size is not None:  # (num_workers + 1)
            world_size = number("rpc option world_size", world_size, 2, integer=True)
        port = free_port(str(host)) if port is None else number("rpc option port", port, 1, 65535, integer=True)
        super().__init__(host=str(host), port=port, world_size=world_size,
                         rpc_timeout=number("rpc option rpc_timeout", rpc_timeout, 0, above=True),
                         checksum=not is_loopback(str(host)) if checksum is None else flag("rpc option checksum", checksum))

    def sender(self, ctx: SenderContext):
        from .endpoints import RpcSender

        world = self.options["world_size"]
        if world is None:  # receivers learn it from the pickled copy of this transport
            self.options["world_size"] = world = ctx.num_workers + 1
        if world != ctx.num_workers + 1:
            raise ValueError(f"rpc: world_size={world} but num_workers={ctx.num_workers}; "
                             f"world_size must be num_workers + 1 (the sender is rank 0)")
        return RpcSender(self.options, ctx)

    def receiver(self, ctx: ReceiverContext):
        from .endpoints import RpcReceiver

        world = self.options["world_size"]  # None: read from the sender's store at open()
        if world is not None and ctx.worker_idx + 1 >= world:
            raise ValueError(f"rpc: worker_idx {ctx.worker_idx} does not fit world_size={world}")
        return RpcReceiver(self.options, ctx)

