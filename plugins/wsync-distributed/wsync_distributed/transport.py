"""``DistributedTransport``: options, and where they come from (explicit, or a launcher's environment).

The sender (rank 0) hosts a ``TCPStore`` at ``host:port``; receiver ``i`` is rank ``i + 1``.
Nothing here touches torch.distributed's default process group: each worker gets its own link
(a two-rank group with the sender) and its own sending thread, so a dead, slow or cut-off worker
stalls no other. The sender streams: each link sends bucket k of a snapshot while the core copies
the next, and the core's header follows the bytes in a ``commit`` once the core published them;
receivers hand the core their own receive buffers, which the model adopts instead of copying
(see ``wire``, ``sender`` and ``receiver``).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from wsync_core import Capabilities, ReceiverContext, SenderContext, Transport, free_port, is_loopback
from wsync_core.transport import flag, number

from .config import Config
from .receiver import DistributedReceiver
from .sender import DistributedSender

__all__ = ["DistributedTransport"]

_BACKENDS = ("gloo", "nccl")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _local_address(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (loopback for loopback)."""
    if is_loopback(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP: no packet is sent, only the route is chosen
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class DistributedTransport(Transport):
    """Weights over torch.distributed: private Gloo (CPU) or NCCL (CUDA) links, never the default group.

    Options: ``backend`` ("gloo" | "nccl"), ``host`` and ``port`` of the sender's store (default
    127.0.0.1 and a free port, or ``MASTER_ADDR`` and ``MASTER_PORT + 1`` under torchrun),
    ``world_size`` (num_workers + 1) and ``rank`` (sender 0, worker i is i + 1; both checked, and
    read from ``WORLD_SIZE``/``RANK`` when not given), ``bucket_mb`` (size of each broadcast; the
    first is at most 8 MiB, so a streamed snapshot starts moving early),
    ``collective_timeout`` (seconds, for every collective and link set-up; the scheme's own
    ``timeout`` bounds the calls), ``heartbeat_timeout`` (seconds of heartbeat silence after
    which a worker is given up: reported Left, asked to join again), ``bind`` (this process's
    address for data connections; default: the interface that routes to ``host``), ``devices``
    (Gloo connections per link), ``stream`` (broadcast a snapshot while the core still copies it; off, the copy
    finishes first: better only where the copy and the network compete for too few cores),
    ``checksum`` (XXH3-64 checksums of every payload, checked before it is applied: damage that
    TCP's own checksum misses on a real network is caught; default on with gloo when ``host`` is
    not a loopback address, off otherwise; implies no streaming: the core checksums the whole
    payload first).
    """

    name = "distributed"
    interface = 2
    capabilities = Capabilities(processes=True, multi_host=True, cuda=True, zero_copy=False, async_send=True,
                                subset_send=True, late_join=True, auth=False)

    @staticmethod
    def multi_host_options(host_address: str) -> dict[str, Any]:
        """The conformance suite's hook: options for a sender that listens on ``host_address`` (its
        address on a bridge to another network namespace)."""
        return {"host": host_address}

    def __init__(
        self,
        *,
        backend: str = "gloo",
        host: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        bucket_mb: float = 64.0,
        collective_timeout: float = 60.0,
        heartbeat_timeout: float = 5.0,
        bind: str | None = None,
        prefix: str = "wsync",
        devices: int = 2,
        stream: bool = True,
        checksum: bool | None = None,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"distributed: backend must be one of {_BACKENDS}, got {backend!r}")
        launcher = host is None and "MASTER_ADDR" in os.environ
        if host is None:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1") if launcher else "127.0.0.1"
        if port is None:
            master_port = _env_int("MASTER_PORT") if launcher else None
            port = master_port + 1 if master_port is not None else free_port(host)
        if world_size is None and launcher:
            world_size = _env_int("WORLD_SIZE")
        if world_size is not None:
            world_size = number("distributed option world_size", world_size, 2, integer=True)
        if rank is not None:
            rank = number("distributed option rank", rank, 0, integer=True)
        super().__init__(backend=backend, host=str(host), port=number("distributed option port", port, 1, 65535,
                                                                      integer=True),
                         world_size=world_size, rank=rank,
                         bucket_mb=number("distributed option bucket_mb", bucket_mb, 0, above=True),
                         collective_timeout=number("distributed option collective_timeout", collective_timeout, 0,
                                                   above=True),
                         heartbeat_timeout=number("distributed option heartbeat_timeout", heartbeat_timeout, 0,
                                                  above=True),
                         bind=bind, prefix=str(prefix),
                         devices=number("distributed option devices", devices, 1, integer=True),
                         stream=flag("distributed option stream", stream),
                         checksum=(backend == "gloo" and not is_loopback(str(host)) if checksum is None
                                   else flag("distributed option checksum", checksum)))

    def config(self) -> Config:
        """The options resolved for this process (``rank`` from ``RANK`` under a launcher)."""
        o: dict[str, Any] = self.options
        rank = o["rank"] if o["rank"] is not None else (_env_int("RANK") if "MASTER_ADDR" in os.environ else None)
        return Config(
            backend=o["backend"], host=o["host"], port=o["port"], world_size=o["world_size"], rank=rank,
            bucket_bytes=max(1, int(o["bucket_mb"] * (1 << 20))), timeout=o["collective_timeout"],
            heartbeat_timeout=o["heartbeat_timeout"], bind=o["bind"] or _local_address(o["host"], o["port"]),
            prefix=o["prefix"], devices=o["devices"], stream=o.get("stream", True),
        )

    def sender(self, ctx: SenderContext) -> DistributedSender:
        cfg = self.config()
        if cfg.rank not in (None, 0):
            raise ValueError(f"distributed: the sender is rank 0, but rank={cfg.rank} was given")
        if cfg.world_size is not None and cfg.world_size != ctx.num_workers + 1:
            raise ValueError(f"distributed: world_size={cfg.world_size} but num_workers={ctx.num_workers}; "
                             f"world_size must be num_workers + 1 (the sender is rank 0)")
        return DistributedSender(cfg, ctx)

    def receiver(self, ctx: ReceiverContext) -> DistributedReceiver:
        cfg = self.config()
        if cfg.rank is not None and cfg.rank != ctx.worker_idx + 1:
            raise ValueError(f"distributed: worker {ctx.worker_idx} is rank {ctx.worker_idx + 1}, "
                             f"but rank={cfg.rank} was given")
        if cfg.world_size is not None and ctx.worker_idx + 1 >= cfg.world_size:
            raise ValueError(f"distributed: worker_idx {ctx.worker_idx} does not fit world_size={cfg.world_size}")
        return DistributedReceiver(cfg, ctx)
